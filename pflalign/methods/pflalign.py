"""pFLAlign (Kim et al., Personalized Federated Learning for Gradient Alignment, arXiv
2605.02143; ALGORITHMS.md 1).

Client, one round on client i (1.7, 1.8):

1. ``theta <- theta_g + Delta_i`` (trainable parameters only; buffers come from ``theta_g``, or
   from the client's own copy with ``pflalign-bn = local``, 1.13 A6);
2. ``T`` steps of :class:`pflalign.optim.PFLAlign` (``m`` reset; ``v``, ``P`` persistent);
3. ``Delta_i <- theta_end - theta_g`` against the global model received this round.

Where ``Delta_i`` lives is ``pflalign-state``: ``client`` keeps it in the client's state;
``server`` keeps it in the server state, sends ``theta_g + Delta_i`` as the model and ``Delta_i``
as ``offset`` in client i's own message, and computes the new offset from the upload
(``Delta_i = theta_i^end - theta_g^r``, trainable entries only, A6). Both modes compute the same
numbers in float32, so they give identical metrics; they differ in bytes and in where the offsets
are kept. ``v`` and ``P`` stay on the client in both modes: they are never sent (1.5). Clients not
sampled keep their offsets untouched; a first participation starts from ``Delta = 0``.

With ``pflalign-local-update = genie`` (the ``pflalign-genie`` variant, ALGORITHMS.md 4.2) step
2 is GENIE's rule instead, with ``m``, ``s`` and the step count persistent per client and no offset
correction; the rest of the round is unchanged.

Server (AggregationRobustPersonalization, 1.5-1.7): FedAvg by sample count (1.6); the alignment
lives in each client's personalized initialization and the gamma-weighted correction. Per round
it records mean P and mean gamma over the clients, the mean norm of their offsets, and the mean
cosine between each client's update and the aggregated update.

Evaluation (1.12): ``personal-acc`` is ``theta_end`` from the client's last participation (scored
right after training when the server flags that no further training of this client precedes the
next evaluation, and kept in the client's state); ``personal-acc-next`` is ``theta_g + Delta_i``,
the next round's starting point; ``global-acc`` is ``theta_g``. A client that never trained uses
``theta_g + 0``, so unseen clients get the global model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from pflalign.aggregation import State, l2_norm, personal_offset, personalized_init
from pflalign.client import ClientRuntime, Received, Upload
from pflalign.method import Method, Payload, Update
from pflalign.optim import GAMMA_MODES, GENIE, PFLAlign
from pflalign.options import Value
from pflalign.params import Params, param
from pflalign.protocol import LOCAL_STEPS, MODEL, NEXT_CORRECT, TRAIN_LOSS
from pflalign.server import ServerRuntime
from pflalign.state import ArrayState, ServerState, TorchState
from pflalign.train import (
    STREAM_OPTIMIZER,
    STREAM_TRAIN,
    EvalStats,
    LocalTraining,
    TrainStats,
    num_local_steps,
)

if TYPE_CHECKING:
    from pflalign.cohort import Cohort

OFFSET, PERSONAL = "offset", "personal"
#: the per-client config flag: score the model right after training (personal-acc)
EVALUATE_AFTER_FIT = "evaluate-after-fit"


@dataclass(frozen=True)
class PFLAlignParams(Params):
    prefix = "pflalign"

    lr: float = param(3.0, "Local learning rate. The preconditioner P is far below 1 (it starts "
                      "at (1-beta)^2 = 0.01), so this is of order 1, not an SGD rate.",
                      minimum=0.0, exclusive_minimum=True, search=(1.0, 2.0, 3.0, 5.0, 10.0))
    beta: float = param(0.9, "EMA decay of m, v and P.", minimum=0.0, maximum=1.0,
                        exclusive_maximum=True, search=(0.8, 0.9, 0.95))
    eps: float = param(1e-12, "Numerical constant in the denominators.", minimum=0.0,
                       exclusive_minimum=True)
    precondition: bool = param(True, "Multiply the gradient by P (false: step on the raw "
                               "gradient with the SGD rate 'lr').")
    gamma: str = param("adaptive", "Weight of the offset correction: adaptive (Gaussian sign "
                       "agreement), zero, half, one, or hard (sign test).", choices=GAMMA_MODES)
    personalize: bool = param(True, "Start each round from global + the client's offset Delta "
                              "(false: Delta = 0, no personalized initialization or "
                              "correction).")
    state: str = param("client", "Where each client's offset Delta lives: client (its own "
                       "state; the server sends the global model) or server (the server keeps it "
                       "and sends the personalized initialization and Delta in the client's "
                       "message).", choices=("client", "server"))
    local_update: str = param("pflalign", "The PersonalizedLocalUpdate: pflalign (preconditioner "
                              "P and gamma correction, ALGORITHMS.md 1.4) or genie (GENIE's rule "
                              "with per-client persistent state and no offset correction, 4.2).",
                              choices=("pflalign", "genie"))
    bn: str = param("global", "Batch-norm buffers come from the global model (global, "
                    "ALGORITHMS.md 1.13 A6) or stay on each client (local, FedBN-style).",
                    choices=("global", "local"))


@dataclass
class PFLAlignClientState(ArrayState):
    #: Delta_i (trainable entries; client-held state only)
    offset: TorchState | None = None
    #: the local update's persistent state: ``<param>.v`` / ``<param>.P`` (PFLAlign) or
    #: ``<param>.m`` / ``<param>.s`` / ``<param>.step`` (GENIE)
    optimizer: TorchState | None = None
    #: the client's own batch-norm buffers (pflalign-bn = local)
    buffers: TorchState | None = None
    #: theta_end scored right after the last flagged training: correct, count, summed loss
    fit_correct: int | None = None
    fit_count: int | None = None
    fit_loss_sum: float | None = None


@dataclass
class PFLAlignServerState(ServerState):
    #: Delta_i per client (server-held state only)
    offsets: dict[int, State] = field(default_factory=dict)


class PFLAlignMethod(Method):
    name = "pflalign"
    summary = ("pFLAlign: clients start from global + their offset Delta and train with a "
               "persistent multiplicative preconditioner P and a gamma-weighted removal of "
               "Delta; the server averages (ALGORITHMS.md 1).")
    paper = ("Kim et al., Personalized Federated Learning for Gradient Alignment (pFLAlign), "
             "arXiv 2605.02143")
    Params = PFLAlignParams
    tuned_training = ()  # its step size is pflalign-lr (lr only without the preconditioner)

    @classmethod
    def search_space(cls, fixed: Mapping[str, Value]) -> dict[str, tuple[Value, ...]]:
        space = super().search_space(fixed)
        if fixed.get("pflalign-precondition") is False:  # steps with the SGD rate 'lr'
            from pflalign.train import LocalTraining

            space = {"lr": LocalTraining.search_space()["lr"],
                     **{k: v for k, v in space.items() if k != "pflalign-lr"}}
        return space
    ClientState = PFLAlignClientState
    ServerState = PFLAlignServerState
    local_optimizer = False
    client_diagnostics = ("mean-P", "mean-gamma")

    @property
    def server_mode(self) -> bool:
        return self.params.state == "server"

    @property
    def genie(self) -> bool:
        return self.params.local_update == "genie"

    # --- client --------------------------------------------------------------------------------
    def _offset(self, received: Received, state: PFLAlignClientState) -> TorchState | None:
        """Delta_i: from the message in server mode, from the client's state in client mode."""
        if not self.params.personalize:
            return None
        return received.arrays.get(OFFSET) if self.server_mode else state.offset

    def _model(self, client: ClientRuntime, weights: TorchState | None,
               state: PFLAlignClientState) -> nn.Module:
        """A model loaded with ``weights``, with this client's own buffers in local-BN mode."""
        model = client.new_model(weights)
        if self.params.bn == "local" and state.buffers:
            model.load_state_dict(state.buffers, strict=False)
        return model

    def _local_update(self, named: list[tuple[str, torch.Tensor]], training: LocalTraining,
                      generator: torch.Generator, state: PFLAlignClientState,
                      ) -> torch.optim.Optimizer:
        """PFLAlign (or GENIE, its mask and noise drawn from ``generator``) over the trainable
        entries ``named`` with this client's persisted state."""
        p = self.params
        saved = state.optimizer
        if self.genie:
            optimizer = GENIE([q for _, q in named], **training.genie_options(),
                              generator=generator)
            if saved:
                for name, q in named:
                    optimizer.state[q].update(step=int(saved[f"{name}.step"]),
                                              m=saved[f"{name}.m"].to(q.device),
                                              s=saved[f"{name}.s"].to(q.device))
        else:
            optimizer = PFLAlign([q for _, q in named],
                                 lr=p.lr if p.precondition else training.lr,
                                 beta=p.beta, eps=p.eps, precondition=p.precondition,
                                 gamma=p.gamma)
            if saved:  # freshly deserialized tensors: the optimizer may own them
                for name, q in named:
                    optimizer.state[q]["v"] = saved[f"{name}.v"].to(q.device)
                    optimizer.state[q]["P"] = saved[f"{name}.P"].to(q.device)
        return optimizer

    def _begin(self, named: list[tuple[str, torch.Tensor]], offset: TorchState | None,
               training: LocalTraining, generator: torch.Generator, num_train: int,
               state: PFLAlignClientState, device: torch.device) -> torch.optim.Optimizer:
        """Start a client's round on its trainable entries ``named`` (the received model): add
        Delta_i (client-held state), build the local update, and begin its round."""
        names = [n for n, _ in named]
        optimizer = self._local_update(named, training, generator, state)
        if offset and not self.server_mode:  # server mode receives theta_g + Delta already
            with torch.no_grad():
                torch._foreach_add_([q for _, q in named], [offset[n].to(device) for n in names])
        if not self.genie:
            steps = num_local_steps(num_train, training.batch_size, training.local_epochs,
                                    training.local_steps)
            optimizer.begin_round([offset[n] for n in names] if offset else None, steps)
        return optimizer

    def _end(self, named: list[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer,
             start: TorchState, state: PFLAlignClientState, device: torch.device,
             model_state: Mapping[str, torch.Tensor], stats: TrainStats,
             ) -> tuple[PFLAlignClientState, dict]:
        """A client's new state and metrics after its local training."""
        names = [n for n, _ in named]
        new = dataclasses.replace(state, optimizer=self._optimizer_state(optimizer, names))
        if self.params.personalize and not self.server_mode:
            with torch.no_grad():
                new_offset = torch._foreach_sub([q for _, q in named],
                                                [start[n].to(device) for n in names])
            new.offset = dict(zip(names, new_offset, strict=True))
        if self.params.bn == "local":
            new.buffers = {k: v for k, v in model_state.items() if k not in set(names)}
        metrics = {TRAIN_LOSS: stats.loss, LOCAL_STEPS: stats.steps}
        if not self.genie:
            metrics.update({"mean-P": optimizer.mean_preconditioner(),
                            "mean-gamma": optimizer.mean_gamma()})
        return new, metrics

    def _optimizer_state(self, optimizer: torch.optim.Optimizer, names: list[str]) -> TorchState:
        params = [q for group in optimizer.param_groups for q in group["params"]]
        record: TorchState = {}
        for name, q in zip(names, params, strict=True):
            s = optimizer.state[q]
            if self.genie:
                record.update({f"{name}.m": s["m"], f"{name}.s": s["s"],
                               f"{name}.step": torch.tensor(s["step"])})
            else:
                record.update({f"{name}.v": s["v"], f"{name}.P": s["P"]})
        return record

    def train(self, client: ClientRuntime, received: Received, state: PFLAlignClientState,
              ) -> tuple[Upload, PFLAlignClientState]:
        start = received.model
        model = self._model(client, start, state)
        named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
        optimizer = self._begin(
            named, self._offset(received, state), client.training,
            client.generator(received.server_round, STREAM_OPTIMIZER, STREAM_TRAIN),
            client.data.num_train, state, client.device)
        stats = client.local_train(model, received.server_round, optimizer=optimizer)
        new, metrics = self._end(named, optimizer, start, state, client.device,
                                 model.state_dict(), stats)
        if received.config.get(EVALUATE_AFTER_FIT):
            result = client.test(model)
            new.fit_correct, new.fit_count = result.correct, result.count
            new.fit_loss_sum = result.loss_sum
        return Upload(model.state_dict(), metrics), new

    def train_cohort(self, cohort: Cohort, received: Sequence[Received],
                     states: Sequence[PFLAlignClientState],
                     ) -> list[tuple[Upload, PFLAlignClientState]]:
        server_round = received[0].server_round
        params = cohort.stack([r.model for r in received])
        named = [list(zip(cohort.names, cohort.views(params, i), strict=True))
                 for i in range(len(cohort))]
        optimizers = [self._begin(
            named[i], self._offset(r, state), cohort.training,
            cohort.generator(i, server_round, STREAM_OPTIMIZER, STREAM_TRAIN),
            cohort.num_train(i), state, cohort.device)
            for i, (r, state) in enumerate(zip(received, states, strict=True))]
        stats = cohort.local_train(params, server_round, optimizers)
        out = []
        for i, (r, state) in enumerate(zip(received, states, strict=True)):
            model_state = cohort.state_dict(params, i, r.model)
            new, metrics = self._end(named[i], optimizers[i], r.model, state, cohort.device,
                                     model_state, stats[i])
            if r.config.get(EVALUATE_AFTER_FIT):
                result = cohort.test(cohort.model(model_state), i)
                new.fit_correct, new.fit_count = result.correct, result.count
                new.fit_loss_sum = result.loss_sum
            out.append((Upload(model_state, metrics), new))
        return out

    def _next_model(self, client: ClientRuntime, received: Received,
                    state: PFLAlignClientState) -> nn.Module | None:
        """theta_g + Delta_i, or None when it is the global model itself."""
        if self.server_mode:
            personal = received.arrays.get(PERSONAL)
            return None if personal is None else self._model(client, personal, state)
        offset = self._offset(received, state)
        if not offset and not (self.params.bn == "local" and state.buffers):
            return None
        model = self._model(client, received.model, state)
        if offset:
            named = [(n, q) for n, q in model.named_parameters() if n in offset]
            with torch.no_grad():
                torch._foreach_add_([q for _, q in named],
                                    [offset[n].to(client.device) for n, _ in named])
        return model

    def evaluate(self, client: ClientRuntime, received: Received,
                 state: PFLAlignClientState) -> dict:
        global_result = client.test(client.new_model(received.model))
        next_model = self._next_model(client, received, state)
        next_result = global_result if next_model is None else client.test(next_model)
        personal = next_result if state.fit_count is None else EvalStats(
            correct=state.fit_correct, loss_sum=state.fit_loss_sum, count=state.fit_count)
        return {**client.eval_metrics(personal, global_result), NEXT_CORRECT: next_result.correct}

    def _next_state(self, received: Received, state: PFLAlignClientState,
                    ) -> TorchState | None:
        """:meth:`_next_model`'s weights: theta_g + Delta_i, or None for the global model."""
        buffers = state.buffers if self.params.bn == "local" and state.buffers else {}
        if self.server_mode:
            personal = received.arrays.get(PERSONAL)
            return None if personal is None else {**personal, **buffers}
        offset = self._offset(received, state)
        if not offset and not buffers:
            return None
        weights = {**received.model, **buffers}
        for n, delta in (offset or {}).items():
            weights[n] = weights[n] + delta.to(weights[n].device)
        return weights

    def evaluate_cohort(self, cohort: Cohort, received: Sequence[Received],
                        states: Sequence[PFLAlignClientState]) -> list[dict]:
        out = []
        for i, (r, state) in enumerate(zip(received, states, strict=True)):
            global_result = cohort.test(cohort.model(r.model, "global"), i)
            weights = self._next_state(r, state)
            next_result = (global_result if weights is None
                           else cohort.test(cohort.model(weights, "next"), i))
            personal = next_result if state.fit_count is None else EvalStats(
                correct=state.fit_correct, loss_sum=state.fit_loss_sum, count=state.fit_count)
            out.append({**cohort.eval_metrics(personal, global_result),
                        NEXT_CORRECT: next_result.correct})
        return out

    # --- server --------------------------------------------------------------------------------
    def train_payload(self, server: ServerRuntime, state: PFLAlignServerState, client: int,
                      server_round: int) -> Payload:
        config = {EVALUATE_AFTER_FIT: self.last_training_before_evaluation(server, client,
                                                                           server_round)}
        if not (self.server_mode and client in state.offsets):
            return Payload({MODEL: server.shared_model(state)}, config)
        offset = state.offsets[client]
        return Payload({MODEL: personalized_init(state.model, offset), OFFSET: offset}, config)

    def eval_payload(self, server: ServerRuntime, state: PFLAlignServerState, client: int,
                     server_round: int) -> Payload:
        arrays = {MODEL: server.shared_model(state)}
        if self.server_mode and client in state.offsets:
            arrays[PERSONAL] = personalized_init(state.model, state.offsets[client])
        return Payload(arrays)

    @staticmethod
    def last_training_before_evaluation(server: ServerRuntime, client: int,
                                        server_round: int) -> bool:
        """Whether ``client`` trains in no round after this one up to the next evaluation: its
        model after this training is then its personal model at that evaluation."""
        next_eval = min(math.ceil(server_round / server.eval_every) * server.eval_every,
                        server.rounds)
        return all(client not in server.sample(r) for r in range(server_round + 1, next_eval + 1))

    def aggregate(self, server: ServerRuntime, state: PFLAlignServerState, server_round: int,
                  updates: Sequence[Update]) -> tuple[PFLAlignServerState, dict[str, float]]:
        norms = []
        offsets = dict(state.offsets)
        for update in updates:
            offset = personal_offset(update.model, state.model, server.trainable)
            norms.append(l2_norm(offset))
            if self.server_mode and self.params.personalize:
                offsets[update.client] = offset
        new = server.average([u.model for u in updates], [u.num_examples for u in updates])
        return (dataclasses.replace(server.with_model(state, new), offsets=offsets),
                {"delta-norm": float(np.mean(norms))})
