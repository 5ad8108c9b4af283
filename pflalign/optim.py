"""Optimizers as ``torch.optim.Optimizer`` subclasses, usable in any PyTorch loop.

:class:`PFLAlign` is pFLAlign's PersonalizedLocalUpdate (ALGORITHMS.md 1.4, 1.8, 1.11).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch.optim import Optimizer

GAMMA_MODES = ("adaptive", "zero", "half", "one", "hard")


def _params_with_grad(group: dict, optimizer: str) -> list[torch.Tensor]:
    """The group's parameters that have a gradient this step (dense gradients only)."""
    params = [p for p in group["params"] if p.grad is not None]
    if any(p.grad.is_sparse for p in params):
        raise RuntimeError(f"{optimizer} does not support sparse gradients.")
    return params


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
            params = _params_with_grad(group, "PFLAlign")
            if not params:
                continue
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


#: GENIE's internal constants (ALGORITHMS.md 2.3): the variance floor and the clamp of 1/var
GENIE_FLOOR = 1e-8
GENIE_CLAMP = 10.0
#: in float32, tanh(x) == 1 exactly for every x >= this (a test checks all float32 values up to 10)
TANH_ONE = 9.5


class GENIE(Optimizer):
    """GENIE: equalizes each parameter's one-step generalization ratio (ALGORITHMS.md 2.3-2.5).

    Per tensor, with EMAs ``m`` of ``g`` and ``s`` of ``g^2`` (decay ``beta = moving_avg``) and its
    step count ``t``, element-wise (2.3 steps 1-12):

    1. ``g <- g + weight_decay theta``
    2. ``b = 1 - beta^t``; ``rho = (1-beta)(2-b) / ((1+beta) b)`` (the EMA's inverse effective
       sample size: 1 at t = 1, then down to (1-beta)/(1+beta))
    3. ``m <- beta m + (1-beta) g``; ``s <- beta s + (1-beta) g^2``
    4. ``mu = m / b``; ``q = s / b`` (bias-corrected)
    5. ``var = (q - mu^2) / (1 - rho)``, replaced by 1e-8 where it is <= 0 or NaN (at t = 1,
       where ``1 - rho = 0``, everywhere)
    6. ``tau = tanh(clamp(1 / var, 0, 10))`` (confidence gate)
    7. ``var_mu = rho var`` (1e-8 where not > 0)
    8. ``r = 1 / (1 + var_mu / (mu^2 + 1e-8))`` (the GSNR-type ratio)
    9. ``u = r tau mu`` (the OSGR-equalizing preconditioner ``P = r tau`` on the EMA mean)
    10. ``nu = sum(tau r |mu|) / sum(tau)`` (a scalar per tensor); ``n = (1 - tau) nu xi``,
        ``xi ~ N(0, I)``: noise only where the gate is low
    11. ``M = 1[U > p] / (1 - p)``, ``U ~ Uniform(0, 1)`` on a 2^-16 grid (inverted dropout of
        the update; 16 random bits per coordinate keep the draw cheap)
    12. ``theta <- theta - lr (u + n) M``

    ``lr`` is the step size (the paper's convergence rate eta; 2.8: the reference code's ``lr``
    argument is unused, here it *is* eta), so torch's learning-rate schedulers apply. At t = 1 the
    step is ``lr g M`` (2.8). Ablation switches: ``precondition=False`` steps on ``mu`` (P = 1),
    ``noise=False`` drops ``n``, ``mask=False`` sets ``M = 1``; with all three off GENIE is SGD on
    the bias-corrected EMA of the gradient.

    Randomness (``U``, then ``xi``) comes from ``generator`` (a ``torch.Generator``; the global RNG
    when None), each drawn as one flat vector per step over the group's parameters in order, so
    the single-tensor and foreach paths give the same numbers and a seeded generator reproduces a
    run. The noise draw is skipped when no coordinate has ``tau < 1`` (then ``n = 0`` exactly; in
    float32, ``tanh(10)`` rounds to 1).
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict], lr: float = 0.015,
                 moving_avg: float = 0.95, p: float = 0.4, weight_decay: float = 0.0,
                 precondition: bool = True, noise: bool = True, mask: bool = True,
                 generator: torch.Generator | None = None, foreach: bool | None = None):
        if not lr > 0:
            raise ValueError(f"GENIE: invalid lr (step size) {lr}; it must be > 0.")
        if not 0.0 <= moving_avg < 1.0:
            raise ValueError(f"GENIE: invalid moving_avg {moving_avg}; it must be in [0, 1).")
        if not 0.0 <= p < 1.0:
            raise ValueError(f"GENIE: invalid mask drop probability p {p}; it must be in [0, 1).")
        if not weight_decay >= 0:
            raise ValueError(f"GENIE: invalid weight_decay {weight_decay}; it must be >= 0.")
        defaults = dict(lr=lr, moving_avg=moving_avg, p=p, weight_decay=weight_decay,
                        precondition=precondition, noise=noise, mask=mask, foreach=foreach)
        super().__init__(params, defaults)
        self.generator = generator

    def _draw(self, kind: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """One flat vector of ``numel`` standard normals (``"normal"``) or 16-bit uniform
        integers (``"bits"``: four per 64-bit draw, the cheap source of the mask), on ``like``'s
        device."""
        device = self.generator.device if self.generator is not None else like.device
        if kind == "normal":
            out = torch.randn(numel, generator=self.generator, device=device, dtype=like.dtype)
        else:
            words = torch.empty((numel + 3) // 4, dtype=torch.int64, device=device)
            words.random_(-2 ** 63, None, generator=self.generator)  # the full 64-bit range
            out = words.view(torch.int16)[:numel]
        return out.to(like.device)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = _params_with_grad(group, "GENIE")
            if not params:
                continue
            states = []
            for p in params:
                state = self.state[p]
                if "step" not in state:
                    state["step"] = 0
                    state["m"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["s"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                states.append(state)
            use_foreach = group["foreach"]
            if use_foreach is None:
                use_foreach = len(params) > 1
            # tensors at the same step share b and rho: one foreach pass per step count
            buckets: dict[int, list[int]] = {}
            for i, state in enumerate(states):
                buckets.setdefault(state["step"], []).append(i)
            for step, idx in buckets.items():
                impl = _genie_foreach if use_foreach else _genie_single
                impl(self, [params[i] for i in idx], [states[i] for i in idx], group, step)
        return loss


def _genie_constants(beta: float, step: int) -> tuple[float, float]:
    """``b = 1 - beta^t`` and ``rho = (1-beta)(2-b) / ((1+beta) b)`` (ALGORITHMS.md 2.3 step 2)."""
    b = 1.0 - beta ** step
    return b, (1.0 - beta) * (2.0 - b) / ((1.0 + beta) * b)


def _genie_random(opt: GENIE, params: list[torch.Tensor], group: dict, need_noise: bool,
                  ) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
    """This step's noise ``xi`` and keep-mask ``1[U > p]`` per tensor (None when switched off;
    the caller rescales by ``1/(1-p)``); the mask is drawn first."""
    sizes = [p.numel() for p in params]
    total = sum(sizes)

    def split(flat: torch.Tensor) -> list[torch.Tensor]:
        return [part.view_as(p) for part, p in zip(flat.split(sizes), params, strict=True)]

    masks = None
    if group["mask"]:
        # U = (bits + 2^15) / 2^16 is uniform on a 2^-16 grid in [0, 1); U > p exactly when
        # bits > threshold, i.e. when clamp(bits - threshold, 0, 1) = 1 (integers: a 0/1 mask
        # in float arithmetic, no boolean tensors, which are slow on CPU)
        threshold = math.floor(group["p"] * 65536) - 32768
        bits = opt._draw("bits", total, params[0])
        masks = split(bits.to(params[0].dtype).sub_(threshold).clamp_(0.0, 1.0))
    xi = split(opt._draw("normal", total, params[0])) if need_noise else None
    return xi, masks


def _genie_single(opt: GENIE, params: list[torch.Tensor], states: list[dict], group: dict,
                  step: int) -> None:
    """Reference implementation, one tensor at a time, as ALGORITHMS.md 2.4 reads."""
    beta, lr, wd = group["moving_avg"], group["lr"], group["weight_decay"]
    b, rho = _genie_constants(beta, step)
    stats = []
    for p, state in zip(params, states, strict=True):
        g = p.grad + wd * p if wd else p.grad
        state["m"].mul_(beta).add_(g, alpha=1 - beta)
        state["s"].mul_(beta).addcmul_(g, g, value=1 - beta)
        mu, q = state["m"] / b, state["s"] / b
        if 1.0 - rho > 0:
            var = (q - mu * mu) / (1.0 - rho)
            var = torch.where(var > 0, var, GENIE_FLOOR)  # <= 0 or NaN -> 1e-8
        else:
            var = torch.full_like(mu, GENIE_FLOOR)
        tau = torch.tanh(torch.clamp(1.0 / var, 0.0, GENIE_CLAMP))
        var_mu = rho * var
        var_mu = torch.where(var_mu > 0, var_mu, GENIE_FLOOR)
        r = 1.0 / (1.0 + var_mu / (mu * mu + GENIE_FLOOR))
        stats.append((mu, tau, r))
    need_noise = group["noise"] and any(bool((tau < 1).any()) for _, tau, _ in stats)
    xi, masks = _genie_random(opt, params, group, need_noise)
    for i, (p, (mu, tau, r)) in enumerate(zip(params, stats, strict=True)):
        update = r * tau * mu if group["precondition"] else mu.clone()
        if xi is not None:
            nu = (tau * r * mu.abs()).sum() / tau.sum()
            update += (1.0 - tau) * nu * xi[i]
        if masks is not None:
            update *= masks[i] / (1.0 - group["p"])
        p.sub_(lr * update)


def _genie_foreach(opt: GENIE, params: list[torch.Tensor], states: list[dict], group: dict,
                   step: int) -> None:
    """:func:`_genie_single` with torch's multi-tensor (foreach) kernels: same algebra and the
    same random draws; the per-tensor sums of step 10 are L1 norms (their terms are >= 0).

    Fast path: in float32, ``tanh(x)`` rounds to exactly 1 for ``x >= TANH_ONE`` (9.5; checked
    exhaustively by a test), so when every ``1/var`` reaches it the gate is ``tau = 1`` everywhere,
    ``1 - tau = 0`` and the tanh, the gate product and the noise are skipped: the same numbers for
    a fraction of the work. The mask is a boolean multiply; its ``1/(1-p)`` joins the step's
    scalar.
    """
    beta, lr, wd = group["moving_avg"], group["lr"], group["weight_decay"]
    b, rho = _genie_constants(beta, step)
    grads = [p.grad for p in params]
    if wd:
        grads = torch._foreach_add(grads, params, alpha=wd)
    ms = [s["m"] for s in states]
    ss = [s["s"] for s in states]
    torch._foreach_lerp_(ms, grads, 1 - beta)
    torch._foreach_mul_(ss, beta)
    torch._foreach_addcmul_(ss, grads, grads, value=1 - beta)
    mu = torch._foreach_div(ms, b)
    mu2 = torch._foreach_mul(mu, mu)
    if 1.0 - rho > 0:
        var = torch._foreach_div(ss, b)
        torch._foreach_sub_(var, mu2)
        torch._foreach_div_(var, 1.0 - rho)
        _floor_(var)
    else:
        var = [torch.full_like(m, GENIE_FLOOR) for m in mu]
    tau = None  # None: exactly 1 everywhere
    if not all(p.dtype == torch.float32 for p in params) or float(
            torch.reciprocal(torch.stack(torch._foreach_max(var))).min()) < TANH_ONE:
        tau = torch._foreach_reciprocal(var)
        torch._foreach_clamp_min_(tau, 0.0)
        torch._foreach_clamp_max_(tau, GENIE_CLAMP)
        torch._foreach_tanh_(tau)
    var_mu = torch._foreach_mul(var, rho)
    _floor_(var_mu)  # var > 0 and rho > 0: changes only values that underflowed to 0
    torch._foreach_add_(mu2, GENIE_FLOOR)
    r = torch._foreach_div(var_mu, mu2)
    torch._foreach_add_(r, 1.0)
    torch._foreach_reciprocal_(r)
    gate = torch._foreach_mul(r, tau) if tau is not None else r  # P = r tau
    need_noise = group["noise"] and tau is not None and any(bool((t < 1).any()) for t in tau)
    xi, masks = _genie_random(opt, params, group, need_noise)
    update = torch._foreach_mul(gate, mu) if group["precondition"] else mu
    if xi is not None:
        weighted = torch._foreach_norm(torch._foreach_mul(gate, mu), 1)  # sum(tau r |mu|)
        tau_sum = torch._foreach_norm(tau, 1)
        nus = [float(w) / float(t) for w, t in zip(weighted, tau_sum, strict=True)]
        low = torch._foreach_neg(tau)
        torch._foreach_add_(low, 1.0)  # 1 - tau
        torch._foreach_mul_(low, xi)
        torch._foreach_mul_(low, nus)
        torch._foreach_add_(update, low)
    if masks is not None:
        torch._foreach_mul_(update, masks)
        torch._foreach_add_(params, update, alpha=-lr / (1.0 - group["p"]))
    else:
        torch._foreach_add_(params, update, alpha=-lr)


def _floor_(values: list[torch.Tensor]) -> None:
    """In place, ``where(v > 0, v, 1e-8)`` (NaN -> 1e-8) in float arithmetic only: NaN -> 0, clamp
    at 0, then add ``1e-8 (1 - sign(v))``, which is 1e-8 exactly where v = 0 and exactly 0 where
    v > 0. Boolean tensors (comparisons, ``where``) are several times slower on CPU."""
    torch._foreach_copy_(values, [torch.nan_to_num(v, nan=0.0, posinf=math.inf) for v in values])
    torch._foreach_clamp_min_(values, 0.0)
    gap = torch._foreach_sign(values)
    torch._foreach_mul_(gap, -GENIE_FLOOR)
    torch._foreach_add_(gap, GENIE_FLOOR)
    torch._foreach_add_(values, gap)
