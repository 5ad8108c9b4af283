"""PFLAlign against values computed by hand (docs/algorithms.md 1.4) and its invariants."""

import math
from statistics import NormalDist

import pytest
import torch

from pflalign.training.optim import PFLAlign

BETA, EPS = 0.9, 1e-12


def _reference_step(theta, m, v, p, g, delta, lr, T, beta=BETA, eps=EPS):
    """One step of docs/algorithms.md 1.4, coordinate by coordinate, in plain Python floats."""
    out = []
    for j in range(len(theta)):
        mj = beta * m[j] + (1 - beta) * g[j]
        vj = beta * v[j] + (1 - beta) * g[j] ** 2
        alpha = 1 - (1 - beta) * g[j] ** 2 / (vj + eps)
        pj = alpha * p[j] + (1 - beta) * mj ** 2 / (vj + eps)
        sigma2 = max(vj - mj ** 2, 0.0)
        z = abs(mj) / math.sqrt(2 * sigma2 + eps)
        sign = math.copysign(1.0, mj * delta[j]) if mj * delta[j] != 0 else 0.0
        gamma = 0.5 + 0.5 * math.erf(z) * sign
        out.append((theta[j] - lr * pj * g[j] - gamma * delta[j] / T, mj, vj, pj, sigma2, gamma))
    return out


def _run(theta0, grads, delta, lr, T, foreach, **kwargs):
    """Apply PFLAlign to one parameter with a given gradient sequence."""
    p = torch.nn.Parameter(torch.tensor(theta0, dtype=torch.float64))
    opt = PFLAlign([p], lr=lr, foreach=foreach, **kwargs)
    opt.begin_round([torch.tensor(delta, dtype=torch.float64)] if delta else None, T)
    for g in grads:
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    return p, opt


@pytest.mark.parametrize("foreach", [False, True])
def test_two_steps_match_hand_computed_values(foreach):
    theta = [1.0, -2.0, 0.5]
    delta = [0.5, 0.5, -0.25]
    grads = [[0.2, -0.4, 0.1], [0.1, -0.2, -0.3]]
    lr, T = 0.1, 4
    m = v = pr = [0.0, 0.0, 0.0]
    for g in grads:
        rows = _reference_step(theta, m, v, pr, g, delta, lr, T)
        theta = [r[0] for r in rows]
        m, v, pr = [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows]
    p, opt = _run([1.0, -2.0, 0.5], grads, delta, lr, T, foreach)
    state = opt.state[p]
    torch.testing.assert_close(p.detach(), torch.tensor(theta, dtype=torch.float64))
    torch.testing.assert_close(state["m"], torch.tensor(m, dtype=torch.float64))
    torch.testing.assert_close(state["v"], torch.tensor(v, dtype=torch.float64))
    torch.testing.assert_close(state["P"], torch.tensor(pr, dtype=torch.float64))


def test_first_step_numbers_written_out():
    # g = 0.2, Delta = 0.5, lr = 0.1, T = 4, beta = 0.9, from zero state:
    # m = 0.02, v = 0.004, alpha = 1 - 0.1 * 0.04 / 0.004 = 0, P = 0.1 * 0.0004 / 0.004 = 0.01
    # sigma^2 = 0.004 - 0.0004 = 0.0036, z = 0.02 / sqrt(0.0072), gamma = 1/2 + erf(z)/2
    # theta = 1 - 0.1 * 0.01 * 0.2 - gamma * 0.5 / 4
    p, opt = _run([1.0], [[0.2]], [0.5], 0.1, 4, foreach=False)
    s = opt.state[p]
    assert float(s["m"]) == pytest.approx(0.02)
    assert float(s["v"]) == pytest.approx(0.004)
    assert float(s["P"]) == pytest.approx(0.01)  # (1 - beta)^2, as 1.4 says
    gamma = 0.5 + 0.5 * math.erf(0.02 / math.sqrt(0.0072))
    # (eps = 1e-12 in the denominators moves the result by ~1e-12)
    assert float(p.detach()) == pytest.approx(1 - 0.1 * 0.01 * 0.2 - gamma * 0.5 / 4, abs=1e-10)
    assert opt.mean_gamma() == pytest.approx(gamma)


def test_preconditioner_equals_ratio_of_emas_over_many_steps_and_rounds():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(50, dtype=torch.float64))
    opt = PFLAlign([p], lr=1e-3)
    q = torch.zeros(50, dtype=torch.float64)  # EMA of m^2
    e = torch.zeros(50, dtype=torch.float64)  # EMA of g^2
    for _round in range(3):
        opt.begin_round(None, 40)
        m = torch.zeros(50, dtype=torch.float64)
        for _ in range(40):
            g = torch.randn(50, dtype=torch.float64) * 0.1 + 0.05
            p.grad = g
            opt.step()
            m = BETA * m + (1 - BETA) * g
            q = BETA * q + (1 - BETA) * m * m
            e = BETA * e + (1 - BETA) * g * g
    torch.testing.assert_close(opt.state[p]["P"], q / e, rtol=1e-9, atol=1e-12)
    assert 0 < float(opt.state[p]["P"].max()) < 1


def test_gamma_is_the_gaussian_sign_agreement_probability():
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.zeros(200, dtype=torch.float64))
    delta = torch.randn(200, dtype=torch.float64)
    opt = PFLAlign([p], lr=1e-3, foreach=False)
    opt.begin_round([delta], 1000)
    for _ in range(30):
        p.grad = torch.randn(200, dtype=torch.float64) * 0.3 + torch.linspace(-0.5, 0.5, 200,
                                                                              dtype=torch.float64)
        before = p.detach().clone()
        opt.step()
    s = opt.state[p]
    m, v = s["m"], s["v"]
    sigma = torch.sqrt(torch.clamp_min(v - m * m, 0))
    # Recover gamma from the last update: theta_new = theta - lr P g - gamma Delta / T
    precond_step = 1e-3 * s["P"] * p.grad
    gamma = (before - p.detach() - precond_step) * 1000 / delta
    for j in range(0, 200, 13):
        g_dist = NormalDist(float(m[j]), float(sigma[j]))
        pr_positive = 1 - g_dist.cdf(0.0)
        expected = pr_positive if delta[j] > 0 else 1 - pr_positive
        assert float(gamma[j]) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("mode,expected", [("zero", 0.0), ("half", 0.5), ("one", 1.0)])
def test_constant_gamma_ablations(mode, expected):
    p, opt = _run([1.0, 2.0], [[0.3, -0.1]], [0.4, -0.8], 0.1, 2, foreach=True, gamma=mode)
    correction = torch.tensor([expected * 0.4 / 2, expected * -0.8 / 2], dtype=torch.float64)
    plain = torch.tensor([1.0, 2.0], dtype=torch.float64) - 0.1 * opt.state[p]["P"] * torch.tensor(
        [0.3, -0.1], dtype=torch.float64)
    torch.testing.assert_close(p.detach(), plain - correction)
    assert opt.mean_gamma() == pytest.approx(expected)


def test_hard_gamma_is_the_sign_test():
    # m has the sign of g on the first step: agreement on coordinate 0, disagreement on 1.
    p, opt = _run([0.0, 0.0], [[0.3, 0.3]], [1.0, -1.0], 1e-9, 1, foreach=True, gamma="hard")
    torch.testing.assert_close(p.detach(), torch.tensor([-1.0, 0.0], dtype=torch.float64),
                               atol=1e-9, rtol=0)


def test_gamma_one_removes_exactly_the_offset_over_the_round():
    torch.manual_seed(2)
    delta = torch.randn(10, dtype=torch.float64)
    p = torch.nn.Parameter(torch.zeros(10, dtype=torch.float64))
    opt = PFLAlign([p], lr=1e-300, gamma="one")  # gradient step negligible
    opt.begin_round([delta], 7)
    for _ in range(7):
        p.grad = torch.randn(10, dtype=torch.float64)
        opt.step()
    torch.testing.assert_close(p.detach(), -delta)


def test_without_preconditioner_and_offset_it_is_exactly_sgd():
    torch.manual_seed(3)
    model_a = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model_b = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model_b.load_state_dict(model_a.state_dict())
    sgd = torch.optim.SGD(model_a.parameters(), lr=0.3)
    ours = PFLAlign(model_b.parameters(), lr=0.3, precondition=False)
    ours.begin_round(None, 10)
    for _ in range(10):
        x, y = torch.randn(8, 5), torch.randint(0, 2, (8,))
        for model, opt in ((model_a, sgd), (model_b, ours)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(a, b)


def test_foreach_and_single_tensor_paths_agree():
    torch.manual_seed(4)
    shapes = [(3, 4), (4,), (2, 2, 3)]
    results = []
    for foreach in (False, True):
        torch.manual_seed(5)
        params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        opt = PFLAlign(params, lr=0.5, foreach=foreach)
        opt.begin_round([torch.randn(s) * 0.1 for s in shapes[:2]] + [None], 6)
        for _ in range(6):
            for p in params:
                p.grad = torch.randn(p.shape)
            opt.step()
        results.append(([p.detach().clone() for p in params], opt.mean_gamma()))
    for a, b in zip(results[0][0], results[1][0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert results[0][1] == pytest.approx(results[1][1], rel=1e-6)


def test_m_resets_each_round_while_v_and_p_persist():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = PFLAlign([p], lr=0.1)
    opt.begin_round(None, 2)
    for _ in range(2):
        p.grad = torch.ones(3)
        opt.step()
    v, pr = opt.state[p]["v"].clone(), opt.state[p]["P"].clone()
    opt.begin_round(None, 2)
    assert torch.count_nonzero(opt.state[p]["m"]) == 0
    assert torch.equal(opt.state[p]["v"], v) and torch.equal(opt.state[p]["P"], pr)


def test_state_dict_round_trip_continues_identically():
    torch.manual_seed(6)
    grads = [torch.randn(4) for _ in range(6)]
    delta = torch.randn(4) * 0.1

    def fresh():
        p = torch.nn.Parameter(torch.arange(4.0))
        return p, PFLAlign([p], lr=0.7)

    p1, o1 = fresh()
    o1.begin_round([delta], 6)
    for g in grads:
        p1.grad = g
        o1.step()
    p2, o2 = fresh()
    o2.begin_round([delta], 6)
    for g in grads[:3]:
        p2.grad = g
        o2.step()
    p3, o3 = fresh()
    p3.data.copy_(p2.data)
    o3.load_state_dict(o2.state_dict())
    for g in grads[3:]:
        p3.grad = g
        o3.step()
    assert torch.equal(p1, p3)


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=0.0), "learning rate"), (dict(lr=1.0, beta=1.0), "beta"),
    (dict(lr=1.0, eps=0.0), "eps"), (dict(lr=1.0, gamma="soft"), "gamma"),
])
def test_invalid_arguments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PFLAlign([torch.nn.Parameter(torch.zeros(1))], **kwargs)


def test_begin_round_checks_offsets():
    opt = PFLAlign([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    with pytest.raises(ValueError, match="one tensor"):
        opt.begin_round([torch.zeros(2), torch.zeros(2)], 3)
    with pytest.raises(ValueError, match="shape"):
        opt.begin_round([torch.zeros(3)], 3)
    with pytest.raises(ValueError, match="num_steps"):
        opt.begin_round(None, 0)
