"""APFL (Deng, Kamani, Mahdavi, Adaptive Personalized Federated Learning, arXiv 2003.13461,
Algorithm 1).

The client holds a personal model ``v`` and a mixing weight ``alpha`` (state). Its personalized
model is the mixture ``v_bar = alpha v + (1 - alpha) w``. On each mini-batch, with ``w`` and ``v``
as they were before the step:

- ``w <- w - lr grad f(w)`` (the global model's local update, uploaded and averaged as FedAvg);
- ``v <- v - lr alpha grad f(v_bar)`` (the chain rule through the mixture);
- ``alpha <- clip(alpha - apfl-alpha-lr <v - w, grad f(v_bar)>, 0, 1)`` when ``apfl-adaptive``.

``personal-acc`` scores ``alpha v + (1 - alpha) w_g`` with the latest global model; a client that
has not trained (unseen ones included) has ``v = w_g``, so its mixture is the global model.
Batch-norm buffers of the mixture come from ``w``. With ``alpha = 0`` and no adaptation the
method is FedAvg exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from pflalign.methods.base import Method
from pflalign.settings.options import ConfigError
from pflalign.settings.params import Params, param, uniform_range
from pflalign.settings.schema import Settings
from pflalign.training.client import ClientRuntime
from pflalign.training.corrections import Entries
from pflalign.training.objectives import (
    ModelCall,
    Objective,
    Step,
    cross_entropy,
    prefixed,
    with_prefix,
)
from pflalign.training.optim.common import Tensors
from pflalign.training.optimizers import EntryGroup, SGDGroups
from pflalign.training.runs import LocalRun, Rule
from pflalign.wire.messages import Received, Upload
from pflalign.wire.protocol import LOCAL_STEPS, LOSS, TRAIN_LOSS, Metric
from pflalign.wire.state import ArrayState, TorchState


@torch.no_grad()
def lerp_models(start: Tensors, end: Tensors, weight: float) -> list[torch.Tensor]:
    """``start + weight (end - start)``, element-wise over the lists: APFL's mixture
    ``alpha v + (1 - alpha) w`` is ``lerp_models(w, v, alpha)``."""
    return torch._foreach_lerp(list(start), list(end), weight)


#: the run's extra tensors: the personal model v (``personal.<entry>``) and alpha
PERSONAL, ALPHA = "personal", "alpha"
MIXED_LOSS = "personal-train-loss"


@dataclass(frozen=True)
class MixtureObjective(Objective):
    """An APFL client's step (Algorithm 1) as one objective: ``f(w) + f(v_bar)`` with the
    mixture ``v_bar = alpha v + (1 - alpha) sg(w)`` (``sg``: no gradient), so that one gradient
    gives ``grad f(w)`` for ``w``, ``alpha grad f(v_bar)`` for ``v`` (the chain rule through the
    mixture) and ``<v - w, grad f(v_bar)>`` for ``alpha`` (eq. 8), all at the step's start. ``v``
    and, when it adapts, ``alpha`` are the run's extra tensors; a fixed ``alpha`` is
    ``fixed["alpha"]``; the mixture's buffers (batch-norm statistics) are its own, from
    ``buffers`` at the run's start. ``f(v_bar)`` is reported as ``personal-train-loss``."""

    fixed: Entries
    buffers: Entries

    def initial_state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.buffers.items()}

    def loss(self, model: ModelCall, params: Mapping[str, torch.Tensor], extras: Entries,
             state: Entries, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None,
             ) -> Step:
        alpha = extras[ALPHA] if ALPHA in extras else self.fixed[ALPHA]
        own = cross_entropy(model(params, x), y, mask)
        mixture = {k: torch.lerp(params[k].detach(), v, alpha)
                   for k, v in prefixed(extras, PERSONAL).items()}
        mixed = cross_entropy(model({**params, **state, **mixture}, x), y, mask)
        return Step(own + mixed, own, {MIXED_LOSS: mixed}, state)


@dataclass(frozen=True)
class APFLParams(Params):
    prefix = "apfl"

    alpha: float = param(0.5, "Initial mixing weight alpha of the personal model in "
                         "alpha v + (1 - alpha) w.", minimum=0.0, maximum=1.0,
                         search=uniform_range(0.25, 0.75))
    adaptive: bool = param(True, "Learn alpha per client by gradient descent (false keeps it "
                           "fixed).")
    alpha_lr: float = param(0.05, "Step size of alpha's gradient step.", minimum=0.0,
                            exclusive_minimum=True)


@dataclass
class APFLClientState(ArrayState):
    #: the personal model v
    personal: TorchState | None = None
    #: the client's mixing weight (the initial apfl-alpha until it trains)
    alpha: float | None = None


class APFL(Method):
    asynchronous = True  # its server update is a sample-weighted average of uploads
    private = True  # it uploads its global model, which the server only averages
    name = "apfl"
    summary = ("Each client mixes a personal model v with the global model w as "
               "alpha v + (1 - alpha) w, learning alpha by gradient descent.")
    paper = ("Deng, Kamani, Mahdavi, Adaptive Personalized Federated Learning, "
             "arXiv 2003.13461")
    Params = APFLParams
    ClientState = APFLClientState
    local_optimizer = False
    #: the mixed model's training loss and the mixing weight alpha (kept in [0, 1])
    train_metrics = {MIXED_LOSS: LOSS, "alpha": Metric(0, 1)}

    def _alpha(self, state: APFLClientState) -> float:
        return self.params.alpha if state.alpha is None else state.alpha

    @classmethod
    def check(cls, settings: Settings) -> None:
        super().check(settings)
        if settings.training.momentum:
            raise ConfigError("apfl updates its personal model by plain SGD (Algorithm 1); set "
                              "momentum = 0 for it, so that both of its models use the same "
                              "rule.")

    def train(self, client: ClientRuntime, received: Received, state: APFLClientState,
              ) -> Rule:
        t, p = client.training, self.params
        keys = client.template.trainable
        personal = state.personal or received.model
        alpha = torch.tensor(self._alpha(state))
        extras = with_prefix({k: personal[k] for k in keys}, PERSONAL)
        if p.adaptive:
            extras[ALPHA] = alpha
        result = yield LocalRun(
            received.model, objective=MixtureObjective(
                {} if p.adaptive else {ALPHA: alpha},
                {k: received.model[k] for k, _ in client.layout.named_buffers()
                 if k in received.model}),
            extras=extras, optimizer=SGDGroups(t.lr, t.momentum, t.weight_decay, (
                EntryGroup(f"{PERSONAL}.", weight_decay=0.0),
                EntryGroup(ALPHA, lr=p.alpha_lr, weight_decay=0.0, bounds=(0.0, 1.0)))))
        stats = result.stats
        alpha_after = float(result.extras[ALPHA]) if p.adaptive else float(alpha)
        upload = Upload(result.model, {
            TRAIN_LOSS: stats.loss, LOCAL_STEPS: stats.steps,
            "personal-train-loss": stats.metrics[MIXED_LOSS], "alpha": alpha_after})
        return upload, APFLClientState({**personal, **prefixed(result.extras, PERSONAL)},
                                       alpha_after)

    def _mixture(self, global_: TorchState, state: APFLClientState, names: Sequence[str],
                 device: torch.device) -> list[torch.Tensor]:
        """The evaluated mixture's trainable entries ``names``: ``alpha v + (1 - alpha) w_g``."""
        with torch.no_grad():
            return lerp_models([global_[k].to(device) for k in names],
                               [state.personal[k].to(device) for k in names], self._alpha(state))

    def evaluate(self, client: ClientRuntime, received: Received,
                 state: APFLClientState) -> dict:
        global_model = client.new_model(received.model)
        global_result = client.test(global_model)
        if state.personal is None:
            return client.eval_metrics(global_result, global_result)
        mixed = client.new_model(global_model.state_dict())
        named = [(k, q) for k, q in mixed.named_parameters() if q.requires_grad]
        with torch.no_grad():
            torch._foreach_copy_([q for _, q in named], self._mixture(
                global_model.state_dict(), state, [k for k, _ in named], client.device))
        return client.eval_metrics(client.test(mixed), global_result)
