"""APFL client half (Deng, Kamani, Mahdavi, Adaptive Personalized Federated Learning, 2020,
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

import torch
import torch.nn.functional as F
from torch import nn

from clients.base import ClientMethod, FitResult, RoundInput
from pflalign.baselines import apfl_alpha_grad, apfl_alpha_step, grads_of, lerp_models
from pflalign.train import make_sgd

PERSONAL, ALPHA = "personal", "alpha"


def _trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


class APFLClient(ClientMethod):
    def _alpha(self) -> float:
        stored = self.state.get_metrics(ALPHA)
        return float(stored["alpha"]) if stored else float(self.settings["apfl-alpha"])

    def _mixture(self, personal: nn.Module, global_model: nn.Module, alpha: float) -> nn.Module:
        mixed = self.new_model(global_model.state_dict())
        with torch.no_grad():
            torch._foreach_copy_(_trainable(mixed), lerp_models(_trainable(global_model),
                                                                _trainable(personal), alpha))
        return mixed

    def fit(self, inputs: RoundInput) -> FitResult:
        s = self.settings
        if float(s["momentum"]):
            raise ValueError("apfl updates its personal model by plain SGD (Algorithm 1); set "
                             "momentum = 0 for it, so that both of its models use the same rule.")
        lr, alpha_lr = float(s["lr"]), float(s["apfl-alpha-lr"])
        adaptive = bool(s["apfl-adaptive"])
        model = self.new_model(inputs.global_state)
        personal = self.new_model(self.state.get_arrays(PERSONAL) or inputs.global_state)
        mixed = self.new_model(inputs.global_state)
        w, v, w_bar = _trainable(model), _trainable(personal), _trainable(mixed)
        alpha = self._alpha()
        optimizer = make_sgd(w, s)
        model.train()
        mixed.train()
        loss_sum, mixed_sum, seen, steps = 0.0, 0.0, 0, 0
        for inputs_, targets in self.batches(inputs.server_round):
            with torch.no_grad():
                torch._foreach_copy_(w_bar, lerp_models(w, v, alpha))
            mixed.zero_grad(set_to_none=True)
            mixed_loss = F.cross_entropy(mixed(inputs_), targets)
            mixed_loss.backward()
            g_bar = grads_of(w_bar)
            if adaptive:
                alpha_grad = apfl_alpha_grad(v, w, g_bar)
            loss = F.cross_entropy(model(inputs_), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                torch._foreach_add_(v, g_bar, alpha=-lr * alpha)
            if adaptive:
                alpha = apfl_alpha_step(alpha, alpha_grad, alpha_lr)
            loss_sum += float(loss.detach()) * len(targets)
            mixed_sum += float(mixed_loss.detach()) * len(targets)
            seen += len(targets)
            steps += 1
        self.state.set_arrays(PERSONAL, personal.state_dict())
        self.state.set_metrics(ALPHA, {"alpha": alpha})
        return FitResult(model.state_dict(), {
            "train-loss": loss_sum / max(seen, 1), "local-steps": steps,
            "personal-train-loss": mixed_sum / max(seen, 1), "alpha": alpha})

    def evaluate(self, inputs: RoundInput) -> dict:
        global_model = self.new_model(inputs.global_state)
        global_result = self.test(global_model)
        stored = self.state.get_arrays(PERSONAL)
        if stored is None:
            return self.eval_metrics(global_result, global_result)
        mixed = self._mixture(self.new_model(stored), global_model, self._alpha())
        return self.eval_metrics(self.test(mixed), global_result)
