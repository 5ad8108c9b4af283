"""pFLAlign's PersonalizedLocalUpdate (docs/algorithms.md 1.4, 1.8, 1.11): :class:`PFLAlign`, a
``torch.optim.Optimizer``, over its functional core :func:`pflalign_update`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch.optim import Optimizer

from pflalign.training.optim.common import closure_loss, params_with_grad

GAMMA_MODES = ("adaptive", "zero", "half", "one", "hard")


def hyperparameters(group: dict) -> dict:
    """The keyword arguments of :func:`pflalign_update` from a parameter group."""
    return {k: group[k] for k in ("lr", "beta", "eps", "precondition", "gamma")}


class PFLAlign(Optimizer):
    """pFLAlign's variance-reduced, gradient-aligned local update (docs/algorithms.md 1.4 and 1.8).

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
        loss = closure_loss(closure)
        for group in self.param_groups:
            params = params_with_grad(group, "PFLAlign")
            if not params:
                continue
            states = [self._init_state(p) for p in params]
            use_foreach = group["foreach"]
            if use_foreach is None:
                use_foreach = all(p.device.type != "cpu" for p in params) or len(params) > 1
            if use_foreach:
                gamma_sum, gamma_count = pflalign_update(
                    params, [p.grad for p in params], [s["m"] for s in states],
                    [s["v"] for s in states], [s["P"] for s in states],
                    [s.get("delta") for s in states], [s.get("delta_sign") for s in states],
                    **hyperparameters(group), num_steps=group["num_steps"])
            else:
                gamma_sum, gamma_count = _step_single(params, states, group)
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
    """Reference implementation, one tensor at a time, written as docs/algorithms.md 1.8 reads."""
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


def pflalign_update(params: list[torch.Tensor], grads: list[torch.Tensor],
                    m: list[torch.Tensor], v: list[torch.Tensor], P: list[torch.Tensor],
                    deltas: Sequence[torch.Tensor | None],
                    delta_signs: Sequence[torch.Tensor | None],
                    *, lr: float, beta: float, eps: float, precondition: bool, gamma: str,
                    num_steps: int | torch.Tensor, stacked: bool = False,
                    ) -> tuple[float | torch.Tensor, int]:
    """One step of :class:`PFLAlign` on lists of tensors, in place on ``params``, ``m``, ``v`` and
    ``P``; returns the sum of gamma over the coordinates and their count (for ``mean_gamma``).

    ``deltas[i]`` is parameter i's offset Delta (None: no offset, so no correction) and
    ``delta_signs[i]`` its sign; ``num_steps`` is the round's T. The same algebra as
    :func:`_step_single` with torch's multi-tensor (foreach) kernels, in fewer passes over memory:
    ``m`` by ``lerp``; ``alpha P + (1-beta) m^2/(v+eps)`` as two ``addcdiv``s; the step as one
    ``addcmul``; and, since erf is odd, ``erf(z) sign(m Delta) = erf(m / sqrt(2 sigma^2 + eps))
    sign(Delta)``, so the correction ``gamma Delta = Delta/2 + erf(.) |Delta|/2`` needs no ``|m|``
    or ``sign(m Delta)`` pass.

    ``stacked=True``: every tensor holds a cohort, one client per row of its leading dimension;
    ``num_steps`` may then be one T per client (a 1-d tensor), and the gamma sum is one per client
    (a 1-d tensor; the count is per client). Everything else is element-wise, so each client's
    rows get the values its own call would give them; where T differs between clients its
    correction is scaled by a tensor rather than a number, which may round the last bit
    differently (a test bounds it)."""
    clients = params[0].shape[0] if stacked else None
    grads = list(grads)
    torch._foreach_lerp_(m, grads, 1 - beta)
    g2 = torch._foreach_mul(grads, grads)
    torch._foreach_mul_(v, beta)
    torch._foreach_add_(v, g2, alpha=1 - beta)
    denom = torch._foreach_add(v, eps)
    torch._foreach_mul_(g2, P)  # now g^2 P
    torch._foreach_addcdiv_(P, g2, denom, value=-(1 - beta))
    m2 = torch._foreach_mul(m, m)
    torch._foreach_addcdiv_(P, m2, denom, value=1 - beta)
    if precondition:
        torch._foreach_addcmul_(params, P, grads, value=-lr)
    else:
        torch._foreach_add_(params, grads, alpha=-lr)

    def count(tensors: Iterable[torch.Tensor]) -> int:  # coordinates per client
        return sum(t.numel() // (clients or 1) for t in tensors)

    gamma_count = count(params)
    with_offset = [i for i, d in enumerate(deltas) if d is not None]
    offset_set = set(with_offset)
    gamma_sum: float | torch.Tensor = 0.5 * count(
        p for i, p in enumerate(params) if i not in offset_set)
    if not with_offset:
        return gamma_sum, gamma_count
    o_params = [params[i] for i in with_offset]
    o_deltas = [deltas[i] for i in with_offset]
    n_offset = count(o_deltas)
    if isinstance(num_steps, torch.Tensor):  # one T per client: scale each client's rows
        scales = (-1.0 / num_steps.to(params[0])).reshape(-1)

        def add_scaled_(targets: list[torch.Tensor], values: list[torch.Tensor],
                        factor: float) -> None:
            torch._foreach_addcmul_(targets, values, [
                (factor * scales).reshape(-1, *([1] * (t.dim() - 1))) for t in targets])
    else:
        scale = -1.0 / num_steps

        def add_scaled_(targets: list[torch.Tensor], values: list[torch.Tensor],
                        factor: float) -> None:
            torch._foreach_add_(targets, values, alpha=factor * scale)

    if gamma in ("zero", "half", "one"):
        value = {"zero": 0.0, "half": 0.5, "one": 1.0}[gamma]
        if value:
            add_scaled_(o_params, o_deltas, value)
        return gamma_sum + value * n_offset, gamma_count
    signs = [delta_signs[i] for i in with_offset]
    if gamma == "hard":
        agree = torch._foreach_sign([m[i] for i in with_offset])
    else:
        spread = torch._foreach_sub([v[i] for i in with_offset], [m2[i] for i in with_offset])
        torch._foreach_clamp_min_(spread, 0.0)
        torch._foreach_mul_(spread, 2.0)
        torch._foreach_add_(spread, eps)
        torch._foreach_sqrt_(spread)
        agree = torch._foreach_div([m[i] for i in with_offset], spread)
        torch._foreach_erf_(agree)
    torch._foreach_mul_(agree, signs)  # erf(z) sign(m Delta), in [-1, 1]
    if clients is None:
        agreement = torch.stack([a.sum() for a in agree]).sum()
    else:
        agreement = torch.stack([a.reshape(clients, -1).sum(dim=1) for a in agree]).sum(dim=0)
    gamma_sum = gamma_sum + 0.5 * n_offset + 0.5 * agreement
    add_scaled_(o_params, o_deltas, 0.5)
    torch._foreach_mul_(agree, o_deltas)
    add_scaled_(o_params, agree, 0.5)
    return gamma_sum, gamma_count
