"""Optimizers as ``torch.optim.Optimizer`` subclasses, usable in any PyTorch loop.

:class:`PFLAlign` is pFLAlign's PersonalizedLocalUpdate (ALGORITHMS.md 1.4, 1.8, 1.11).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch.optim import Optimizer

GAMMA_MODES = ("adaptive", "zero", "half", "one", "hard")


def _closure_loss(closure):
    """The loss of ``closure`` (re-evaluated with gradients enabled), or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


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
        loss = _closure_loss(closure)
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
    when None), each drawn as one flat vector per step: ``U`` over the group's parameters in
    order, ``xi`` over those tensors, in order, that have some ``tau < 1`` (elsewhere
    ``1 - tau = 0`` and ``n = 0`` exactly; in float32, ``tanh(x)`` rounds to 1 for x >= 9.5, so
    low-variance tensors draw no noise). So the single-tensor and fast paths give the same numbers
    and a seeded generator reproduces a run.

    ``foreach`` (default: when the group's parameters share one dtype and device) selects the fast
    path: ``m`` and ``s`` kept in flat buffers (the state tensors are views of them) and every
    intermediate written into preallocated flat scratch, about 6 floats of memory per parameter
    in all; ``foreach=False`` is the reference, one tensor at a time as 2.4 reads.
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
        # the fast path's flat buffers, per (group index, the bucket's parameters)
        self._flats: dict[tuple[int, tuple[int, ...]], _Flat] = {}

    def _draw(self, kind: str, numel: int, like: torch.Tensor,
              words: torch.Tensor | None = None) -> torch.Tensor:
        """One flat vector of ``numel`` standard normals (``"normal"``) or 16-bit uniform
        integers (``"bits"``: four per 64-bit draw, the cheap source of the mask; drawn into
        ``words`` when given, a reusable int64 buffer of ``ceil(numel / 4)`` on the generator's
        device), on ``like``'s device."""
        device = self.generator.device if self.generator is not None else like.device
        if kind == "normal":
            out = torch.randn(numel, generator=self.generator, device=device, dtype=like.dtype)
        else:
            if words is None:
                words = torch.empty((numel + 3) // 4, dtype=torch.int64, device=device)
            words.random_(-2 ** 63, None, generator=self.generator)  # the full 64-bit range
            out = words.view(torch.int16)[:numel]
        return out.to(like.device)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = _closure_loss(closure)
        for index, group in enumerate(self.param_groups):
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
            # the flat fast path needs one dtype and device per group; foreach=None picks it then
            uniform = len({(p.dtype, p.device) for p in params}) == 1
            if group["foreach"] and not uniform:
                raise ValueError("GENIE(foreach=True) needs one dtype and device per parameter "
                                 "group; split the parameters into groups or pass foreach=False.")
            use_foreach = uniform if group["foreach"] is None else group["foreach"]
            # tensors at the same step share b and rho: one foreach pass per step count
            buckets: dict[int, list[int]] = {}
            for i, state in enumerate(states):
                buckets.setdefault(state["step"], []).append(i)
            used = set()
            for step, idx in buckets.items():
                # empty tensors have nothing to update and draw nothing
                idx = [i for i in idx if params[i].numel()]
                if not idx:
                    continue
                bucket = [params[i] for i in idx]
                if use_foreach:
                    key = (index, tuple(map(id, bucket)))
                    used.add(key)
                    _genie_flat(self, bucket, [states[i] for i in idx], group, step, key)
                else:
                    _genie_single(self, bucket, [states[i] for i in idx], group, step)
            # buffers of buckets this group no longer has (they would only hold memory)
            for key in [k for k in self._flats if k[0] == index and k not in used]:
                del self._flats[key]
        return loss

    def __getstate__(self) -> dict:  # copy/pickle: keep the generator; the buffers are rebuilt
        state = super().__getstate__()
        state["generator"] = self.generator
        return state

    def __setstate__(self, state: dict) -> None:  # also what load_state_dict calls
        if "generator" in state or not hasattr(self, "generator"):
            self.generator = state.pop("generator", None)
        super().__setstate__(state)
        self._flats = {}


def _genie_constants(beta: float, step: int) -> tuple[float, float]:
    """``b = 1 - beta^t`` and ``rho = (1-beta)(2-b) / ((1+beta) b)`` (ALGORITHMS.md 2.3 step 2)."""
    b = 1.0 - beta ** step
    return b, (1.0 - beta) * (2.0 - b) / ((1.0 + beta) * b)


def _genie_mask(opt: GENIE, params: list[torch.Tensor], group: dict,
                out: torch.Tensor | None = None, words: torch.Tensor | None = None,
                ) -> torch.Tensor:
    """This step's keep-mask ``1[U > p]`` as a flat 0/1 vector over ``params`` in order (the
    caller rescales by ``1/(1-p)``), written into ``out`` when given.

    ``U = (bits + 2^15) / 2^16`` is uniform on a 2^-16 grid in [0, 1) and ``U > p`` exactly when
    ``bits > floor(p 2^16) - 2^15``: one comparison of the 16-bit draws, written straight into a
    float tensor (a boolean result would be several times slower on CPU)."""
    total = sum(p.numel() for p in params)
    threshold = math.floor(group["p"] * 65536) - 32768
    bits = opt._draw("bits", total, params[0], words)
    if out is None:
        out = torch.empty(total, dtype=params[0].dtype, device=params[0].device)
    return torch.gt(bits, threshold, out=out)


def _genie_noise(opt: GENIE, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """This step's ``xi ~ N(0, I)`` for ``params``, one flat draw split per tensor."""
    flat = opt._draw("normal", sum(p.numel() for p in params), params[0])
    return [part.view_as(p) for part, p in zip(flat.split([p.numel() for p in params]), params,
                                                strict=True)]


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
    masks = _genie_mask(opt, params, group).split([p.numel() for p in params]) \
        if group["mask"] else None
    noisy = [i for i, (_, tau, _) in enumerate(stats) if group["noise"] and bool((tau < 1).any())]
    xi = dict(zip(noisy, _genie_noise(opt, [params[i] for i in noisy]), strict=True)) \
        if noisy else {}
    for i, (p, (mu, tau, r)) in enumerate(zip(params, stats, strict=True)):
        update = r * tau * mu if group["precondition"] else mu.clone()
        if i in xi:
            nu = (tau * r * mu.abs()).sum() / tau.sum()
            update += (1.0 - tau) * nu * xi[i]
        if masks is not None:
            update *= masks[i].view_as(p) / (1.0 - group["p"])
        p.sub_(lr * update)


class _Flat:
    """A bucket's ``m`` and ``s`` as views of two flat buffers (so ``state["m"]``/``state["s"]``
    stay per-parameter tensors), plus four flat scratch buffers for the step's intermediates, each
    with its per-parameter views made once, and the int64 words of the mask's draws on the
    generator's device. The optimizer keys it by the bucket's parameters."""

    def __init__(self, params: list[torch.Tensor], states: list[dict],
                 draw_device: torch.device):
        self.sizes = [p.numel() for p in params]
        total = sum(self.sizes)
        like = params[0]
        self.m, self.s = (torch.empty(total, dtype=like.dtype, device=like.device)
                          for _ in range(2))
        self.work = torch.empty(4, total, dtype=like.dtype, device=like.device)
        self.m_views, self.s_views = self.views(self.m, params), self.views(self.s, params)
        self.work_views = [self.views(row, params) for row in self.work]
        self.words = torch.empty((total + 3) // 4, dtype=torch.int64, device=draw_device)
        torch._foreach_copy_(self.m_views, [s["m"] for s in states])
        torch._foreach_copy_(self.s_views, [s["s"] for s in states])
        for state, m, s in zip(states, self.m_views, self.s_views, strict=True):
            state["m"], state["s"] = m, s

    def views(self, flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
        return [part.view_as(p) for part, p in zip(flat.split(self.sizes), params, strict=True)]

    def serves(self, states: list[dict]) -> bool:
        """Whether these buffers still hold the bucket's state (not after ``load_state_dict`` or
        an outside assignment, which replace the tensors)."""
        return all(st["m"] is m and st["s"] is s for st, m, s
                   in zip(states, self.m_views, self.s_views, strict=True))


def _genie_flat(opt: GENIE, params: list[torch.Tensor], states: list[dict], group: dict,
                step: int, key: tuple) -> None:
    """:func:`_genie_single` on flat buffers: ``m`` and ``s`` live in one flat buffer each (the
    per-parameter state tensors are views of it) and every intermediate is written in place into
    preallocated flat scratch, so each pass is one kernel over all coordinates and nothing is
    allocated per step. Same rule and the same random draws as the reference; the algebra is
    rearranged to need fewer passes over memory (results agree up to rounding). With ``b`` the
    bias correction and ``V = s - m^2/b = b (q - mu^2)``:

    - ``var = c V`` with ``c = 1/(b (1 - rho))``, and ``1e-8`` where ``V <= 0``: with ``V``
      clamped at 0 and ``Z = 1[V = 0]`` (a comparison written into a float tensor: boolean
      tensors are several times slower on CPU), ``var = c V + 1e-8 Z`` (NaN -> 1e-8);
    - ``r = X / D`` with ``X = b^2 (mu^2 + 1e-8) = m^2 + b^2 1e-8`` and
      ``D = b^2 (mu^2 + 1e-8 + rho var) = X + (b rho / (1 - rho)) V + b^2 rho 1e-8 Z``;
    - the step ``lr r mu M = (lr / b) (r m) M``: the ``1/b`` joins the step's scalar.

    The random draws are the reference's, except where the two roundings of ``q - mu^2`` put a
    tensor on different sides of the gate: in float32 that needs ``|mu|`` of several hundred,
    where cancellation alone makes ``var`` of order 0.1.

    ``var_mu = rho var`` is not floored a second time: it underflows to 0 only for
    ``var < ~5e-44``, which needs ``|mu| < ~1e-18``, where the step is negligible either way.

    The gate: in float32, ``tanh(x)`` rounds to exactly 1 for ``x >= TANH_ONE`` (9.5; checked
    exhaustively by a test). One reduction gives the largest ``var``; when every ``1/var`` reaches
    9.5, ``tau = 1`` everywhere and the tanh, the gate product and the noise are skipped (the same
    numbers for a fraction of the work). Otherwise only the tensors with some ``1/var < 9.5``
    compute ``tau``, and only those with some ``tau < 1`` draw noise.
    """
    beta, lr, wd = group["moving_avg"], group["lr"], group["weight_decay"]
    b, rho = _genie_constants(beta, step)
    flat = opt._flats.get(key)  # ``key``: (the group's index, the bucket's parameter ids)
    device = opt.generator.device if opt.generator is not None else params[0].device
    if flat is None or not flat.serves(states) or flat.words.device != device:
        flat = opt._flats[key] = _Flat(params, states, device)
    m, s = flat.m, flat.s
    var_, num, zero, den = flat.work  # scratch rows
    var_views, num_views, zero_views, den_views = flat.work_views
    grad = torch.cat([p.grad.reshape(-1) for p in params], out=den)  # g, flat
    if wd:
        torch._foreach_add_(den_views, params, alpha=wd)
    m.lerp_(grad, 1 - beta)
    s.mul_(beta).addcmul_(grad, grad, value=1 - beta)
    spread = torch.addcmul(s, m, m, value=-1.0 / b, out=den).clamp_min_(0.0)  # V
    if 1.0 - rho > 0:
        c, k = 1.0 / (b * (1.0 - rho)), b * rho / (1.0 - rho)
        top = float(spread.max())
        if math.isnan(top):  # non-finite gradients: var NaN -> 1e-8, as the reference
            spread.nan_to_num_(nan=0.0)
            top = float(spread.max())
    else:  # t = 1: var = 1e-8 everywhere
        c, k, top = 0.0, 0.0, 0.0
        spread.zero_()
    torch.eq(spread, 0.0, out=zero)  # Z
    if var_.dtype != torch.float32:
        gated = list(range(len(params)))
    elif top > 0 and float(torch.reciprocal(torch.tensor(top * c, dtype=var_.dtype))) < TANH_ONE:
        gated = None  # decided per tensor below
    else:
        gated = []
    if gated != []:  # var itself, for tau
        torch.mul(zero, GENIE_FLOOR, out=var_).add_(spread, alpha=c)
        if gated is None:
            inv = torch.reciprocal(torch.stack(torch._foreach_max(var_views))).tolist()
            gated = [i for i, x in enumerate(inv) if x < TANH_ONE]
    floor = b * b * GENIE_FLOOR
    torch.addcmul(torch.tensor(floor, dtype=m.dtype, device=m.device), m, m, out=num)  # X
    torch.add(num, spread, alpha=k, out=den).add_(zero, alpha=floor * rho)  # D
    torch.div(num, den, out=den)  # r
    if group["precondition"]:
        den.mul_(m)  # b r mu
        step_views, scale = den_views, lr / b
    else:
        torch.mul(m, 1.0 / b, out=num)  # mu
        step_views, scale = num_views, lr
    mask = _genie_mask(opt, params, group, out=zero, words=flat.words) if group["mask"] else None
    if gated:  # tau = tanh(clamp(1/var, 0, 10)) on the gated tensors, in place of their var
        tau = [var_views[i] for i in gated]
        torch._foreach_reciprocal_(tau)
        torch._foreach_clamp_min_(tau, 0.0)
        torch._foreach_clamp_max_(tau, GENIE_CLAMP)
        torch._foreach_tanh_(tau)
        gated_steps = [step_views[i] for i in gated]
        # the step buffer holds b r mu (preconditioned) or mu; the noise scale nu is
        # sum(tau r |mu|) / sum(tau), and in the buffer's units sum(|weighted|) / sum(tau)
        if group["precondition"]:
            torch._foreach_mul_(gated_steps, tau)  # b r tau mu
            weighted = gated_steps
        else:
            weighted = torch._foreach_mul([den_views[i] for i in gated], gated_steps)
            torch._foreach_mul_(weighted, tau)  # r tau mu
        noisy = []
        if group["noise"]:
            lowest = torch.stack(torch._foreach_max(torch._foreach_neg(tau))).tolist()  # -min tau
            noisy = [j for j, x in enumerate(lowest) if -x < 1]
        if noisy:
            nus = (torch.stack([weighted[j].abs().sum() for j in noisy])
                   / torch.stack([tau[j].sum() for j in noisy])).tolist()
            extra = torch._foreach_neg([tau[j] for j in noisy])
            torch._foreach_add_(extra, 1.0)  # 1 - tau
            torch._foreach_mul_(extra, _genie_noise(opt, [params[gated[j]] for j in noisy]))
            torch._foreach_mul_(extra, nus)
            torch._foreach_add_([gated_steps[j] for j in noisy], extra)
    if mask is not None:
        torch._foreach_addcmul_(params, step_views, zero_views,
                                value=-scale / (1.0 - group["p"]))
    else:
        torch._foreach_add_(params, step_views, alpha=-scale)
