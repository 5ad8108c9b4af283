"""What the optimizers and update rules share: the closure, the parameters stepped, gradients."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

#: a list of tensors (a model's trained entries, their gradients), for foreach ops
Tensors = Sequence[torch.Tensor]


def closure_loss(closure: Callable[[], torch.Tensor] | None) -> torch.Tensor | None:
    """The loss of ``closure`` (re-evaluated with gradients enabled), or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def params_with_grad(group: dict, optimizer: str) -> list[torch.Tensor]:
    """The group's parameters that have a gradient this step (dense gradients only)."""
    params = [p for p in group["params"] if p.grad is not None]
    if any(p.grad.is_sparse for p in params):
        raise RuntimeError(f"{optimizer} does not support sparse gradients.")
    return params


def grads_of(params: Tensors) -> list[torch.Tensor]:
    """The ``.grad`` of each parameter (zeros where backward left none)."""
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
