"""What FedPer, FedRep and FedBN share: part of the model is exchanged, the rest stays personal.

The server sends only the shared entries; the personal entries (a head, or the batch-norm layers)
live in the client's state and never leave it, so the traffic is the shared part's. A client that
has no personal part yet starts it from the run's initial model (the seeded template, identical to
the server's initial state). There is no global model to score: ``global-acc`` is not reported.

New-client procedure (unseen clients, and seen clients scored before their first training): the
shared part is frozen and the personal part is fitted on the client's own train split for
``finetune-epochs`` epochs (the run's local optimizer), then the model is scored.

Batched rules (``engine = batched``): the same steps on the cohort's stacked models; a head
trained alone is trained on its client's features as here (:func:`_train_heads_on_features`).
FedBN is not batched: the cohort keeps no per-client batch-norm statistics.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from pflalign.client import ClientRuntime, Received, Upload
from pflalign.method import Method
from pflalign.methods.fedavg_ft import FINETUNE_HELP
from pflalign.params import Params, param
from pflalign.protocol import LOCAL_STEPS, TRAIN_LOSS
from pflalign.state import ArrayState, TorchState
from pflalign.train import STREAM_FINETUNE, STREAM_OPTIMIZER, TrainStats, train_local

if TYPE_CHECKING:
    from pflalign.cohort import Cohort, Stacked

#: one phase of a round's local training: (trained entries, seeded stream, epochs or None)
Phase = tuple[tuple[str, ...], int, int | None]

HEAD_LAYERS_HELP = ("fedper, fedrep: number of final parameterised layers kept on the clients "
                    "(the personal head); 1 is the classifier.")


@dataclass(frozen=True)
class PartialParams(Params):
    group = "fedper/fedrep/fedbn"

    finetune_epochs: int = param(1, FINETUNE_HELP, key="finetune-epochs", minimum=1,
                                 group="fedavg-ft")


@dataclass
class PartialClientState(ArrayState):
    #: the personal entries of the client's model
    personal: TorchState | None = None


class PartialModel(Method):
    """Shared entries from the server, personal entries from the client's state."""

    Params = PartialParams
    ClientState = PartialClientState
    has_global_model = False

    def personal_entries(self, model: nn.Module) -> tuple[str, ...]:
        """The personal entries of ``model`` (a model of the run)."""
        raise NotImplementedError

    def personal_keys(self, server: object) -> tuple[str, ...]:
        return self.personal_entries(server.template_model())  # type: ignore[attr-defined]

    def phases(self, model: nn.Module) -> list[Phase] | None:
        """A round's local training as phases run in order, each training only its entries
        (:meth:`train_part`); None (FedPer, FedBN): every parameter jointly, ``local-epochs``.
        ``model``: the run's template. The last phase's statistics are reported."""
        return None

    @staticmethod
    def _start(template: Mapping[str, torch.Tensor], received: Received,
               state: PartialClientState) -> dict[str, torch.Tensor]:
        """A client's full model state before its action: the run's initial model, overlaid
        with its personal entries, then with the shared entries received."""
        return {**template, **(state.personal or {}), **(received.model or {})}

    def _model(self, client: ClientRuntime, received: Received,
               state: PartialClientState) -> nn.Module:
        return client.new_model(self._start(client.template().state_dict(), received, state))

    def _reply(self, entries: Mapping[str, torch.Tensor], personal: set[str], stats: TrainStats,
               ) -> tuple[Upload, PartialClientState]:
        """The shared entries uploaded, the personal ones kept in the client's state."""
        upload = Upload({k: v for k, v in entries.items() if k not in personal},
                        {TRAIN_LOSS: stats.loss, LOCAL_STEPS: stats.steps})
        return upload, PartialClientState({k: v for k, v in entries.items() if k in personal})

    def train_part(self, client: ClientRuntime, model: nn.Module, keys: tuple[str, ...],
                   server_round: int, stream: int, epochs: int | None) -> TrainStats:
        """Train only the parameters named in ``keys``; the others are frozen, and so are the
        buffers (batch-norm statistics) of layers with no trained parameter. ``epochs=None`` is
        the round's local training (``local-epochs`` capped at ``local-steps``)."""
        wanted = set(keys)
        named = [(n, p) for n, p in model.named_parameters()]
        chosen = [p for n, p in named if n in wanted]
        frozen = [p for n, p in named if n not in wanted and p.requires_grad]
        kept = {}  # buffers of layers none of whose parameters are trained
        for module_name, module in model.named_modules():
            prefix = f"{module_name}." if module_name else ""
            if not any(prefix + n in wanted for n, _ in module.named_parameters(recurse=False)):
                kept.update({prefix + n: b.clone()
                             for n, b in module.named_buffers(recurse=False)})
        for p in frozen:
            p.requires_grad_(False)
        try:
            head = client.last_layer_owning(model, keys)
            if head is not None:
                return self._train_head_on_features(client, model, head, server_round, stream,
                                                    epochs)
            return client.local_train(model, server_round, stream=stream, epochs=epochs,
                                      optimizer=client.make_optimizer(chosen, server_round,
                                                                      stream))
        finally:
            for p in frozen:
                p.requires_grad_(True)
            if kept:
                model.load_state_dict(kept, strict=False)

    @staticmethod
    def _train_head_on_features(client: ClientRuntime, model: nn.Module, head: nn.Module,
                                server_round: int, stream: int, epochs: int | None,
                                ) -> TrainStats:
        """Head-only training on the frozen body's features computed once: the same batches and
        updates as training through the frozen body, at the cost of one forward pass of it."""
        features = client.head_inputs(model, head)
        model.train()
        return client.local_train(head, server_round, stream=stream, epochs=epochs,
                                  optimizer=client.make_optimizer(head.parameters(), server_round,
                                                                  stream),
                                  features=features)

    def train_round(self, client: ClientRuntime, model: nn.Module,
                    server_round: int) -> TrainStats:
        """One round of local training: :meth:`phases` in order, or (FedPer, FedBN) every
        parameter jointly."""
        phases = self.phases(client.template())
        if phases is None:
            return client.local_train(model, server_round)
        for keys, stream, epochs in phases:
            stats = self.train_part(client, model, keys, server_round, stream, epochs)
        return stats

    def train(self, client: ClientRuntime, received: Received, state: PartialClientState,
              ) -> tuple[Upload, PartialClientState]:
        model = self._model(client, received, state)
        stats = self.train_round(client, model, received.server_round)
        return self._reply(model.state_dict(), set(self.personal_entries(client.template())),
                           stats)

    def evaluate(self, client: ClientRuntime, received: Received,
                 state: PartialClientState) -> dict:
        model = self._model(client, received, state)
        if state.personal is None:
            self.train_part(client, model, self.personal_entries(client.template()),
                            received.server_round, STREAM_FINETUNE, self.params.finetune_epochs)
        return client.eval_metrics(client.test(model))

    # --- batched client rules (the batched engine) ----------------------------------------------
    def cohort_unsupported(self) -> str | None:
        reason = super().cohort_unsupported()
        if reason is None and _owner(type(self), "train_round") is not _owner(
                type(self), "train_round_cohort"):
            reason = "it has no batched train_round rule: train_round_cohort"
        return reason

    def train_part_cohort(self, cohort: Cohort, params: Stacked,
                          starts: Sequence[Mapping[str, torch.Tensor]], keys: tuple[str, ...],
                          server_round: int, stream: int, epochs: int | None,
                          ) -> list[TrainStats]:
        """:meth:`train_part` for every client of ``cohort`` (their models stacked in
        ``params``; ``starts[i]``: client ``i``'s other entries). The cohort's models have no
        batch norm, so no buffer is to be kept."""
        wanted = set(keys)
        names = [n for n in cohort.names if n in wanted]
        head = ClientRuntime.last_layer_owning(cohort.template, keys)
        if head is not None:
            return _train_heads_on_features(cohort, params, starts, head, names, server_round,
                                            stream, epochs)
        return cohort.local_train(params, server_round,
                                  cohort.optimizers(params, server_round, stream, names),
                                  stream=stream, epochs=epochs, names=names)

    def train_round_cohort(self, cohort: Cohort, params: Stacked,
                           starts: Sequence[Mapping[str, torch.Tensor]], server_round: int,
                           ) -> list[TrainStats]:
        """:meth:`train_round` for every client of ``cohort``."""
        phases = self.phases(cohort.template)
        if phases is None:
            return cohort.local_train(params, server_round,
                                      cohort.optimizers(params, server_round))
        for keys, stream, epochs in phases:
            stats = self.train_part_cohort(cohort, params, starts, keys, server_round, stream,
                                           epochs)
        return stats

    def train_cohort(self, cohort: Cohort, received: Sequence[Received],
                     states: Sequence[PartialClientState],
                     ) -> list[tuple[Upload, PartialClientState]]:
        server_round = received[0].server_round
        template = cohort.template.state_dict()
        starts = [self._start(template, r, s) for r, s in zip(received, states, strict=True)]
        params = cohort.stack(starts)
        stats = self.train_round_cohort(cohort, params, starts, server_round)
        personal = set(self.personal_entries(cohort.template))
        return [self._reply(cohort.state_dict(params, i, starts[i]), personal, stats[i])
                for i in range(len(cohort))]

    def evaluate_cohort(self, cohort: Cohort, received: Sequence[Received],
                        states: Sequence[PartialClientState]) -> list[dict]:
        template = cohort.template.state_dict()
        models = [self._start(template, r, s) for r, s in zip(received, states, strict=True)]
        fresh = [i for i, s in enumerate(states) if s.personal is None]
        if fresh:  # a client without a personal part fits it, as in evaluate
            part = cohort.subset(fresh)
            starts = [models[i] for i in fresh]
            params = part.stack(starts)
            self.train_part_cohort(part, params, starts, self.personal_entries(cohort.template),
                                   received[0].server_round, STREAM_FINETUNE,
                                   self.params.finetune_epochs)
            for k, i in enumerate(fresh):
                models[i] = part.state_dict(params, k, starts[k])
        return [cohort.eval_metrics(cohort.test(cohort.model(models[i], "partial"), i))
                for i in range(len(cohort))]


def _owner(cls: type, attribute: str) -> type | None:
    """The class of ``cls``'s MRO that defines ``attribute``."""
    return next((c for c in cls.__mro__ if attribute in vars(c)), None)



def _train_heads_on_features(cohort: Cohort, params: Stacked,
                             starts: Sequence[Mapping[str, torch.Tensor]], head: nn.Module,
                             names: Iterable[str], server_round: int, stream: int,
                             epochs: int | None) -> list[TrainStats]:
    """:meth:`PartialModel._train_head_on_features` for every client of ``cohort``: each
    client's features from its model (its rows of ``params``, the rest from ``starts[i]``), then
    its head (``head``: the template's last layer, owning the entries ``names``) trained on them
    by :func:`~pflalign.train.train_local` as :meth:`ClientRuntime.local_train` trains it, on
    a copy of the layer whose trained values are written back to the client's rows. The head is
    one small layer: trained client by client, on either backend."""
    names = list(names)
    prefix = next(name for name, module in cohort.template.named_modules() if module is head)
    local = [n[len(prefix) + 1:] if prefix else n for n in names]
    t = cohort.training
    out = []
    for i in range(len(cohort)):
        model = cohort.model(cohort.state_dict(params, i, starts[i]), "partial-body")
        features = cohort.head_inputs(i, model, model.get_submodule(prefix))
        layer = copy.deepcopy(head).to(cohort.device)
        layer.load_state_dict(dict(zip(local, cohort.views(params, i, names), strict=True)))
        trained = dict(layer.named_parameters())
        optimizer = t.optimizer([trained[n] for n in local],
                                cohort.generator(i, server_round, STREAM_OPTIMIZER, stream))
        out.append(train_local(
            layer, features, cohort.labels[cohort.train_rows[i]], _identity,
            optimizer=optimizer, batch_size=t.batch_size,
            epochs=t.local_epochs if epochs is None else epochs,
            max_steps=t.local_steps if epochs is None else 0,
            generator=cohort.generator(i, server_round, stream)))
        with torch.no_grad():
            for view, n in zip(cohort.views(params, i, names), local, strict=True):
                view.copy_(trained[n])
    return out


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class HeadParams(PartialParams):
    head_layers: int = param(1, HEAD_LAYERS_HELP, key="head-layers", minimum=1,
                             group="fedper/fedrep")

