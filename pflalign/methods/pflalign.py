"""pFLAlign (Kim et al., Personalized Federated Learning for Gradient Alignment, arXiv
2605.02143; docs/algorithms.md 1).

Client, one round on client i (1.7, 1.8):

1. ``theta <- theta_g + Delta_i`` (trainable parameters only; buffers come from ``theta_g``, or
   from the client's own copy with ``pflalign-bn = local``, 1.13 A6);
2. ``T`` steps of :class:`pflalign.training.optim.PFLAlign` (``m`` reset; ``v``, ``P`` persistent;
   :class:`~pflalign.methods.pflalign.PFLAlignRule`);
3. ``Delta_i <- theta_end - theta_g`` against the global model received this round.

Where ``Delta_i`` lives is ``pflalign-state``: ``client`` keeps it in the client's state;
``server`` keeps it in the server state, sends ``theta_g + Delta_i`` as the model and ``Delta_i``
as ``offset`` in client i's own message, and computes the new offset from the upload
(``Delta_i = theta_i^end - theta_g^r``, trainable entries only, A6). Both modes compute the same
numbers in float32, so they give identical metrics; they differ in bytes and in where the offsets
are kept. ``v`` and ``P`` stay on the client in both modes: they are never sent (1.5). Clients not
sampled keep their offsets untouched; a first participation starts from ``Delta = 0``.

With ``pflalign-local-update = genie`` (the ``pflalign-genie`` variant, docs/algorithms.md 4.2) step
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
from typing import ClassVar, Self

import numpy as np
import torch

from pflalign.methods.base import Method
from pflalign.server.aggregation import l2_norm
from pflalign.server.runtime import ServerRuntime
from pflalign.settings.options import ConfigError, Value
from pflalign.settings.params import Params, Search, log_range, param, uniform_range
from pflalign.settings.schema import LocalTraining, Settings
from pflalign.training.client import ClientRuntime
from pflalign.training.corrections import Entries
from pflalign.training.loops import EvalStats, num_local_steps
from pflalign.training.optim import GAMMA_MODES, pflalign_update
from pflalign.training.optimizers import (
    OptimizerRule,
    PersistentGenie,
    StackedOptimizer,
    put_rows,
    rows_of,
)
from pflalign.training.runs import LocalRun, Rule
from pflalign.wire.messages import Payload, Received, Update, Upload
from pflalign.wire.protocol import (
    COUNT,
    LOCAL_STEPS,
    MODEL,
    NEXT_CORRECT,
    SAVE_SCORED,
    TRAIN,
    TRAIN_LOSS,
    Metric,
)
from pflalign.wire.state import ArrayState, ServerState, State, TorchState, state_key

OFFSET, PERSONAL = "offset", "personal"
#: the per-client config flag: score the model right after training (personal-acc)
EVALUATE_AFTER_FIT = "evaluate-after-fit"


# --- the server's offsets (docs/algorithms.md 1.7) ------------------------------------------------
def personal_offset(end_state: Mapping[str, np.ndarray], global_state: Mapping[str, np.ndarray],
                    keys: Sequence[str]) -> State:
    """pFLAlign's ``Delta_i = theta_i^end - theta_g`` over the trainable entries ``keys``
    (docs/algorithms.md 1.7; buffers carry no offset, 1.13 A6)."""
    return {k: np.asarray(end_state[k]) - np.asarray(global_state[k]) for k in keys}


def personalized_init(global_state: Mapping[str, np.ndarray],
                      offset: Mapping[str, np.ndarray]) -> State:
    """pFLAlign's personalized initialization ``theta_g + Delta_i`` (entries without an offset,
    such as batch-norm buffers, are the global model's)."""
    return {k: (v + offset[k] if k in offset else v) for k, v in global_state.items()}



# --- the client's local update (docs/algorithms.md 1.4, 1.8) --------------------------------------
@dataclass(frozen=True)
class PFLAlignRule(OptimizerRule):
    """pFLAlign's PersonalizedLocalUpdate for one client's round (:class:`~pflalign.training.optim.
    PFLAlign`, docs/algorithms.md 1.4 and 1.8): ``v`` and ``P`` from ``saved`` (``<entry>.v``,
    ``<entry>.P``; zeros when None), the offset ``offsets`` (None: no correction) and the round's
    ``num_steps``. Its outcome is the new ``v`` and ``P`` and the round's mean P and gamma."""

    stackable: ClassVar[bool] = True

    lr: float
    beta: float
    eps: float
    precondition: bool
    gamma: str
    num_steps: int
    saved: Entries | None = None
    offsets: Entries | None = None

    def cohort_key(self) -> object:
        return (type(self), self.lr, self.beta, self.eps, self.precondition, self.gamma,
                self.offsets is None)

    @classmethod
    def stacked(cls, rules: Sequence[Self], params: list[torch.Tensor], names: Sequence[str],
                generators: Sequence[torch.Generator]) -> StackedOptimizer:
        return StackedPFLAlign(rules, params, names)


@dataclass
class PFLAlignOutcome:
    """What a pFLAlign run reports: ``v`` and ``P`` by ``<entry>.v``/``<entry>.P``, and the
    round's mean preconditioner and mean gamma."""

    state: dict[str, torch.Tensor]
    mean_p: float
    mean_gamma: float


class StackedPFLAlign(StackedOptimizer):
    """pFLAlign for a cohort: :func:`~pflalign.training.optim.pflalign_update` on stacked ``m``,
    ``v``,
    ``P`` and offsets, with each client's own T; a finished client's rows are left out of the
    later steps. Its outcomes are :class:`PFLAlignOutcome` per client; the gamma sums accumulate
    per client in the dtype the core returns them in (float32), as the class's do, so that a
    cohort of one reports the class's mean gamma bit for bit. This is also how a single client's
    run steps it (:class:`~pflalign.training.optimizers.CohortOfOne`)."""

    def __init__(self, rules: Sequence[PFLAlignRule], params: list[torch.Tensor],
                 names: Sequence[str]):
        rule = rules[0]
        self.options = dict(lr=rule.lr, beta=rule.beta, eps=rule.eps,
                            precondition=rule.precondition, gamma=rule.gamma)
        self.names = list(names)

        def stacked(field: str, key: str = "") -> list[torch.Tensor]:
            """Each entry's tensors from every rule's ``field`` (zeros where a rule has none),
            stacked."""
            return [torch.stack([getattr(r, field)[state_key(n, key) if key else n].to(p)
                                 if getattr(r, field) else torch.zeros_like(p[0])
                                 for r in rules])
                    for n, p in zip(self.names, params, strict=True)]

        self.m = [torch.zeros_like(p) for p in params]
        self.v, self.P = stacked("saved", "v"), stacked("saved", "P")
        self.deltas = stacked("offsets") if rule.offsets else None
        self.signs = [torch.sign(d) for d in self.deltas] if self.deltas else None
        steps = [r.num_steps for r in rules]
        self.num_steps = steps[0] if len(set(steps)) == 1 else torch.tensor(
            steps, dtype=torch.float64, device=params[0].device)
        self.gamma_sum: torch.Tensor | None = None  # per client, in the core's sum's dtype
        self.gamma_count = 0
        self.counted = torch.zeros(len(rules), dtype=torch.float64, device=params[0].device)

    @torch.no_grad()
    def step(self, params: list[torch.Tensor], grads: list[torch.Tensor],
             active: torch.Tensor | None) -> None:
        state = [rows_of(x, active) for x in (params, self.m, self.v, self.P)]
        deltas = rows_of(self.deltas, active) if self.deltas else [None] * len(params)
        signs = rows_of(self.signs, active) if self.signs else [None] * len(params)
        steps = self.num_steps
        if isinstance(steps, torch.Tensor) and active is not None:
            steps = steps.index_select(0, active)
        gamma_sum, self.gamma_count = pflalign_update(
            *state[:1], list(grads), *state[1:], deltas, signs, **self.options,
            num_steps=steps, stacked=True)
        for target, value in zip((params, self.m, self.v, self.P), state, strict=True):
            put_rows(target, value, active)
        rows = slice(None) if active is None else active
        if self.gamma_sum is None:  # a float32 tensor of sums, or a Python float (no offsets)
            self.gamma_sum = torch.zeros(
                len(self.counted), device=self.counted.device,
                dtype=gamma_sum.dtype if isinstance(gamma_sum, torch.Tensor) else torch.float64)
        self.gamma_sum[rows] += gamma_sum
        self.counted[rows] += 1

    def outcomes(self, params: list[torch.Tensor]) -> list[object]:
        out = []
        for i in range(params[0].shape[0]):
            state = {}
            for name, v, p in zip(self.names, self.v, self.P, strict=True):
                state.update({state_key(name, "v"): v[i].clone(),
                              state_key(name, "P"): p[i].clone()})
            total = sum(p[i].numel() for p in self.P)
            mean_p = float(sum(float(p[i].sum()) for p in self.P) / total)
            count = float(self.counted[i]) * self.gamma_count
            mean_gamma = float(self.gamma_sum[i]) / count if count else float("nan")
            out.append(PFLAlignOutcome(state, mean_p, mean_gamma))
        return out


@dataclass(frozen=True)
class PFLAlignParams(Params):
    prefix = "pflalign"

    # the range stops at 6: 10 of the tuned suite's 11 failed pFLAlign trials (diverged) lay at
    # pflalign-lr >= 6.75 of [1, 10] (docs/experiments/suite.md)
    lr: float = param(3.0, "Local learning rate. The preconditioner P is far below 1 (it starts "
                      "at (1-beta)^2 = 0.01), so this is of order 1, not an SGD rate.",
                      minimum=0.0, exclusive_minimum=True, search=log_range(1.0, 6.0))
    beta: float = param(0.9, "EMA decay of m, v and P.", minimum=0.0, maximum=1.0,
                        exclusive_maximum=True, search=uniform_range(0.8, 0.95))
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
                              "P and gamma correction, docs/algorithms.md 1.4) or genie (GENIE's "
                              "rule with per-client persistent state and no offset correction, "
                              "4.2).",
                              choices=("pflalign", "genie"))
    bn: str = param("global", "Batch-norm buffers come from the global model (global, "
                    "docs/algorithms.md 1.13 A6) or stay on each client (local, FedBN-style).",
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
    #: theta_end itself, kept with its score under save-models (an evaluation scores the client
    #: by it until the client trains again, and the run's final one saves it): one model more
    #: per client that trained
    fit_model: TorchState | None = None
    #: ... and its scores beyond accuracy (eval-metrics), each a 0-d float64 tensor
    fit_scores: TorchState | None = None


@dataclass
class PFLAlignServerState(ServerState):
    #: Delta_i per client (server-held state only)
    offsets: dict[int, State] = field(default_factory=dict)


class PFLAlignMethod(Method):
    asynchronous = True  # its server update is a sample-weighted average of uploads
    private = True  # it uploads its global model, which the server only averages
    name = "pflalign"
    summary = ("pFLAlign: clients start from global + their offset Delta and train with a "
               "persistent multiplicative preconditioner P and a gamma-weighted removal of "
               "Delta; the server averages (docs/algorithms.md 1).")
    paper = ("Kim et al., Personalized Federated Learning for Gradient Alignment (pFLAlign), "
             "arXiv 2605.02143")
    Params = PFLAlignParams
    tuned_training = ()  # its step size is pflalign-lr (lr only without the preconditioner)

    @classmethod
    def search_space(cls, fixed: Mapping[str, Value]) -> dict[str, Search]:
        space = super().search_space(fixed)
        if fixed.get("pflalign-precondition") is False:  # steps with the SGD rate 'lr'
            space = {"lr": LocalTraining.search_space()["lr"],
                     **{k: v for k, v in space.items() if k != "pflalign-lr"}}
        return space
    ClientState = PFLAlignClientState
    ServerState = PFLAlignServerState
    local_optimizer = False
    #: the mean preconditioner P (>= 0; an honest P is about [0, 1]: docs/algorithms.md 1) and the
    #: mean alignment probability gamma (in [0, 1]); GENIE's local update reports neither
    train_metrics = {"mean-P": Metric(diagnostic=True), "mean-gamma": Metric(0, 1, diagnostic=True)}
    #: the accuracy of the next round's starting point theta_g + Delta_i
    eval_metrics = {NEXT_CORRECT: COUNT}

    @classmethod
    def check(cls, settings: Settings) -> None:
        super().check(settings)
        if (settings.run.dp in ("central", "distributed")
                and cls.Params.from_settings(settings).state == "server"):
            raise ConfigError(f"pflalign-state = 'server' cannot run under dp = "
                              f"{settings.run.dp!r}: the server would keep each client's "
                              "offset, computed from its unclipped upload, and send it back in "
                              "messages outside the private release; use pflalign-state = "
                              "'client', where the offset never leaves the client.")

    def reply_metrics(self, action: str) -> dict[str, Metric]:
        metrics = super().reply_metrics(action)
        if action == TRAIN and self.genie:
            return {k: m for k, m in metrics.items() if k not in self.train_metrics}
        return metrics

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

    def _rule(self, client: ClientRuntime, offset: TorchState | None,
              state: PFLAlignClientState) -> OptimizerRule:
        """The round's local update with this client's persisted state: PFLAlign (docs/algorithms.md
        1.4, 1.8) with the offset ``offset`` and the round's step count, or GENIE (4.2)."""
        p, t = self.params, client.training
        if self.genie:
            return PersistentGenie(t, state.optimizer)
        return PFLAlignRule(lr=p.lr if p.precondition else t.lr, beta=p.beta, eps=p.eps,
                            precondition=p.precondition, gamma=p.gamma,
                            num_steps=num_local_steps(client.data.num_train, t.batch_size,
                                                      t.local_epochs, t.local_steps),
                            saved=state.optimizer, offsets=offset or None)

    def train(self, client: ClientRuntime, received: Received, state: PFLAlignClientState,
              ) -> Rule:
        names = client.template.trainable
        offset = self._offset(received, state)
        start = dict(received.model)
        if self.params.bn == "local" and state.buffers:
            start.update(state.buffers)
        if offset and not self.server_mode:  # server mode receives theta_g + Delta already
            start.update({n: start[n] + offset[n].to(start[n].device) for n in names})
        result = yield LocalRun(start, optimizer=self._rule(client, offset, state))
        outcome = result.optimizer
        new = dataclasses.replace(state, optimizer=outcome if self.genie else outcome.state)
        if self.params.personalize and not self.server_mode:
            new.offset = dict(zip(names, torch._foreach_sub(
                [result.model[n] for n in names],
                [received.model[n].to(client.device) for n in names]), strict=True))
        if self.params.bn == "local":
            new.buffers = {k: v for k, v in result.model.items() if k not in set(names)}
        metrics = {TRAIN_LOSS: result.stats.loss, LOCAL_STEPS: result.stats.steps}
        if not self.genie:
            metrics.update({"mean-P": outcome.mean_p, "mean-gamma": outcome.mean_gamma})
        if received.config.get(EVALUATE_AFTER_FIT):
            fit = client.test(result.model)
            new.fit_correct, new.fit_count, new.fit_loss_sum = fit.correct, fit.count, \
                fit.loss_sum
            new.fit_model = dict(result.model) if received.config.get(SAVE_SCORED) else None
            new.fit_scores = {k: torch.tensor(v, dtype=torch.float64)
                              for k, v in fit.scores.items()} or None
        return Upload(result.model, metrics), new

    def _next_state(self, received: Received, state: PFLAlignClientState,
                    ) -> TorchState | None:
        """theta_g + Delta_i (with the client's own buffers in local-BN mode), or None when it
        is the global model itself."""
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

    def evaluate(self, client: ClientRuntime, received: Received,
                 state: PFLAlignClientState) -> dict:
        global_result = client.test(received.model)
        weights = self._next_state(received, state)
        next_result = global_result if weights is None else client.test(weights)
        personal = next_result if state.fit_count is None else EvalStats(
            correct=state.fit_correct, loss_sum=state.fit_loss_sum, count=state.fit_count,
            scored=state.fit_model,
            scores={k: float(v) for k, v in (state.fit_scores or {}).items()})
        return {**client.eval_metrics(personal, global_result), NEXT_CORRECT: next_result.correct}

    # --- server --------------------------------------------------------------------------------
    def train_payload(self, server: ServerRuntime, state: PFLAlignServerState, client: int,
                      server_round: int) -> Payload:
        fit = self.last_training_before_evaluation(server, client, server_round)
        config = {EVALUATE_AFTER_FIT: fit}
        if fit and server.settings.run.save_models != "none":
            config[SAVE_SCORED] = True  # keep theta_end: a later evaluation scores (saves) it
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
        model after this training is then its personal model at that evaluation. Always under
        ``mode = async``, whose dispatches cannot be foreseen (the last training's score then
        stands)."""
        if server.settings.run.mode == "async":
            return True
        next_eval = min(math.ceil(server_round / server.eval_every) * server.eval_every,
                        server.rounds)
        return all(client not in server.sample(r) for r in range(server_round + 1, next_eval + 1))

    def aggregate(self, server: ServerRuntime, state: PFLAlignServerState, server_round: int,
                  updates: Sequence[Update]) -> tuple[PFLAlignServerState, dict[str, float]]:
        norms = []
        offsets = dict(state.offsets)
        for update in updates:
            # an asynchronous update's offset is against the model it trained from (1.7: "the
            # global model received this round"), neither rebased nor staleness-weighted, as the
            # client computes it itself with state = client (docs/pflalign.md)
            offset = (personal_offset(update.stale.upload, update.stale.base, server.trainable)
                      if update.stale is not None
                      else personal_offset(update.model, state.model, server.trainable))
            norms.append(l2_norm(offset))
            if self.server_mode and self.params.personalize:
                offsets[update.client] = offset
        new = server.average([u.model for u in updates], [u.num_examples for u in updates])
        return (dataclasses.replace(server.with_model(state, new), offsets=offsets),
                {"delta-norm": float(np.mean(norms))})
