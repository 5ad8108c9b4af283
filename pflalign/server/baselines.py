"""The defining rules of the pFL baselines, on tensors (no Flower, no data).

Each function is one update rule from a method's paper, written over lists of tensors with torch's
foreach ops (one kernel launch per list, not a Python loop over parameters). The method files in
``pflalign/methods/`` compose them into their rules; the tests check each against hand-computed
values.
ALGORITHMS.md does not specify these methods; the papers cited with each function do.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pflalign.server.aggregation import weighted_average

Tensors = Sequence[torch.Tensor]


def grads_of(params: Tensors) -> list[torch.Tensor]:
    """The ``.grad`` of each parameter (zeros where backward left none)."""
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]


@torch.no_grad()
def scaffold_client_control(client_control: Tensors, server_control: Tensors, start: Tensors,
                            end: Tensors, steps: int, lr: float) -> list[torch.Tensor]:
    """SCAFFOLD option II (Alg. 1 line 12): ``c_i+ = c_i - c + (x - y_i) / (K lr)`` where ``x`` is
    the model the client started from and ``y_i`` the model after ``K`` local SGD steps."""
    if steps < 1 or lr <= 0:
        raise ValueError(f"scaffold_client_control needs steps >= 1 and lr > 0, got {steps}, {lr}.")
    new = torch._foreach_sub(list(client_control), list(server_control))
    torch._foreach_add_(new, torch._foreach_sub(list(start), list(end)), alpha=1.0 / (steps * lr))
    return new


def scaffold_server_update(model: np.ndarray, control: np.ndarray,
                           model_deltas: Sequence[np.ndarray], control_deltas: Sequence[np.ndarray],
                           weights: Sequence[float], num_clients: int, server_lr: float,
                           ) -> tuple[np.ndarray, np.ndarray]:
    """SCAFFOLD's server step (Alg. 1 lines 16-17) on flat vectors:
    ``x <- x + eta_g sum_i p_i dy_i`` and ``c <- c + (1/N) sum_i dc_i``.

    ``p_i`` are the clients' sample weights normalised to sum to 1 (the paper's 1/|S| when clients
    hold equal data; sample weighting makes ``eta_g = 1`` with zero control variates exactly
    FedAvg). ``N`` is the number of training clients, sampled or not.
    """
    step = weighted_average(model_deltas, weights)
    new_control = control.astype(np.float64) + np.sum(control_deltas, axis=0,
                                                      dtype=np.float64) / num_clients
    return model + server_lr * step, new_control


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


@torch.no_grad()
def pfedme_inner_step_(theta: Tensors, anchor: Tensors, lam: float, lr: float) -> None:
    """One gradient step on pFedMe's inner problem ``f(theta) + lambda/2 ||theta - w||^2``
    (T Dinh et al., NeurIPS 2020, eq. 7): ``theta -= lr (grad f(theta) + lambda (theta - w))``,
    with ``grad f`` in ``theta[k].grad``."""
    grads = grads_of(theta)
    torch._foreach_add_(grads, torch._foreach_sub(list(theta), list(anchor)), alpha=lam)
    torch._foreach_add_(list(theta), grads, alpha=-lr)


@torch.no_grad()
def pfedme_outer_step_(local: Tensors, theta: Tensors, lam: float, lr: float) -> None:
    """pFedMe's local-model step (Algorithm 1 line 8): ``w <- w - lr lambda (w - theta)``."""
    torch._foreach_add_(list(local), torch._foreach_sub(list(local), list(theta)),
                        alpha=-lr * lam)


def pfedme_server_update(global_: np.ndarray, average: np.ndarray, beta: float) -> np.ndarray:
    """pFedMe's server step (Algorithm 1 line 12): ``w <- (1 - beta) w + beta avg_i w_i``."""
    return (1.0 - beta) * global_ + beta * average


@torch.no_grad()
def ala_merge(local: Tensors, global_: Tensors, weights: Tensors) -> list[torch.Tensor]:
    """FedALA's adaptive local aggregation (Zhang et al., AAAI 2023, eq. 4) for the higher
    layers: ``theta_hat = theta_i + (Theta - theta_i) * W``, element-wise."""
    diff = torch._foreach_sub(list(global_), list(local))
    return torch._foreach_add(list(local), torch._foreach_mul(diff, list(weights)))


@torch.no_grad()
def ala_weight_step_(weights: Tensors, grads: Tensors, local: Tensors, global_: Tensors,
                     eta: float) -> None:
    """FedALA's weight update (eq. 5): ``W <- clip(W - eta grad_theta_hat * (Theta - theta_i),
    0, 1)``; by the chain rule ``grad_theta_hat * (Theta - theta_i)`` is ``dL/dW``."""
    diff = torch._foreach_sub(list(global_), list(local))
    torch._foreach_add_(list(weights), torch._foreach_mul(list(grads), diff), alpha=-eta)
    torch._foreach_clamp_min_(list(weights), 0.0)
    torch._foreach_clamp_max_(list(weights), 1.0)


def ala_converged(losses: Sequence[float], window: int, threshold: float) -> bool:
    """FedALA's stopping rule for the first adaptation: the standard deviation of the last
    ``window`` losses is below ``threshold``."""
    return len(losses) >= window and float(np.std(losses[-window:])) < threshold
