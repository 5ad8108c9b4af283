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

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pflalign.methods.base import Method
from pflalign.settings.options import ConfigError
from pflalign.settings.params import Params, param
from pflalign.settings.schema import Settings
from pflalign.training.client import ClientRuntime
from pflalign.training.optim.common import Tensors, grads_of
from pflalign.wire.messages import Received, Upload
from pflalign.wire.protocol import LOCAL_STEPS, LOSS, TRAIN_LOSS, Metric
from pflalign.wire.state import ArrayState, TorchState


@torch.no_grad()
def lerp_models(start: Tensors, end: Tensors, weight: float) -> list[torch.Tensor]:
    """``start + weight (end - start)``, element-wise over the lists: APFL's mixture
    ``alpha v + (1 - alpha) w`` is ``lerp_models(w, v, alpha)``."""
    return torch._foreach_lerp(list(start), list(end), weight)


@torch.no_grad()
def apfl_alpha_grad(personal: Tensors, global_: Tensors, mixed_grads: Tensors) -> float:
    """APFL's mixing-weight gradient (Deng et al., 2020, eq. 8 / Algorithm 1):
    ``d f(alpha v + (1 - alpha) w) / d alpha = <v - w, grad f(v_bar)>``."""
    products = torch._foreach_mul(torch._foreach_sub(list(personal), list(global_)),
                                  list(mixed_grads))
    return float(torch.stack([p.sum() for p in products]).sum())


def apfl_alpha_step(alpha: float, grad: float, lr: float) -> float:
    """One projected gradient step on APFL's alpha, kept in [0, 1]."""
    return min(1.0, max(0.0, alpha - lr * grad))


@dataclass(frozen=True)
class APFLParams(Params):
    prefix = "apfl"

    alpha: float = param(0.5, "Initial mixing weight alpha of the personal model in "
                         "alpha v + (1 - alpha) w.", minimum=0.0, maximum=1.0,
                         search=(0.25, 0.5, 0.75))
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


def _trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


class APFL(Method):
    name = "apfl"
    summary = ("Each client mixes a personal model v with the global model w as "
               "alpha v + (1 - alpha) w, learning alpha by gradient descent.")
    paper = ("Deng, Kamani, Mahdavi, Adaptive Personalized Federated Learning, "
             "arXiv 2003.13461")
    Params = APFLParams
    ClientState = APFLClientState
    local_optimizer = False
    #: the mixed model's training loss and the mixing weight alpha (kept in [0, 1])
    train_metrics = {"personal-train-loss": LOSS, "alpha": Metric(0, 1)}

    def _alpha(self, state: APFLClientState) -> float:
        return self.params.alpha if state.alpha is None else state.alpha

    @classmethod
    def check(cls, settings: Settings) -> None:
        super().check(settings)
        if settings.training.momentum:
            raise ConfigError("apfl updates its personal model by plain SGD (Algorithm 1); set "
                              "momentum = 0 for it, so that both of its models use the same "
                              "rule.")

    @staticmethod
    @torch.no_grad()
    def _mix_(w_bar: list[torch.Tensor], w: list[torch.Tensor], v: list[torch.Tensor],
              alpha: float) -> None:
        """``w_bar <- alpha v + (1 - alpha) w``: the mixture a step's mixed loss is taken at."""
        torch._foreach_copy_(w_bar, lerp_models(w, v, alpha))

    def _alpha_grad(self, v: list[torch.Tensor], w: list[torch.Tensor],
                    g_bar: list[torch.Tensor]) -> float | None:
        """alpha's gradient at ``v`` and ``w`` before the step (None without adaptation)."""
        return apfl_alpha_grad(v, w, g_bar) if self.params.adaptive else None

    def _personal_step_(self, v: list[torch.Tensor], g_bar: list[torch.Tensor], alpha: float,
                        alpha_grad: float | None, lr: float) -> float:
        """``v <- v - lr alpha grad f(v_bar)`` in place, and alpha's new value."""
        with torch.no_grad():
            torch._foreach_add_(v, g_bar, alpha=-lr * alpha)
        return alpha if alpha_grad is None else apfl_alpha_step(alpha, alpha_grad,
                                                                self.params.alpha_lr)

    @staticmethod
    def _metrics(loss_sum: float, mixed_sum: float, seen: int, steps: int, alpha: float,
                 ) -> dict:
        return {TRAIN_LOSS: loss_sum / max(seen, 1), LOCAL_STEPS: steps,
                "personal-train-loss": mixed_sum / max(seen, 1), "alpha": alpha}

    def train(self, client: ClientRuntime, received: Received, state: APFLClientState,
              ) -> tuple[Upload, APFLClientState]:
        t = client.training
        model = client.new_model(received.model)
        personal = client.new_model(state.personal or received.model)
        mixed = client.new_model(received.model)
        w, v, w_bar = _trainable(model), _trainable(personal), _trainable(mixed)
        alpha = self._alpha(state)
        optimizer = t.sgd(w)
        model.train()
        mixed.train()
        loss_sum, mixed_sum, seen, steps = 0.0, 0.0, 0, 0
        for inputs, targets in client.batches(received.server_round):
            self._mix_(w_bar, w, v, alpha)
            mixed.zero_grad(set_to_none=True)
            mixed_loss = F.cross_entropy(mixed(inputs), targets)
            mixed_loss.backward()
            g_bar = grads_of(w_bar)
            alpha_grad = self._alpha_grad(v, w, g_bar)
            loss = F.cross_entropy(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            alpha = self._personal_step_(v, g_bar, alpha, alpha_grad, t.lr)
            loss_sum += float(loss.detach()) * len(targets)
            mixed_sum += float(mixed_loss.detach()) * len(targets)
            seen += len(targets)
            steps += 1
        upload = Upload(model.state_dict(), self._metrics(loss_sum, mixed_sum, seen, steps, alpha))
        return upload, APFLClientState(personal.state_dict(), alpha)

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
