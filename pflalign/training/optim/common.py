"""What the optimizer classes share: the closure and the parameters stepped."""

from __future__ import annotations

from collections.abc import Callable

import torch


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
