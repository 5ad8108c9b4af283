"""What a batched client rule works with: a round's clients together, their data, stacked models.

A :class:`Cohort` is the batched counterpart of :class:`~pflalign.client.ClientRuntime`: the
clients of one call of the batched engine (:mod:`pflalign.engines.batched`), built by the engine
and handed to a method's ``train_cohort`` / ``evaluate_cohort`` with what the server sent each
client and each client's ``ClientState``. It knows no engine and holds no method state.

- **Models are stacked.** :meth:`Cohort.stack` turns the clients' received models into one tensor
  per trainable entry with a leading client dimension; :meth:`Cohort.views` gives client ``i``'s
  entries as views into it, so a per-client optimizer (SGD, Adam, GENIE, PFLAlign: any
  ``torch.optim`` optimizer, with its own state) steps its client's rows in place.
- **Data is never copied per client.** Each client's samples are row indices into the pooled
  image array, which is moved to the device once per process and stays there across rounds;
  every batch is gathered from it.
- **Training is in lockstep.** :meth:`Cohort.local_train` advances every client one mini-batch per
  step, each client on its own seeded batch order (:func:`~pflalign.train.batch_indices`, the
  same draws as the other engines). A client with fewer samples has fewer steps: it is masked out
  of the steps after its last one, and a smaller last batch is masked too; nothing is padded in
  its data.
- **Two backends** compute the per-client gradients of a step: ``loop`` runs plain autograd
  once per client on its exact batch, through one module whose parameters are pointed at the
  client's rows (on the CPU this is as fast as anything, the work being compute-bound, and it
  gives the sequential engine's metrics bit for bit), and ``vmap`` computes every client's
  gradient in one :func:`torch.func.vmap` call over padded batches with a mask (one kernel
  launch per layer for the whole cohort: the GPU backend; equal to the others within float32
  rounding).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from pflalign.client import ClientRuntime, Received, head_inputs
from pflalign.data import Normalizer
from pflalign.federation import federated_dataset
from pflalign.models import is_deterministic_in_training
from pflalign.train import (
    STREAM_OPTIMIZER,
    STREAM_TRAIN,
    EvalStats,
    TrainStats,
    batch_indices,
    make_generator,
)

if TYPE_CHECKING:
    from pflalign.config import Settings

Stacked = dict[str, torch.Tensor]

_POOLS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def pooled_tensors(settings: Settings, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The pooled images (uint8) and labels as tensors on ``device``: moved there once per process
    and kept (the data stays on the GPU across rounds)."""
    dataset = federated_dataset(settings).dataset
    key = (id(dataset), str(device))
    if key not in _POOLS:
        _POOLS.clear()  # one dataset per process at a time
        # taken as each client's split is taken (a NumPy gather), so that batches get the same
        # strides, and so the same convolution kernels, as on the other engines
        everything = np.arange(len(dataset.images))
        _POOLS[key] = (torch.from_numpy(dataset.images[everything]).to(device),
                       torch.from_numpy(dataset.labels[everything]).to(device))
    return _POOLS[key]


def unsupported(settings: Settings) -> str | None:
    """Why a run's clients cannot be trained as a cohort (None when they can): the cohort reads
    every client's samples straight from the pooled array and runs the model functionally."""
    federation = federated_dataset(settings)
    if federation.partition.rotations and any(federation.partition.rotations):
        return "partition = rotated gives clients rotated copies of their images"
    run = settings.run
    if run.client_failure_rate or run.client_dropout_rate or run.malicious_clients:
        return "fault injection runs inside each client's handler"
    template = ClientRuntime.template_for(settings)
    if not is_deterministic_in_training(template):
        return f"model {run.model} has batch norm or dropout (state that is not per client)"
    return None


@dataclass
class Cohort:
    """The clients of one batched call: ids, data as pooled row indices, the run's model."""

    settings: Settings
    clients: list[int]
    device: torch.device
    backend: str = "loop"

    def __post_init__(self) -> None:
        if self.backend not in ("loop", "vmap"):
            raise ValueError(f"Cohort backend must be loop or vmap, not {self.backend!r}.")
        federation = federated_dataset(self.settings)
        self.training = self.settings.training
        self.seed = self.settings.run.seed
        self.images, self.labels = pooled_tensors(self.settings, self.device)
        pool, part = federation.pool, federation.partition
        self.train_rows = [torch.from_numpy(pool[part.train[c]]).to(self.device)
                           for c in self.clients]
        self.test_rows = [torch.from_numpy(pool[part.test[c]]).to(self.device)
                          for c in self.clients]
        dataset = federation.dataset
        self.normalize = Normalizer(dataset.mean, dataset.std)
        self.num_classes = dataset.num_classes
        self.template = ClientRuntime.template_for(self.settings)
        # the cohort's own copy for training: the loop backend points its parameters at each
        # client's rows in turn, the vmap backend calls it functionally
        self.module = self.new_model()
        self._slots: dict[str, nn.Module] = {}
        self._loaded: dict[str, Mapping[str, torch.Tensor]] = {}
        self.names = [n for n, p in self.template.named_parameters() if p.requires_grad]
        self._grad = None

    def __len__(self) -> int:
        return len(self.clients)

    def num_train(self, i: int) -> int:
        return len(self.train_rows[i])

    def subset(self, indices: Sequence[int]) -> Cohort:
        """A cohort of some of these clients (``indices`` into :attr:`clients`)."""
        return Cohort(self.settings, [self.clients[i] for i in indices], self.device,
                      self.backend)

    def personal_models(self, personal: Mapping[int, Mapping[str, torch.Tensor]],
                        received: Sequence[Received],
                        fit: Callable[[Cohort, Stacked, Stacked], object],
                        ) -> dict[int, Mapping[str, torch.Tensor]]:
        """Every client's personal model: ``personal[i]`` where client ``i`` has one; for the
        others (new clients), ``fit(part, trained, anchors)`` on the cohort of just them, with
        ``trained`` (fitted in place) and ``anchors`` both stacked copies of the models they
        received."""
        out = dict(personal)
        fresh = [i for i in range(len(self)) if i not in out]
        if fresh:
            part = self.subset(fresh)
            models = [received[i].model for i in fresh]
            anchors = part.stack(models)
            trained = {n: p.clone() for n, p in anchors.items()}
            fit(part, trained, anchors)
            out.update({i: part.state_dict(trained, k, models[k]) for k, i in enumerate(fresh)})
        return out

    @staticmethod
    def optimized(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The tensors ``optimizer`` steps (a client's views), in order: where
        :meth:`local_train` puts their gradients, for a ``before_step`` to correct."""
        return [p for group in optimizer.param_groups for p in group["params"]]

    # --- models --------------------------------------------------------------------------------
    def stack(self, states: Sequence[Mapping[str, torch.Tensor]]) -> Stacked:
        """The trainable entries of one model per client, stacked along a new first dimension
        (float32 copies on the cohort's device)."""
        return {n: torch.stack([torch.as_tensor(s[n]) for s in states]).to(self.device)
                for n in self.names}

    def views(self, params: Stacked, i: int, names: Sequence[str] | None = None,
              ) -> list[torch.Tensor]:
        """Client ``i``'s entries ``names`` (default: every trainable one, in :attr:`names`
        order), as views into ``params``: an optimizer over them steps client ``i``'s rows."""
        return [params[n][i] for n in (self.names if names is None else names)]

    def state_dict(self, params: Stacked, i: int, received: Mapping[str, torch.Tensor],
                   ) -> dict[str, torch.Tensor]:
        """Client ``i``'s full model state: its trained entries, and the received model's other
        entries (buffers, frozen parameters), in the model's state-dict order."""
        return {k: params[k][i] if k in params else received[k]
                for k in self.template.state_dict()}

    def new_model(self, state: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
        """A fresh module of the run's model (a copy of the template), loaded with ``state``
        if given, on the cohort's device: for a method's own models (heads, policies)."""
        module = copy.deepcopy(self.template)
        if state is not None:
            module.load_state_dict(state)
        return module.to(self.device)

    def head_inputs(self, i: int, model: nn.Module, head: nn.Module,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`~pflalign.client.ClientRuntime.head_inputs` for client ``i``: what ``head``
        (the model's last layer) receives for its train samples ``rows`` (all when None), in
        eval mode, in chunks of 256."""
        if rows is None:
            rows = torch.arange(self.num_train(i), device=self.device)
        return head_inputs(model, head, (self.batch(i, rows[start:start + 256])[0]
                                         for start in range(0, len(rows), 256)))

    def model(self, state: Mapping[str, torch.Tensor], slot: str = "model") -> nn.Module:
        """A module loaded with ``state``, for evaluation: one reused module per ``slot`` (loading
        copies the values in; no module is built per client; the same ``state`` object again is
        not reloaded). A model held while another is loaded needs another slot; a module from
        here is read-only (a changed model is loaded from a changed state)."""
        if slot not in self._slots:
            self._slots[slot] = self.new_model()
        module = self._slots[slot]
        if self._loaded.get(slot) is not state:  # the same record again (the global model)
            module.load_state_dict(state)
            self._loaded[slot] = state
        return module

    # --- training ------------------------------------------------------------------------------
    def generator(self, i: int, server_round: int, *streams: int) -> torch.Generator:
        return make_generator(self.seed, server_round, self.clients[i], *streams)

    def optimizers(self, params: Stacked, server_round: int, stream: int = STREAM_TRAIN,
                   names: Sequence[str] | None = None) -> list[torch.optim.Optimizer]:
        """The run's ``local-optimizer`` for each client over its views of ``names`` (default:
        all), seeded as :meth:`~pflalign.client.ClientRuntime.make_optimizer` seeds it."""
        return [self.training.optimizer(
            self.views(params, i, names),
            self.generator(i, server_round, STREAM_OPTIMIZER, stream))
            for i in range(len(self))]

    def orders(self, server_round: int, stream: int = STREAM_TRAIN, epochs: int | None = None,
               ) -> list[Iterator[torch.Tensor]]:
        """Each client's index batches for (round, ``stream``), as
        :meth:`~pflalign.client.ClientRuntime.batch_order` gives them (``epochs=None``: the
        round's local training, capped at ``local-steps``; else that many epochs in full)."""
        t = self.training
        return [batch_indices(self.num_train(i), t.batch_size,
                              t.local_epochs if epochs is None else epochs,
                              t.local_steps if epochs is None else 0,
                              self.generator(i, server_round, stream), self.device)
                for i in range(len(self))]

    def _masked_loss(self, trained: Stacked, fixed: Stacked, x: torch.Tensor, y: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
        losses = F.cross_entropy(functional_call(self.module, {**fixed, **trained}, (x,)), y,
                                 reduction="none")
        return (losses * mask).sum() / mask.sum().clamp_min(1)

    def local_train(self, params: Stacked, server_round: int,
                    optimizers: Sequence[torch.optim.Optimizer],
                    stream: int = STREAM_TRAIN, epochs: int | None = None,
                    names: Sequence[str] | None = None,
                    before_step: Callable[[int], None] | None = None) -> list[TrainStats]:
        """Every client's round of local training, in lockstep, as
        :meth:`~pflalign.client.ClientRuntime.local_train` trains one client: shuffled by
        (seed, round, client, ``stream``); ``epochs=None`` is ``local-epochs`` capped at
        ``local-steps``, an explicit ``epochs`` runs in full.

        ``params`` holds every trainable entry of the model, stacked; ``names`` (default: all)
        are the ones trained, the others held fixed. Client ``i``'s optimizer steps views of its
        rows of the ``names`` entries, in that order (:meth:`views`, :meth:`optimizers`).
        ``before_step(i)`` runs after client ``i``'s gradient is set on those views and before
        its optimizer steps (a method's gradient correction). Returns each client's
        :class:`~pflalign.train.TrainStats`."""
        names = tuple(self.names if names is None else names)
        missing = [n for n in self.names if n not in params]
        if missing:
            raise ValueError(f"Cohort.local_train: params lacks the model's entries {missing}.")
        orders = self.orders(server_round, stream, epochs)
        views = [self.optimized(opt) for opt in optimizers]
        if any(len(v) != len(names) for v in views):
            raise ValueError("Cohort.local_train: each optimizer must step one view per trained "
                             f"entry ({len(names)}), in order.")
        loss_sums = [torch.zeros((), device=self.device) for _ in range(len(self))]
        seen = [0] * len(self)
        steps = [0] * len(self)
        # plain SGD for every client under vmap: one stacked step for the cohort (on a GPU, one
        # kernel per entry instead of one per client and entry)
        lr = (self._plain_sgd(optimizers, views, params, names)
              if self.backend == "vmap" and before_step is None else None)
        self.module.train()
        for batch, active in self.lockstep(orders):
            if lr is not None:
                losses = self._stacked_sgd_step(params, names, batch, active, lr)
                for i in active:
                    loss_sums[i] += losses[i] * len(batch[i])
                    seen[i] += len(batch[i])
                    steps[i] += 1
                continue
            grads, losses = self.grads(params, names, batch, active)
            for i in active:
                for view, g in zip(views[i], grads[i], strict=True):
                    view.grad = g
                if before_step is not None:
                    before_step(i)
                optimizers[i].step()
                for view in views[i]:
                    view.grad = None
                loss_sums[i] += losses[i] * len(batch[i])
                seen[i] += len(batch[i])
                steps[i] += 1
        return [TrainStats(loss=float(loss_sums[i]) / max(seen[i], 1), steps=steps[i],
                           samples=seen[i]) for i in range(len(self))]

    @staticmethod
    def lockstep(orders: Sequence[Iterator[torch.Tensor]],
                 ) -> Iterator[tuple[list[torch.Tensor | None], list[int]]]:
        """Step through every client's batch order together: per step, each client's next
        index batch (None once its order is done) and the clients that have one."""
        while True:
            batch = [next(order, None) for order in orders]
            active = [i for i, idx in enumerate(batch) if idx is not None]
            if not active:
                return
            yield batch, active

    def padded(self, batch: Sequence[torch.Tensor | None], active: Sequence[int],
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The active clients' batches as one padded tensor: inputs ``(clients, longest, ...)``,
        labels and a float mask of the real samples (for a vmapped, masked loss)."""
        size = max(len(batch[i]) for i in active)
        rows = torch.zeros((len(active), size), dtype=torch.long, device=self.device)
        mask = torch.zeros((len(active), size), dtype=torch.float32, device=self.device)
        for k, i in enumerate(active):
            n = len(batch[i])
            rows[k, :n] = self.train_rows[i][batch[i]]
            mask[k, :n] = 1.0
        x = self.normalize(self.images[rows.flatten()]).unflatten(0, (len(active), size))
        return x, self.labels[rows], mask

    @staticmethod
    def _plain_sgd(optimizers: Sequence[torch.optim.Optimizer], views: list[list[torch.Tensor]],
                   params: Stacked, names: tuple[str, ...]) -> float | None:
        """The learning rate when every client's optimizer is SGD without momentum, weight
        decay, Nesterov or maximize, all with one rate and over exactly its rows of ``names``
        (so that ``p -= lr g`` on the stacked tensors is every client's step); else None."""
        rates = set()
        for i, opt in enumerate(optimizers):
            if type(opt) is not torch.optim.SGD or len(opt.param_groups) != 1:
                return None
            group = opt.param_groups[0]
            if (group["momentum"] or group["weight_decay"] or group["nesterov"]
                    or group["maximize"] or group.get("differentiable")):
                return None
            if any(v.data_ptr() != params[n][i].data_ptr() or v.shape != params[n][i].shape
                   for v, n in zip(views[i], names, strict=True)):
                return None
            rates.add(float(group["lr"]))
        return rates.pop() if len(rates) == 1 else None

    def _stacked_sgd_step(self, params: Stacked, names: tuple[str, ...], batch: list,
                          active: list[int], lr: float) -> dict[int, torch.Tensor]:
        g, loss = self._vmap_stacked(params, names, batch, active)
        chosen = None if len(active) == len(self) else torch.tensor(active, device=self.device)
        with torch.no_grad():
            for n in names:
                if chosen is None:
                    params[n].add_(g[n], alpha=-lr)
                else:
                    params[n].index_copy_(0, chosen, params[n].index_select(0, chosen).add_(
                        g[n], alpha=-lr))
        return {i: loss[k].detach() for k, i in enumerate(active)}

    def batch(self, i: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Client ``i``'s normalised train samples ``idx`` (positions in its train split) and
        their labels, gathered from the pooled arrays."""
        rows = self.train_rows[i][idx]
        return self.normalize(self.images[rows]), self.labels[rows]

    def _split(self, params: Stacked, names: tuple[str, ...], rows: torch.Tensor | None,
               ) -> tuple[Stacked, Stacked]:
        """(trained, fixed) entries of the clients ``rows`` (all clients: None)."""
        pick = (lambda p: p) if rows is None else (lambda p: p[rows])
        trained = {n: pick(params[n]) for n in names}
        return trained, {n: pick(p) for n, p in params.items() if n not in trained}

    def grads(self, params: Stacked, names: Sequence[str], batch: list, active: list[int],
              ) -> tuple[dict[int, list[torch.Tensor]], dict[int, torch.Tensor]]:
        """The cross-entropy gradients of the ``names`` entries (the others held fixed) and the
        losses of the clients ``active``, client ``i`` on its ``batch[i]`` (positions in its
        train split): one :func:`torch.func.grad` call per client (``loop``) or one vmapped
        call for them all (``vmap``)."""
        fn = self._loop_grads if self.backend == "loop" else self._vmap_grads
        return fn(params, tuple(names), batch, active)

    def _loop_grads(self, params: Stacked, names: tuple[str, ...], batch: list,
                    active: list[int],
                    ) -> tuple[dict[int, list[torch.Tensor]], dict[int, torch.Tensor]]:
        """Per client, plain autograd through :attr:`module` with its parameters pointed at
        the client's rows (no copy): the sequential engine's computation exactly, without the
        per-call cost of a functional transform (a quarter of a step at batch 10 on the CPU)."""
        shell = {n: p for n, p in self.module.named_parameters() if n in params}
        trained = set(names)
        grads, losses = {}, {}
        try:
            for n, p in shell.items():
                p.requires_grad_(n in trained)
            for i in active:
                for n, p in shell.items():
                    p.data = params[n][i]
                x, y = self.batch(i, batch[i])
                loss = F.cross_entropy(self.module(x), y)
                loss.backward()
                grads[i], losses[i] = [shell[n].grad for n in names], loss.detach()
                for n in names:
                    shell[n].grad = None
        finally:
            for p in shell.values():
                p.requires_grad_(True)
        return grads, losses

    def _vmap_grads(self, params: Stacked, names: tuple[str, ...], batch: list,
                    active: list[int],
                    ) -> tuple[dict[int, list[torch.Tensor]], dict[int, torch.Tensor]]:
        g, loss = self._vmap_stacked(params, names, batch, active)
        return ({i: [g[n][k] for n in names] for k, i in enumerate(active)},
                {i: loss[k].detach() for k, i in enumerate(active)})

    def _vmap_stacked(self, params: Stacked, names: tuple[str, ...], batch: list,
                      active: list[int]) -> tuple[Stacked, torch.Tensor]:
        """The active clients' gradients (stacked, in ``active`` order) and losses, in one
        vmapped call over their batches padded to the longest, with a mask."""
        if self._grad is None:
            self._grad = vmap(grad_and_value(self._masked_loss))
        x, y, mask = self.padded(batch, active)
        chosen = None if len(active) == len(self) else torch.tensor(active, device=self.device)
        return self._grad(*self._split(params, names, chosen), x, y, mask)

    # --- evaluation ----------------------------------------------------------------------------
    @torch.inference_mode()
    def test(self, model: nn.Module, i: int, batch_size: int = 256) -> EvalStats:
        """Client ``i``'s test counts and summed loss of ``model``, computed as
        :func:`pflalign.train.evaluate` computes them (the same chunks, the same sums)."""
        model.eval()
        rows = self.test_rows[i]
        correct, loss_sum = 0, 0.0
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            logits = model(self.normalize(self.images[chunk]))
            targets = self.labels[chunk]
            correct += int((logits.argmax(dim=1) == targets).sum())
            loss_sum += float(F.cross_entropy(logits, targets, reduction="sum"))
        return EvalStats(correct=correct, loss_sum=loss_sum, count=len(rows))

    @staticmethod
    def eval_metrics(personal: EvalStats, global_: EvalStats | None = None) -> dict:
        return ClientRuntime.eval_metrics(personal, global_)


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto``: ``vmap`` on a GPU, ``loop`` on the CPU (measured there: vmap's grouped
    convolutions run slower than one client at a time, the CPU being compute-bound)."""
    if backend == "auto":
        return "vmap" if device.type == "cuda" else "loop"
    return backend

