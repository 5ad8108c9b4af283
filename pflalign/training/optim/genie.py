"""GENIE (docs/algorithms.md 2.3-2.5): :class:`GENIE`, a ``torch.optim.Optimizer``, over its
functional core :func:`genie_update`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim import Optimizer

from pflalign.training.optim.common import closure_loss, params_with_grad

#: GENIE's internal constants (docs/algorithms.md 2.3): the variance floor and the clamp of 1/var
GENIE_FLOOR = 1e-8
GENIE_CLAMP = 10.0
#: in float32, tanh(x) == 1 exactly for every x >= this (a test checks all float32 values up to 10)
TANH_ONE = 9.5


class GENIE(Optimizer):
    """GENIE: equalizes each parameter's one-step generalization ratio (docs/algorithms.md 2.3-2.5).

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
        self._flats: dict[tuple[int, tuple[int, ...]], GenieBuffers] = {}

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = closure_loss(closure)
        for index, group in enumerate(self.param_groups):
            params = params_with_grad(group, "GENIE")
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
                chosen = [states[i] for i in idx]
                if use_foreach:
                    key = (index, tuple(map(id, bucket)))
                    used.add(key)
                    buffers = self._flats.get(key)
                    device = self.generator.device if self.generator is not None else \
                        bucket[0].device
                    if buffers is None or not buffers.serves(chosen) or \
                            buffers.words.device != device:
                        buffers = self._flats[key] = GenieBuffers(
                            bucket, [s["m"] for s in chosen], [s["s"] for s in chosen], device)
                        for state, m, s in zip(chosen, buffers.m_views, buffers.s_views,
                                               strict=True):
                            state["m"], state["s"] = m, s
                    genie_update(buffers, bucket, [q.grad for q in bucket], step=step,
                                 generators=[self.generator], **hyperparameters(group))
                else:
                    _genie_single(self.generator, bucket, chosen, group, step)
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
    """``b = 1 - beta^t`` and ``rho = (1-beta)(2-b) / ((1+beta) b)`` (docs/algorithms.md 2.3
    step 2)."""
    b = 1.0 - beta ** step
    return b, (1.0 - beta) * (2.0 - b) / ((1.0 + beta) * b)



def hyperparameters(group: dict) -> dict:
    """The keyword arguments of :func:`genie_update` from a parameter group."""
    return {k: group[k] for k in ("lr", "moving_avg", "p", "weight_decay", "precondition",
                                  "noise", "mask")}


def draw_device(generator: torch.Generator | None, like: torch.Tensor) -> torch.device:
    """Where ``generator`` draws (the tensor's device for the global generator)."""
    return generator.device if generator is not None else like.device


def draw_normal(generator: torch.Generator | None, numel: int, like: torch.Tensor,
                ) -> torch.Tensor:
    """One flat vector of ``numel`` standard normals from ``generator`` (the global generator
    when None), on ``like``'s device."""
    out = torch.randn(numel, generator=generator, device=draw_device(generator, like),
                      dtype=like.dtype)
    return out.to(like.device)


def draw_bits(generator: torch.Generator | None, numel: int, like: torch.Tensor,
              words: torch.Tensor | None = None) -> torch.Tensor:
    """``numel`` 16-bit uniform integers (four per 64-bit draw, the cheap source of the mask),
    drawn into ``words`` when given (a reusable int64 buffer of ``ceil(numel / 4)`` on the
    generator's device), on ``like``'s device."""
    if words is None:
        words = torch.empty((numel + 3) // 4, dtype=torch.int64,
                            device=draw_device(generator, like))
    words.random_(-2 ** 63, None, generator=generator)  # the full 64-bit range
    return words.view(torch.int16)[:numel].to(like.device)


def _mask_threshold(p: float) -> int:
    """``U > p`` for ``U = (bits + 2^15) / 2^16`` exactly when ``bits`` exceeds this."""
    return math.floor(p * 65536) - 32768


def _genie_mask(generator: torch.Generator | None, params: list[torch.Tensor], group: dict,
                ) -> torch.Tensor:
    """This step's keep-mask ``1[U > p]`` as a flat 0/1 vector over ``params`` in order (the
    caller rescales by ``1/(1-p)``).

    ``U = (bits + 2^15) / 2^16`` is uniform on a 2^-16 grid in [0, 1) and ``U > p`` exactly when
    ``bits > floor(p 2^16) - 2^15``: one comparison of the 16-bit draws, written straight into a
    float tensor (a boolean result would be several times slower on CPU)."""
    total = sum(p.numel() for p in params)
    bits = draw_bits(generator, total, params[0])
    out = torch.empty(total, dtype=params[0].dtype, device=params[0].device)
    return torch.gt(bits, _mask_threshold(group["p"]), out=out)


def _genie_noise(generator: torch.Generator | None, params: list[torch.Tensor],
                 ) -> list[torch.Tensor]:
    """This step's ``xi ~ N(0, I)`` for ``params``, one flat draw split per tensor."""
    flat = draw_normal(generator, sum(p.numel() for p in params), params[0])
    return [part.view_as(p) for part, p in zip(flat.split([p.numel() for p in params]), params,
                                                strict=True)]


def _genie_single(generator: torch.Generator | None, params: list[torch.Tensor],
                  states: list[dict], group: dict, step: int) -> None:
    """Reference implementation, one tensor at a time, as docs/algorithms.md 2.4 reads."""
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
    masks = _genie_mask(generator, params, group).split([p.numel() for p in params]) \
        if group["mask"] else None
    noisy = [i for i, (_, tau, _) in enumerate(stats) if group["noise"] and bool((tau < 1).any())]
    xi = dict(zip(noisy, _genie_noise(generator, [params[i] for i in noisy]), strict=True)) \
        if noisy else {}
    for i, (p, (mu, tau, r)) in enumerate(zip(params, stats, strict=True)):
        update = r * tau * mu if group["precondition"] else mu.clone()
        if i in xi:
            nu = (tau * r * mu.abs()).sum() / tau.sum()
            update += (1.0 - tau) * nu * xi[i]
        if masks is not None:
            update *= masks[i].view_as(p) / (1.0 - group["p"])
        p.sub_(lr * update)


class GenieBuffers:
    """The state :func:`genie_update` steps: ``m`` and ``s`` as two flat buffers (one row per
    client when stacked) whose per-parameter views are the optimizer's state tensors, four flat
    scratch buffers for a step's intermediates, each with its per-parameter views made once, and
    the int64 words of the mask's draws on the generators' device.

    ``params`` are one client's tensors, or a cohort's stacked ones (``stacked=True``: a leading
    client dimension; one flat row per client). ``m`` and ``s`` give the initial moments, one
    tensor per parameter shaped like it."""

    def __init__(self, params: list[torch.Tensor], m: list[torch.Tensor], s: list[torch.Tensor],
                 draw_device: torch.device, stacked: bool = False):
        self.lead = (params[0].shape[0],) if stacked else ()
        self.sizes = [p[0].numel() if stacked else p.numel() for p in params]
        total = sum(self.sizes)
        like = params[0]
        self.m, self.s = (torch.empty(*self.lead, total, dtype=like.dtype, device=like.device)
                          for _ in range(2))
        self.work = torch.empty(4, *self.lead, total, dtype=like.dtype, device=like.device)
        self.m_views, self.s_views = self.views(self.m, params), self.views(self.s, params)
        self.work_views = [self.views(row, params) for row in self.work]
        self.words = torch.empty(*self.lead, (total + 3) // 4, dtype=torch.int64,
                                 device=draw_device)
        torch._foreach_copy_(self.m_views, list(m))
        torch._foreach_copy_(self.s_views, list(s))

    @property
    def stacked(self) -> bool:
        return bool(self.lead)

    def views(self, flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """``flat``'s per-parameter views (its last dimension split by the parameters' sizes)."""
        return [part.view_as(p) for part, p in
                zip(flat.split(self.sizes, dim=-1), params, strict=True)]

    def serves(self, states: list[dict]) -> bool:
        """Whether these buffers still hold the bucket's state (not after ``load_state_dict`` or
        an outside assignment, which replace the tensors)."""
        return all(st["m"] is m and st["s"] is s for st, m, s
                   in zip(states, self.m_views, self.s_views, strict=True))


@torch.no_grad()
def genie_update(buffers: GenieBuffers, params: list[torch.Tensor], grads: list[torch.Tensor],
                 *, step: int, lr: float, moving_avg: float, p: float, weight_decay: float,
                 precondition: bool, noise: bool, mask: bool,
                 generators: list[torch.Generator | None]) -> None:
    """One GENIE step at step count ``step`` on ``params`` (in place) and their moments in
    ``buffers``; ``generators`` draws the mask and the noise (one per client).

    :func:`_genie_single`'s rule on flat buffers: ``m`` and ``s`` live in one flat buffer each
    and every intermediate is written in place into preallocated flat scratch, so each pass is
    one kernel over all coordinates and nothing is allocated per step. Same rule and the same
    random draws as the reference; the algebra is rearranged to need fewer passes over memory
    (results agree up to rounding). With ``b`` the bias correction and ``V = s - m^2/b =
    b (q - mu^2)``:

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
    exhaustively by a test). For one client, one reduction gives the largest ``var``; when every
    ``1/var`` reaches 9.5, ``tau = 1`` everywhere and the tanh, the gate product and the noise
    are skipped (the same numbers for a fraction of the work); otherwise only the tensors with
    some ``1/var < 9.5`` compute ``tau``, and only those with some ``tau < 1`` draw noise.

    Stacked (``buffers.stacked``: each tensor a cohort, one client per row): the same passes over
    every row at once, ``tau`` computed everywhere (where a client's own call skips it, it is
    exactly 1 on the CPU, so nothing changes), and per client what is per client: the NaN guard,
    its draws from its own generator in its own order (the mask over all its coordinates, the
    noise over its tensors with some ``tau < 1``) and each tensor's noise scale ``nu``. The
    cohort is at one step count (``step``)."""
    beta, wd = moving_avg, weight_decay
    b, rho = _genie_constants(beta, step)
    stacked, lead = buffers.stacked, buffers.lead
    m, s = buffers.m, buffers.s
    var_, num, zero, den = buffers.work  # scratch rows
    var_views, num_views, zero_views, den_views = buffers.work_views
    grad = torch.cat([g.reshape(*lead, -1) for g in grads], dim=-1, out=den)  # g, flat
    if wd:
        torch._foreach_add_(den_views, params, alpha=wd)
    m.lerp_(grad, 1 - beta)
    s.mul_(beta).addcmul_(grad, grad, value=1 - beta)
    spread = torch.addcmul(s, m, m, value=-1.0 / b, out=den).clamp_min_(0.0)  # V
    if 1.0 - rho > 0:
        c, k = 1.0 / (b * (1.0 - rho)), b * rho / (1.0 - rho)
        if stacked:  # non-finite gradients: var NaN -> 1e-8, per client, as the reference
            for i in torch.isnan(spread.amax(dim=-1)).nonzero().flatten().tolist():
                spread[i].nan_to_num_(nan=0.0)
            top = 0.0
        else:
            top = float(spread.max())
            if math.isnan(top):
                spread.nan_to_num_(nan=0.0)
                top = float(spread.max())
    else:  # t = 1: var = 1e-8 everywhere
        c, k, top = 0.0, 0.0, 0.0
        spread.zero_()
    torch.eq(spread, 0.0, out=zero)  # Z
    if stacked or var_.dtype != torch.float32:
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
    if precondition:
        den.mul_(m)  # b r mu
        step_views, scale = den_views, lr / b
    else:
        torch.mul(m, 1.0 / b, out=num)  # mu
        step_views, scale = num_views, lr
    if mask:  # the keep-mask into the scratch row Z, no longer needed
        total = zero.shape[-1]
        if stacked:
            for row, generator in zip(buffers.words, generators, strict=True):
                row.random_(-2 ** 63, None, generator=generator)
            bits = buffers.words.view(torch.int16)[:, :total].to(zero.device)
        else:
            bits = draw_bits(generators[0], total, zero, buffers.words)
        torch.gt(bits, _mask_threshold(p), out=zero)
    if gated:  # tau = tanh(clamp(1/var, 0, 10)) on the gated tensors, in place of their var
        tau = [var_views[i] for i in gated]
        torch._foreach_reciprocal_(tau)
        torch._foreach_clamp_min_(tau, 0.0)
        torch._foreach_clamp_max_(tau, GENIE_CLAMP)
        torch._foreach_tanh_(tau)
        gated_steps = [step_views[i] for i in gated]
        # the step buffer holds b r mu (preconditioned) or mu; the noise scale nu is
        # sum(tau r |mu|) / sum(tau), and in the buffer's units sum(|weighted|) / sum(tau)
        if precondition:
            torch._foreach_mul_(gated_steps, tau)  # b r tau mu
            weighted = gated_steps
        else:
            weighted = torch._foreach_mul([den_views[i] for i in gated], gated_steps)
            torch._foreach_mul_(weighted, tau)  # r tau mu
        if noise and stacked:
            _stacked_noise(tau, weighted, gated_steps, [params[i] for i in gated], generators)
        elif noise:
            lowest = torch.stack(torch._foreach_max(torch._foreach_neg(tau))).tolist()  # -min tau
            noisy = [j for j, x in enumerate(lowest) if -x < 1]
            if noisy:
                nus = (torch.stack([weighted[j].abs().sum() for j in noisy])
                       / torch.stack([tau[j].sum() for j in noisy])).tolist()
                extra = torch._foreach_neg([tau[j] for j in noisy])
                torch._foreach_add_(extra, 1.0)  # 1 - tau
                torch._foreach_mul_(extra, _genie_noise(generators[0],
                                                        [params[gated[j]] for j in noisy]))
                torch._foreach_mul_(extra, nus)
                torch._foreach_add_([gated_steps[j] for j in noisy], extra)
    if mask:
        torch._foreach_addcmul_(params, step_views, zero_views, value=-scale / (1.0 - p))
    else:
        torch._foreach_add_(params, step_views, alpha=-scale)


def _stacked_noise(tau: list[torch.Tensor], weighted: list[torch.Tensor],
                   steps: list[torch.Tensor], params: list[torch.Tensor],
                   generators: list[torch.Generator | None]) -> None:
    """The noise term ``(1 - tau) nu xi`` of a stacked step, added to ``steps``: per client, its
    tensors with some ``tau < 1``, ``xi`` drawn over them from its own generator in one flat
    draw (as its own call draws it) and ``nu`` per tensor and client."""
    clients = tau[0].shape[0]
    rows = [t.reshape(clients, -1) for t in tau]
    noisy = torch.stack([r.amin(dim=1) < 1 for r in rows], dim=1).tolist()  # client x tensor
    xi = [torch.zeros_like(t) for t in tau]
    for i, flags in enumerate(noisy):
        chosen = [j for j, flag in enumerate(flags) if flag]
        if chosen:
            draws = _genie_noise(generators[i], [params[j][i] for j in chosen])
            for j, draw in zip(chosen, draws, strict=True):
                xi[j][i] = draw
    if not any(any(flags) for flags in noisy):
        return
    for j, (t, w, target) in enumerate(zip(tau, weighted, steps, strict=True)):
        if not any(flags[j] for flags in noisy):
            continue
        shape = (clients, *([1] * (t.dim() - 1)))
        nu = (w.reshape(clients, -1).abs().sum(dim=1) / rows[j].sum(dim=1)).reshape(shape)
        extra = torch.neg(t).add_(1.0).mul_(xi[j]).mul_(nu)  # (1 - tau) xi nu
        target.add_(extra)
