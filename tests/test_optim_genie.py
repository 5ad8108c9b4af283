"""GENIE (docs/algorithms.md 2.3-2.5) against hand-computed values, its switches and its paths."""

import math

import pytest
import torch

from pflalign.training.optim import GENIE


def _param(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def _step(opt, p, grad):
    p.grad = torch.tensor(grad, dtype=p.dtype)
    opt.step()


def test_first_step_is_lr_times_gradient_times_mask():
    start = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    g = torch.tensor([0.4, -0.2, 1.0, 0.0], dtype=torch.float64)
    words = torch.empty(1, dtype=torch.int64).random_(-2 ** 63, None,
                                                      generator=torch.Generator().manual_seed(0))
    keep = (words.view(torch.int16)[:4] > int(0.4 * 65536) - 32768).double() / 0.6
    # at t = 1: rho = 1, var = 1e-8, tau = tanh(10), r = 1 / (1 + 1e-8 / (g^2 + 1e-8))
    r = 1 / (1 + 1e-8 / (g * g + 1e-8))
    for noise in (False, True):
        p = start.clone().requires_grad_(True)
        opt = GENIE([p], lr=0.1, noise=noise, generator=torch.Generator().manual_seed(0))
        p.grad = g.clone()
        opt.step()
        if not noise:
            torch.testing.assert_close(p.detach(), start - 0.1 * math.tanh(10) * r * g * keep,
                                       rtol=0, atol=1e-15)
        torch.testing.assert_close(p.detach(), start - 0.1 * g * keep, rtol=0, atol=1e-8)


def test_second_step_by_hand():
    beta, lr = 0.9, 0.1
    g1, g2 = 1.0, 3.0
    p = _param([0.0])
    opt = GENIE([p], lr=lr, moving_avg=beta, noise=False, mask=False)
    _step(opt, p, [g1])
    _step(opt, p, [g2])
    b1 = 1 - beta
    theta1 = -lr * math.tanh(10) * (1 / (1 + 1e-8 / (g1 * g1 + 1e-8))) * g1
    b = 1 - beta ** 2
    rho = (1 - beta) * (2 - b) / ((1 + beta) * b)
    assert rho == pytest.approx(((0.1 * 0.9) ** 2 + 0.1 ** 2) / (0.1 * 0.9 + 0.1) ** 2)
    m = beta * (1 - beta) * g1 + (1 - beta) * g2
    s = beta * (1 - beta) * g1 ** 2 + (1 - beta) * g2 ** 2
    mu, q = m / b, s / b
    var = (q - mu * mu) / (1 - rho)
    tau = math.tanh(min(max(1 / var, 0), 10))
    r = 1 / (1 + rho * var / (mu * mu + 1e-8))
    assert b1 == pytest.approx(0.1) and 0 < tau < 1 and 0 < r < 1
    assert p.item() == pytest.approx(theta1 - lr * r * tau * mu, rel=1e-12)


def test_mask_keeps_one_minus_p_and_rescales():
    p = torch.zeros(200_000, dtype=torch.float64, requires_grad=True)
    opt = GENIE([p], lr=1.0, p=0.4, noise=False, precondition=False,
                generator=torch.Generator().manual_seed(3))
    p.grad = torch.ones_like(p)
    opt.step()
    moved = -p.detach()
    kept = moved != 0
    assert float(kept.double().mean()) == pytest.approx(0.6, abs=0.005)
    torch.testing.assert_close(moved[kept], torch.full_like(moved[kept], 1 / 0.6))


def test_switches_off_reduce_to_sgd_on_the_bias_corrected_ema():
    beta, lr = 0.95, 0.05
    p = _param([1.0, 2.0])
    opt = GENIE([p], lr=lr, moving_avg=beta, precondition=False, noise=False, mask=False)
    grads = [[0.5, -1.0], [0.3, 2.0], [-0.7, 0.1]]
    m = torch.zeros(2, dtype=torch.float64)
    theta = torch.tensor([1.0, 2.0], dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        _step(opt, p, g)
        m = beta * m + (1 - beta) * torch.tensor(g, dtype=torch.float64)
        theta = theta - lr * m / (1 - beta ** t)
    torch.testing.assert_close(p.detach(), theta)


def test_noise_only_where_the_gate_is_low():
    # huge gradient variance on coordinate 0 (tau < 1 there), none on coordinate 1
    p = _param([0.0, 0.0])
    opt = GENIE([p], lr=0.1, mask=False, generator=torch.Generator().manual_seed(1))
    quiet = GENIE([_param([0.0, 0.0])], lr=0.1, mask=False, noise=False)
    q = quiet.param_groups[0]["params"][0]
    for g in ([10.0, 1.0], [-10.0, 1.0], [10.0, 1.0]):
        _step(opt, p, g)
        _step(quiet, q, g)
    # tanh(10) < 1 in float64, so coordinate 1 gets noise of relative size 1 - tanh(10) ~ 4e-9
    assert abs(p[1].item() - q[1].item()) < 1e-8
    assert abs(p[0].item() - q[0].item()) > 1e-4


def _both_paths(init, grads, seed, **kwargs):
    """The parameters after stepping ``grads`` from ``init`` on the reference path and on the
    fast path, each with a generator seeded alike."""
    results = []
    for foreach in (False, True):
        params = [t.clone().requires_grad_(True) for t in init]
        opt = GENIE(params, generator=torch.Generator().manual_seed(seed), foreach=foreach,
                    **kwargs)
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.clone()
            opt.step()
        results.append([p.detach() for p in params])
    return results


@pytest.mark.parametrize("switches", [{}, {"precondition": False}, {"noise": False},
                                      {"mask": False}, {"weight_decay": 0.01}])
def test_foreach_path_equals_the_reference_path(switches):
    torch.manual_seed(0)
    shapes = [(5, 3), (3,), (4, 2, 2)]
    init = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) * (1 + 5 * i) for s in shapes] for i in range(6)]
    for a, b in zip(*_both_paths(init, grads, seed=7, lr=0.05, **switches), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_seeded_runs_reproduce_and_state_dict_round_trips():
    def run(seed, steps, opt_state=None, start=None):
        p = (start.clone() if start is not None else torch.ones(50)).requires_grad_(True)
        gen = torch.Generator().manual_seed(seed)
        opt = GENIE([p], generator=gen)
        if opt_state is not None:
            opt.load_state_dict(opt_state)
        for i in range(steps):
            p.grad = torch.sin(torch.arange(50.0) * (i + 1))
            opt.step()
        return p.detach(), opt

    a, _ = run(5, 4)
    b, _ = run(5, 4)
    c, _ = run(6, 4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    _, opt = run(5, 2)
    state = opt.state_dict()
    assert {"m", "s", "step"} <= set(state["state"][0])
    restored = GENIE([torch.zeros(50, requires_grad=True)])
    restored.load_state_dict(state)
    assert restored.state_dict()["state"][0]["step"] == 2
    torch.testing.assert_close(restored.state_dict()["state"][0]["m"], state["state"][0]["m"])


def test_lr_is_the_step_size_and_schedulers_drive_it():
    p = _param([0.0])
    opt = GENIE([p], lr=0.2, noise=False, mask=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _step(opt, p, [1.0])
    first = -p.item()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    assert first == pytest.approx(0.2 * math.tanh(10) / (1 + 1e-8 / (1 + 1e-8)))


@pytest.mark.parametrize("kwargs, match", [({"lr": 0.0}, "lr"), ({"moving_avg": 1.0},
                                           "moving_avg"), ({"p": 1.0}, "drop"),
                                          ({"weight_decay": -1.0}, "weight_decay")])
def test_invalid_arguments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GENIE([torch.zeros(1, requires_grad=True)], **kwargs)


def test_float32_tanh_is_exactly_one_from_the_fast_path_threshold():
    from pflalign.training.optim import GENIE_CLAMP, TANH_ONE

    lo = int(torch.tensor(TANH_ONE).view(torch.int32))
    hi = int(torch.tensor(GENIE_CLAMP).view(torch.int32))
    grid = torch.arange(lo, hi + 1, dtype=torch.int32).view(torch.float32)
    assert bool((torch.tanh(grid) == 1).all())
    assert all(float(torch.tanh(torch.tensor([x]))) == 1.0 for x in (TANH_ONE, 9.75, 10.0))


def test_fast_path_gives_the_reference_numbers_in_float32():
    gen = torch.Generator().manual_seed(4)
    init = [torch.randn(6, 5, generator=gen), torch.randn(7, generator=gen)]
    # small gradients: var << 0.1, tau == 1 in float32
    grads = [[torch.randn(t.shape, generator=gen) * 0.01 for t in init] for _ in range(5)]
    for a, b in zip(*_both_paths(init, grads, seed=1, lr=0.05), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _spec_run(init, grads, lr, beta, p, precondition, noise, mask, seed):
    """docs/algorithms.md 2.3 steps 1-12 in float64 NumPy, written independently of the optimizer.
    The randomness is replayed from a generator seeded alike, in GENIE's documented order: the
    mask's 16-bit draws (four per 64-bit word) over all coordinates, then xi over the tensors
    whose float32 gate has some tau < 1."""
    import numpy as np

    gen = torch.Generator().manual_seed(seed)
    thetas = [t.double().numpy().copy() for t in init]
    ms = [np.zeros_like(t) for t in thetas]
    ss = [np.zeros_like(t) for t in thetas]
    floor = 1e-8
    for t, step_grads in enumerate(grads, start=1):
        b = 1 - beta ** t
        rho = (1 - beta) * (2 - b) / ((1 + beta) * b)
        stats = []
        for i, g in enumerate(step_grads):
            g = g.double().numpy()
            ms[i] = beta * ms[i] + (1 - beta) * g
            ss[i] = beta * ss[i] + (1 - beta) * g * g
            mu, q = ms[i] / b, ss[i] / b
            var = (q - mu * mu) / (1 - rho) if 1 - rho > 0 else np.full_like(mu, floor)
            var = np.where(var > 0, var, floor)
            tau = np.tanh(np.clip(1 / var, 0, 10))
            var_mu = np.where(rho * var > 0, rho * var, floor)
            r = 1 / (1 + var_mu / (mu * mu + floor))
            gate32 = torch.tanh(torch.tensor(np.clip(1 / var, 0, 10), dtype=torch.float32))
            stats.append((mu, tau, r, bool((gate32 < 1).any())))
        sizes = [th.size for th in thetas]
        keep = None
        if mask:
            words = torch.empty((sum(sizes) + 3) // 4, dtype=torch.int64)
            words.random_(-2 ** 63, None, generator=gen)
            uniform = (words.view(torch.int16)[:sum(sizes)].numpy().astype(np.float64)
                       + 32768) / 65536
            keep = np.split((uniform > p) / (1 - p), np.cumsum(sizes)[:-1])
        noisy = [i for i, s in enumerate(stats) if noise and s[3]]
        xi = {}
        if noisy:
            flat = torch.randn(sum(sizes[i] for i in noisy), generator=gen).double().numpy()
            parts = np.split(flat, np.cumsum([sizes[i] for i in noisy])[:-1])
            xi = dict(zip(noisy, parts, strict=True))
        for i, (mu, tau, r, _) in enumerate(stats):
            u = r * tau * mu if precondition else mu.copy()
            if i in xi:
                nu = (tau * r * np.abs(mu)).sum() / tau.sum()
                u = u + (1 - tau) * nu * xi[i].reshape(mu.shape)
            if keep is not None:
                u = u * keep[i].reshape(mu.shape)
            thetas[i] = thetas[i] - lr * u
    return thetas


# the reference repository's ablation classes (docs/algorithms.md 2.2): preconditioning only, then
# + noise, then + noise + mask (the full rule); and the mask alone on the EMA mean
ABLATIONS = [dict(precondition=True, noise=False, mask=False),
             dict(precondition=True, noise=True, mask=False),
             dict(precondition=True, noise=True, mask=True),
             dict(precondition=False, noise=False, mask=True)]


@pytest.mark.parametrize("switches", ABLATIONS)
@pytest.mark.parametrize("foreach", [False, True])
def test_ablation_classes_follow_the_rule_computed_by_hand(switches, foreach):
    gen = torch.Generator().manual_seed(3)
    init = [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen),
            torch.randn(2, 2, generator=gen)]
    # tensor 0: gradients of size ~3 that flip sign (var >> 0.1: the gate is low, noise flows);
    # tensors 1 and 2: gradients ~0.01 (tau == 1 in float32: no noise drawn for them)
    grads = [[3 * torch.randn(4, 3, generator=gen), 0.01 * torch.randn(5, generator=gen),
              0.01 * torch.randn(2, 2, generator=gen)] for _ in range(6)]
    params = [t.clone().requires_grad_(True) for t in init]
    opt = GENIE(params, lr=0.05, moving_avg=0.9, p=0.3, foreach=foreach,
                generator=torch.Generator().manual_seed(11), **switches)
    for step_grads in grads:
        for prm, g in zip(params, step_grads, strict=True):
            prm.grad = g.clone()
        opt.step()
    expected = _spec_run(init, grads, lr=0.05, beta=0.9, p=0.3, seed=11, **switches)
    for prm, want in zip(params, expected, strict=True):
        torch.testing.assert_close(prm.detach().double(), torch.from_numpy(want),
                                   rtol=1e-5, atol=1e-6)
    for switch in ("noise", "mask"):  # each switched-on part changes the run measurably
        if switches[switch]:
            without = _spec_run(init, grads, lr=0.05, beta=0.9, p=0.3, seed=11,
                                **{**switches, switch: False})
            assert not torch.allclose(params[0].detach().double(), torch.from_numpy(without[0]),
                                      rtol=1e-3, atol=1e-4)


def test_a_reloaded_state_continues_the_run_exactly():
    def fresh():
        params = [torch.linspace(-1, 1, 12).reshape(3, 4).requires_grad_(True),
                  torch.zeros(4, requires_grad=True)]
        return params, GENIE(params, lr=0.1, generator=torch.Generator().manual_seed(2))

    def feed(opt, params, k):
        for i, prm in enumerate(params):
            prm.grad = torch.cos(torch.arange(prm.numel(), dtype=torch.float32) * (k + i + 1)
                                 ).reshape(prm.shape)
        opt.step()

    whole, opt = fresh()
    for k in range(6):
        feed(opt, whole, k)
    part, opt = fresh()
    for k in range(3):
        feed(opt, part, k)
    saved, rng = opt.state_dict(), opt.generator.get_state()
    again, opt2 = fresh()
    with torch.no_grad():
        for dst, src in zip(again, part, strict=True):
            dst.copy_(src)
    opt2.load_state_dict(saved)
    opt2.generator.set_state(rng)
    for k in range(3, 6):
        feed(opt2, again, k)
    for a, b in zip(whole, again, strict=True):
        assert torch.equal(a, b)
    # and state set from outside (how pflalign-genie restores a client's m, s and step count)
    again, opt3 = fresh()
    with torch.no_grad():
        for dst, src in zip(again, part, strict=True):
            dst.copy_(src)
    for prm, state in zip(again, saved["state"].values(), strict=True):
        opt3.state[prm].update(step=state["step"], m=state["m"].clone(), s=state["s"].clone())
    opt3.generator.set_state(rng)
    for k in range(3, 6):
        feed(opt3, again, k)
    for a, b in zip(whole, again, strict=True):
        assert torch.equal(a, b)


def test_mixed_dtypes_in_one_group():
    params = [torch.zeros(3, requires_grad=True),
              torch.zeros(3, dtype=torch.float64, requires_grad=True)]
    for prm in params:
        prm.grad = torch.ones(3, dtype=prm.dtype)
    with pytest.raises(ValueError, match="one dtype and device"):
        GENIE(params, foreach=True).step()
    opt = GENIE(params, lr=0.1, mask=False)  # foreach=None: the reference path
    opt.step()
    assert all(torch.allclose(prm.detach(), torch.full((3,), -0.1, dtype=prm.dtype))
               for prm in params)


def test_a_non_finite_gradient_stays_in_its_tensor_on_both_paths():
    grads = [[torch.tensor([1.0, float("nan") if k == 1 else 2.0, 0.5, -1.0]),
              torch.tensor([0.1, -0.2, 0.3]) * (k + 1)] for k in range(3)]
    (a0, a1), (b0, b1) = _both_paths([torch.zeros(4), torch.zeros(3)], grads, seed=0, lr=0.1)
    assert not bool(torch.isfinite(a0).all()) and not bool(torch.isfinite(b0).all())
    assert bool(torch.isfinite(a1).all())
    torch.testing.assert_close(a1, b1, rtol=1e-6, atol=1e-7)


def test_buckets_keep_their_buffers_and_empty_tensors_are_skipped():
    # p1 misses its gradient at step 1, so from then on the group has two step counts (two
    # buckets); each keeps its flat buffers instead of rebuilding them every step
    params = [torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True),
              torch.zeros(0, requires_grad=True)]
    opt = GENIE(params, lr=0.1, generator=torch.Generator().manual_seed(0))
    ref = GENIE([t.detach().clone().requires_grad_(True) for t in params], lr=0.1, foreach=False,
                generator=torch.Generator().manual_seed(0))
    seen = []
    for k in range(5):
        for o in (opt, ref):
            ps = o.param_groups[0]["params"]
            ps[0].grad = torch.tensor([1.0, -2.0, 3.0]) * (k + 1)
            ps[1].grad = None if k == 0 else torch.tensor([0.5, 4.0]) * (-1) ** k
            ps[2].grad = torch.zeros(0)
            o.step()
        seen.append({key: id(flat) for key, flat in opt._flats.items()})
    assert len(seen[-1]) == 2 and seen[2] == seen[3] == seen[4]
    for a, b in zip(opt.param_groups[0]["params"], ref.param_groups[0]["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_copied_optimizer_continues_like_the_original():
    import copy
    import pickle

    p = torch.linspace(-1, 1, 6).requires_grad_(True)
    opt = GENIE([p], lr=0.1, generator=torch.Generator().manual_seed(4))
    for k in range(2):
        p.grad = torch.sin(torch.arange(6.0) * (k + 1))
        opt.step()
    twins = [copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))]  # params copied with them
    for o in [opt, *twins]:
        q = o.param_groups[0]["params"][0]
        q.grad = torch.cos(torch.arange(6.0))
        o.step()
    for twin in twins:
        assert torch.equal(twin.param_groups[0]["params"][0], p)
