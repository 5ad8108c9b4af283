"""Optimizers as ``torch.optim.Optimizer`` subclasses, usable in any PyTorch loop.

:class:`PFLAlign` is pFLAlign's PersonalizedLocalUpdate (ALGORITHMS.md 1.4, 1.8, 1.11).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch.optim import Optimizer

GAMMA_MODES = ("adaptive", "zero", "half", "one", "hard")


class PFLAlign(Optimizer):
    """pFLAlign's variance-reduced, gradient-aligned local update (ALGORITHMS.md 1.4 and 1.8).

    For a stochastic gradient ``g`` of each parameter, element-wise:

    1. ``m <- beta m + (1 - beta) g``                        (EMA of g; reset every round)
    2. ``v <- beta v + (1 - beta) g^2``                      (EMA of g^2; persistent)
    3. ``alpha <- 1 - (1 - beta) g^2 / (v + eps)``
    4. ``P <- alpha P + (1 - beta) m^2 / (v + eps)``         (preconditioner; persistent)
    5. ``sigma^2 <- max(v - m^2, 0)``
    6. ``z <- |m| / sqrt(2 sigma^2 + eps)``
    7. ``gamma <- 1/2 + 1/2 erf(z) sign(m * Delta)``
    8. ``theta <- theta - lr P g - gamma Delta / T``

    ``Delta`` is the client's personal offset and ``T`` the round's number of steps, both given by
    :meth:`begin_round`, which also resets ``m``. Closed forms (1.4): ``P = EMA(m^2) / EMA(g^2)``
    (a signal fraction, about GSNR / (1 + GSNR), so far below 1 -- hence learning rates of order
    1), and ``gamma = Pr[sign G = sign Delta]`` for ``G ~ N(m, sigma^2)``: the offset is removed
    where the local gradient pushes against it and kept where it agrees. With ``gamma = 1`` for
    all T steps the correction removes exactly ``Delta``.

    Ablation switches (1.11): ``precondition=False`` steps on ``g`` instead of ``P g``;
    ``gamma`` is ``"adaptive"`` (step 7), ``"zero"`` (keep the offset), ``"half"``, ``"one"``
    (remove exactly Delta) or ``"hard"`` (``1/2 + 1/2 sign(m Delta)``). Without an offset
    (``begin_round(None, T)``) step 8's correction vanishes; with ``precondition=False`` as well
    the update is exactly SGD without momentum.

    ``state_dict()``/``load_state_dict()`` carry ``v`` and ``P`` (and the round's ``m`` and
    offset). There is no bias correction, clipping, weight decay or momentum in the step (A2, A3).
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict], lr: float,
                 beta: float = 0.9, eps: float = 1e-12, precondition: bool = True,
                 gamma: str = "adaptive", foreach: bool | None = None):
        if not lr > 0:
            raise ValueError(f"PFLAlign: invalid learning rate {lr}; it must be > 0.")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"PFLAlign: invalid beta {beta}; it must be in [0, 1).")
        if not eps > 0:
            raise ValueError(f"PFLAlign: invalid eps {eps}; it must be > 0.")
        if gamma not in GAMMA_MODES:
            raise ValueError(f"PFLAlign: invalid gamma {gamma!r}; choose one of "
                             f"{', '.join(GAMMA_MODES)}.")
        defaults = dict(lr=lr, beta=beta, eps=eps, precondition=precondition, gamma=gamma,
                        foreach=foreach, num_steps=1)
        super().__init__(params, defaults)
        self._gamma_sum: float | torch.Tensor = 0.0
        self._gamma_count = 0

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if "v" not in state:
            state["v"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["P"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if "m" not in state:
            state["m"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def begin_round(self, offsets: Sequence[torch.Tensor | None] | None, num_steps: int) -> None:
        """Start a round: set the personal offset Delta (one tensor per parameter, in parameter
        order; ``None`` for none) and the round's step count T; reset ``m`` to zero."""
        if num_steps < 1:
            raise ValueError(f"PFLAlign.begin_round: num_steps must be >= 1, got {num_steps}.")
        params = self._params()
        if offsets is not None and len(offsets) != len(params):
            raise ValueError(f"PFLAlign.begin_round: {len(offsets)} offsets for {len(params)} "
                             "parameters; give one tensor (or None) per parameter.")
        for i, p in enumerate(params):
            state = self._init_state(p)
            state["m"].zero_()
            offset = None if offsets is None else offsets[i]
            if offset is None:
                state.pop("delta", None)
                state.pop("delta_sign", None)
            else:
                if offset.shape != p.shape:
                    raise ValueError(f"PFLAlign.begin_round: offset {i} has shape "
                                     f"{tuple(offset.shape)}, parameter has {tuple(p.shape)}.")
                state["delta"] = offset.detach().to(device=p.device, dtype=p.dtype).clone()
                state["delta_sign"] = torch.sign(state["delta"])
        for group in self.param_groups:
            group["num_steps"] = int(num_steps)
        self._gamma_sum = 0.0
        self._gamma_count = 0

    def mean_gamma(self) -> float:
        """Mean of gamma over the coordinates and steps of this round (0.5 without an offset)."""
        return float(self._gamma_sum) / self._gamma_count if self._gamma_count else float("nan")

    def mean_preconditioner(self) -> float:
        """Mean of P over all coordinates (``nan`` before the first step)."""
        values = [self.state[p]["P"] for p in self._params() if "P" in self.state[p]]
        if not values:
            return float("nan")
        return float(sum(float(v.sum()) for v in values) / sum(v.numel() for v in values))

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("PFLAlign does not support sparse gradients.")
            states = [self._init_state(p) for p in params]
            use_foreach = group["foreach"]
            if use_foreach is None:
                use_foreach = all(p.device.type != "cpu" for p in params) or len(params) > 1
            impl = _step_foreach if use_foreach else _step_single
            gamma_sum, gamma_count = impl(params, states, group)
            self._gamma_sum += gamma_sum
            self._gamma_count += gamma_count
        return loss


def _gamma_single(m: torch.Tensor, v: torch.Tensor, delta: torch.Tensor, mode: str,
                  eps: float) -> torch.Tensor:
    if mode == "zero":
        return torch.zeros_like(m)
    if mode == "half":
        return torch.full_like(m, 0.5)
    if mode == "one":
        return torch.ones_like(m)
    agree = torch.sign(m * delta)
    if mode == "hard":
        return 0.5 + 0.5 * agree
    sigma2 = torch.clamp_min(v - m * m, 0.0)
    z = m.abs() / torch.sqrt(2.0 * sigma2 + eps)
    return 0.5 + 0.5 * torch.erf(z) * agree


def _step_single(params: list[torch.Tensor], states: list[dict], group: dict,
                 ) -> tuple[float | torch.Tensor, int]:
    """Reference implementation, one tensor at a time, written as ALGORITHMS.md 1.8 reads."""
    lr, beta, eps = group["lr"], group["beta"], group["eps"]
    gamma_sum: float | torch.Tensor = 0.0
    gamma_count = 0
    for p, state in zip(params, states, strict=True):
        g = p.grad
        m, v, precond = state["m"], state["v"], state["P"]
        m.mul_(beta).add_(g, alpha=1 - beta)
        v.mul_(beta).addcmul_(g, g, value=1 - beta)
        denom = v + eps
        alpha = 1 - (1 - beta) * g * g / denom
        precond.mul_(alpha).add_((1 - beta) * m * m / denom)
        p.add_(precond * g if group["precondition"] else g, alpha=-lr)
        delta = state.get("delta")
        if delta is None:
            gamma_sum += 0.5 * p.numel()
        else:
            gamma = _gamma_single(m, v, delta, group["gamma"], eps)
            p.sub_(gamma * delta / group["num_steps"])
            gamma_sum = gamma_sum + gamma.sum()
        gamma_count += p.numel()
    return gamma_sum, gamma_count


def _step_foreach(params: list[torch.Tensor], states: list[dict], group: dict,
                  ) -> tuple[float | torch.Tensor, int]:
    """The update of :func:`_step_single` with torch's multi-tensor (foreach) kernels.

    Same algebra, fewer passes over memory: ``m`` by ``lerp``; ``alpha P + (1-beta) m^2/(v+eps)``
    as two ``addcdiv``s; the step as one ``addcmul``; and, since erf is odd,
    ``erf(z) sign(m Delta) = erf(m / sqrt(2 sigma^2 + eps)) sign(Delta)``, so the correction
    ``gamma Delta = Delta/2 + erf(.) |Delta|/2`` needs no ``|m|`` or ``sign(m Delta)`` pass.
    """
    lr, beta, eps = group["lr"], group["beta"], group["eps"]
    grads = [p.grad for p in params]
    ms = [s["m"] for s in states]
    vs = [s["v"] for s in states]
    precs = [s["P"] for s in states]
    torch._foreach_lerp_(ms, grads, 1 - beta)
    g2 = torch._foreach_mul(grads, grads)
    torch._foreach_mul_(vs, beta)
    torch._foreach_add_(vs, g2, alpha=1 - beta)
    denom = torch._foreach_add(vs, eps)
    torch._foreach_mul_(g2, precs)  # now g^2 P
    torch._foreach_addcdiv_(precs, g2, denom, value=-(1 - beta))
    m2 = torch._foreach_mul(ms, ms)
    torch._foreach_addcdiv_(precs, m2, denom, value=1 - beta)
    if group["precondition"]:
        torch._foreach_addcmul_(params, precs, grads, value=-lr)
    else:
        torch._foreach_add_(params, grads, alpha=-lr)

    gamma_count = sum(p.numel() for p in params)
    with_offset = [i for i, s in enumerate(states) if "delta" in s]
    offset_set = set(with_offset)
    gamma_sum: float | torch.Tensor = 0.5 * sum(
        p.numel() for i, p in enumerate(params) if i not in offset_set)
    if not with_offset:
        return gamma_sum, gamma_count
    o_params = [params[i] for i in with_offset]
    deltas = [states[i]["delta"] for i in with_offset]
    n_offset = sum(d.numel() for d in deltas)
    scale = -1.0 / group["num_steps"]
    mode = group["gamma"]
    if mode in ("zero", "half", "one"):
        value = {"zero": 0.0, "half": 0.5, "one": 1.0}[mode]
        if value:
            torch._foreach_add_(o_params, deltas, alpha=scale * value)
        return gamma_sum + value * n_offset, gamma_count
    signs = [states[i]["delta_sign"] for i in with_offset]
    if mode == "hard":
        agree = torch._foreach_sign([ms[i] for i in with_offset])
    else:
        spread = torch._foreach_sub([vs[i] for i in with_offset], [m2[i] for i in with_offset])
        torch._foreach_clamp_min_(spread, 0.0)
        torch._foreach_mul_(spread, 2.0)
        torch._foreach_add_(spread, eps)
        torch._foreach_sqrt_(spread)
        agree = torch._foreach_div([ms[i] for i in with_offset], spread)
        torch._foreach_erf_(agree)
    torch._foreach_mul_(agree, signs)  # erf(z) sign(m Delta), in [-1, 1]
    gamma_sum = gamma_sum + 0.5 * n_offset + 0.5 * torch.stack([a.sum() for a in agree]).sum()
    torch._foreach_add_(o_params, deltas, alpha=0.5 * scale)
    torch._foreach_mul_(agree, deltas)
    torch._foreach_add_(o_params, agree, alpha=0.5 * scale)
    return gamma_sum, gamma_count
