"""dp = distributed: the distributed discrete Gaussian (Kairouz, Liu and Steinke, ICML 2021),
its pieces against hand-computed values and library references, and in a run under SecAgg+."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import needs_fashion_mnist

from pflalign.server import distributed_dp as dd
from pflalign.training import ddgauss


# --- the mechanism's arithmetic --------------------------------------------------------------
def test_hadamard_is_scipys_orthonormal_matrix_and_its_own_inverse():
    from scipy.linalg import hadamard

    assert np.allclose(ddgauss.hadamard(np.array([1.0, 0, 0, 0])), [0.5, 0.5, 0.5, 0.5])
    v = np.random.default_rng(0).normal(size=64)
    assert np.allclose(ddgauss.hadamard(v), hadamard(64) @ v / 8, atol=1e-12)
    assert np.allclose(ddgauss.hadamard(ddgauss.hadamard(v)), v, atol=1e-12)
    with pytest.raises(ValueError, match="power-of-two"):
        ddgauss.hadamard(np.ones(6))


def test_rotation_pads_to_a_power_of_two_and_comes_back():
    assert [ddgauss.padded_size(d) for d in (1, 2, 3, 1000, 1024, 1025)] == [
        1, 2, 4, 1024, 1024, 2048]
    rng = np.random.default_rng(1)
    v = rng.normal(size=1000)
    signs = ddgauss.rotation_signs(1024, rng)
    assert set(np.unique(signs)) == {-1.0, 1.0}
    rotated = ddgauss.rotate(v, signs)
    assert rotated.size == 1024 and math.isclose(np.linalg.norm(rotated), np.linalg.norm(v))
    assert np.allclose(ddgauss.unrotate(rotated, signs, 1000), v, atol=1e-12)


@pytest.mark.parametrize("sigma", [0.5, 2.0, 7.3])
def test_discrete_gaussian_has_the_pmfs_variance(sigma):
    """Mean and variance of 400,000 draws against the distribution's own, summed from
    ``P(y) ~ exp(-y^2 / (2 sigma^2))`` over the integers (within 1.5% / 4 standard errors)."""
    support = np.arange(-200, 201)
    weights = np.exp(-support ** 2 / (2 * sigma ** 2))
    variance = float((weights * support ** 2).sum() / weights.sum())
    draws = ddgauss.discrete_gaussian(400_000, sigma, np.random.default_rng(2))
    assert draws.dtype == np.int64
    assert abs(draws.mean()) < 4 * math.sqrt(variance / draws.size)
    assert abs(draws.var() / variance - 1) < 0.015
    assert not ddgauss.discrete_gaussian(5, 0.0, np.random.default_rng(0)).any()


@pytest.mark.parametrize("sigma", [0.5, 2.0])
def test_discrete_gaussian_has_the_pmfs_shape(sigma):
    """A chi-square test of 100,000 draws against the pmf over the values with at least 20
    expected draws (the tails pooled); the proposal without its rejection step (a discrete
    Laplace of scale floor(sigma) + 1) fails it at these sizes."""
    from scipy.stats import chisquare

    support = np.arange(-60, 61)
    pmf = np.exp(-support ** 2 / (2 * sigma ** 2))
    pmf /= pmf.sum()
    draws = ddgauss.discrete_gaussian(100_000, sigma, np.random.default_rng(8))
    kept = pmf * draws.size >= 20
    observed = np.array([np.sum(draws == v) for v in support[kept]] + [
        np.sum(~np.isin(draws, support[kept]))])
    expected = np.append(pmf[kept], 1 - pmf[kept].sum()) * draws.size
    assert chisquare(observed, expected).pvalue > 1e-3
    t = math.floor(sigma) + 1
    laplace = np.floor(t * np.random.default_rng(8).standard_exponential((2, draws.size)))
    wrong = (laplace[0] - laplace[1]).astype(int)
    observed = np.array([np.sum(wrong == v) for v in support[kept]] + [
        np.sum(~np.isin(wrong, support[kept]))])
    assert chisquare(observed, expected).pvalue < 1e-6


def test_conditional_rounding_is_unbiased_and_within_its_bound():
    rng = np.random.default_rng(3)
    v = np.array([0.25, -1.5, 2.75, 0.0])
    draws = np.array([ddgauss.conditional_round(v, 10.0, rng) for _ in range(20_000)])
    assert set(np.unique(draws[:, 0])) == {0, 1} and np.all(draws[:, 3] == 0)
    assert np.allclose(draws.mean(axis=0), v, atol=0.02)
    # conditioned on a bound below some roundings' norms: only those within it come back
    bound = math.sqrt(0 + 1.5 ** 2 + 9 + 0) - 0.1  # leaves out (1, -2, 3, 0) and (0, -2, 3, 0)
    kept = np.array([ddgauss.conditional_round(v, bound, rng) for _ in range(2000)])
    assert np.all(np.linalg.norm(kept, axis=1) <= bound)
    with pytest.raises(ValueError, match="was not clipped"):
        ddgauss.conditional_round(v, 1.0, rng)


def test_signed_maps_the_modular_sum_to_the_integers_around_zero():
    m = ddgauss.MODULUS
    total = np.array([0, 1, m - 1, m // 2, m // 2 - 1, m + 5], dtype=np.uint64)
    assert ddgauss.signed(total).tolist() == [0, 1, -1, -(m // 2), m // 2 - 1, 5]


def test_encodings_sum_to_the_clipped_updates_plus_the_clients_noise():
    """Five clients' encodings summed modulo 2^32 decode to the sum of their clipped updates:
    without noise within the rounding's error (each rounding moves its rotated vector by at most
    sqrt(d') steps of gamma, and the rotation keeps norms); with noise, the difference has
    each coordinate's variance n sigma^2 gamma^2 (within 3%)."""
    rng = np.random.default_rng(4)
    dim, clip, n = 3000, 1.0, 5
    updates = [rng.normal(size=dim) * s for s in (0.01, 0.02, 0.1, 1.0, 3.0)]
    clipped = sum(u * min(1.0, clip / np.linalg.norm(u)) for u in updates)
    for multiplier in (0.0, 2.0):
        m = dd.Mechanism.build(clip, multiplier, n, dim)
        signs = ddgauss.rotation_signs(m.padded, np.random.default_rng(5))
        total = np.zeros(m.padded, dtype=np.uint64)
        for i, u in enumerate(updates):
            total = (total + ddgauss.encode(u, clip, m.gamma, signs, m.l2, m.sigma,
                                            np.random.default_rng([6, i]),
                                            np.random.default_rng([7, i]))) % ddgauss.MODULUS
        error = ddgauss.decode(total, m.gamma, signs, dim) - clipped
        if multiplier == 0:
            assert 0 < np.linalg.norm(error) <= n * m.gamma * math.sqrt(m.padded)
        else:
            assert abs(error.var() / (n * (m.sigma * m.gamma) ** 2) - 1) < 0.03
            # the sum carries central DP's noise: z c in real units
            assert math.isclose(math.sqrt(n) * m.sigma * m.gamma, multiplier * clip)


def test_the_grid_holds_the_sums_stddevs_within_the_modulus():
    """gamma solves k^2 (n^2 c^2 / d' + n sigma_r^2) / gamma^2 + k^2 n / 4 = m^2/4, with k =
    sqrt(2 ln(2 d' / 1e-3))."""
    m = dd.Mechanism.build(0.5, 1.3, 100, 582_026)
    n, d, c, sr = 100, 1 << 20, 0.5, 1.3 * 0.5 / 10
    k2 = 2 * math.log(2 * d / 1e-3)
    assert math.isclose(dd.stddevs(d) ** 2, k2)
    lhs = k2 * (n ** 2 * c ** 2 / d + n * sr ** 2) / m.gamma ** 2 + k2 * n / 4
    assert m.padded == d and math.isclose(lhs, ddgauss.MODULUS ** 2 / 4, rel_tol=1e-9)
    assert math.isclose(m.sigma * m.gamma, sr)


def test_aligned_updates_at_the_clip_sum_without_wrapping_around():
    """The worst case of the grid's heuristic: n clients sending the same update, at the clip,
    without noise. Their sum's largest rotated coordinate is about 3.6 of the k = 5.9 standard
    deviations the modulus holds, so nothing wraps: the decoded sum is n times the update to
    within the rounding's error (a wrap would move a coordinate by m gamma, 2^32 steps)."""
    dim, clip, n = 3000, 1.0, 40
    m = dd.Mechanism.build(clip, 0.0, n, dim)
    update = np.random.default_rng(9).normal(size=dim)
    update *= clip / np.linalg.norm(update)
    signs = ddgauss.rotation_signs(m.padded, np.random.default_rng(10))
    total = np.zeros(m.padded, dtype=np.uint64)
    for i in range(n):
        total = (total + ddgauss.encode(update, clip, m.gamma, signs, m.l2, 0.0,
                                        np.random.default_rng([11, i]),
                                        np.random.default_rng(0))) % ddgauss.MODULUS
    peak = np.abs(ddgauss.signed(total)).max()
    assert 0.25 * ddgauss.MODULUS < peak < 0.5 * ddgauss.MODULUS  # large, yet within
    error = ddgauss.decode(total, m.gamma, signs, dim) - n * update
    assert np.linalg.norm(error) <= n * m.gamma * math.sqrt(m.padded)


# --- the accounting ----------------------------------------------------------------------------
def test_sensitivities_by_hand():
    """Theorem 1 at c/gamma = 3, d = 4, beta = exp(-1/2): min(3 + 2, sqrt(9 + 1 + 1 * (3 + 1)))
    = sqrt(14); at beta = 0 the first bound, 5; and Delta_1 = Delta_2 min(sqrt(d), Delta_2)."""
    assert math.isclose(dd.rounded_l2_bound(3.0, 4), math.sqrt(14))
    assert dd.rounded_l2_bound(3.0, 4, beta=0.0) == 5.0
    assert math.isclose(dd.rounded_l1_bound(math.sqrt(14), 4), 2 * math.sqrt(14))
    assert dd.rounded_l1_bound(1.5, 100) == 2.25


def test_tau_and_one_rounds_rdp_by_hand():
    assert dd.tau(1.0, 1) == 0.0
    assert math.isclose(dd.tau(1.0, 2), 10 * math.exp(-math.pi ** 2))
    assert math.isclose(dd.tau(0.5, 3), 10 * (math.exp(-math.pi ** 2 / 4)
                                             + math.exp(-math.pi ** 2 / 3)))
    # order 2, l1 = 3, l2 = 1, tau = 0.01, d = 100: min(1 + 1, 1 + 0.06 + 0.01, (1 + 0.1)^2)
    assert math.isclose(float(dd.round_rdp(np.array([2.0]), 3.0, 1.0, 0.01, 100)[0]), 1.07)
    # order 4: min(2 + 1, 2 (1 + 0.06 + 0.01), 2 (1.1)^2) = 2.14
    assert math.isclose(float(dd.round_rdp(np.array([4.0]), 3.0, 1.0, 0.01, 100)[0]), 2.14)


def test_poisson_subsampling_by_hand_and_against_the_exact_gaussian():
    """Zhu and Wang's bound at order 2 is log((1 - q)(1 + q) + q^2 e^{eps(2)}); at rate 1 the
    mechanism's own; for the Gaussian mechanism it is never below the exact sampled Gaussian's
    (Mironov et al., as Opacus computes it) and never above the unsampled one's."""
    from opacus.accountants.analysis.rdp import compute_rdp

    def gaussian(orders, z=1.2):
        return np.asarray(orders, dtype=np.float64) / (2 * z ** 2)

    q = 0.1
    expected = math.log((1 - q) * (1 + q) + q ** 2 * math.exp(2 / (2 * 1.2 ** 2)))
    assert math.isclose(dd.poisson_subsampled(2, q, gaussian), expected)
    # order 3: log((1-q)^2 (3q - q + 1) + 3 q^2 (1-q) e^{eps(2)} + 3 q^3 e^{2 eps(3)}) / 2
    e2, e3 = 2 / (2 * 1.2 ** 2), 3 / (2 * 1.2 ** 2)
    third = math.log((1 - q) ** 2 * (2 * q + 1) + 3 * q ** 2 * (1 - q) * math.exp(e2)
                     + 3 * q ** 3 * math.exp(2 * e3)) / 2
    assert math.isclose(dd.poisson_subsampled(3, q, gaussian), third)
    assert math.isclose(third, 0.0244730, rel_tol=1e-5)
    assert dd.poisson_subsampled(7, 1.0, gaussian) == 7 / (2 * 1.2 ** 2)
    orders = [2, 3, 5, 8, 16, 32, 64]
    exact = compute_rdp(q=q, noise_multiplier=1.2, steps=1, orders=orders)
    ours = [dd.poisson_subsampled(a, q, gaussian) for a in orders]
    assert all(e <= o + 1e-12 <= g + 1e-12 for e, o, g in zip(exact, ours, gaussian(orders),
                                                                strict=True))


def test_with_large_noise_a_round_is_the_gaussian_mechanism_of_its_rounded_sensitivity():
    """Far from the integers' scale (tau ~ 0) one round at rate 1 is the Gaussian mechanism with
    noise multiplier sqrt(n) sigma / Delta_2: Opacus's RDP at every order, and its epsilon."""
    from opacus.accountants.analysis.rdp import compute_rdp

    m = dd.Mechanism.build(1.0, 1.1, 10, 1000)
    assert dd.tau(m.sigma, 10) == 0.0
    z = math.sqrt(10) * m.sigma / m.l2
    assert np.allclose(m.rdp(10, 1.0), compute_rdp(q=1.0, noise_multiplier=z, steps=1,
                                                   orders=dd.ORDERS.tolist()), rtol=1e-9)
    # the rounding's inflation of the sensitivity is below 1e-5 at 32 bits
    assert 1 < m.l2 * m.gamma / m.clip < 1 + 1e-5
    # fewer clients in the sum (dropouts) hold less noise: the round costs more
    assert (m.rdp(7, 1.0) > m.rdp(10, 1.0)).all()


def test_the_vectorized_conversion_is_opacuss():
    rng = np.random.default_rng(12)
    curves = np.abs(rng.normal(size=(5, dd.ORDERS.size))).cumsum(axis=1) * [[0.01], [0.1], [1],
                                                                             [3], [10]]
    assert np.allclose(dd.epsilons_of_rdp(curves, 1e-5),
                       [dd.epsilon_of_rdp(c, 1e-5) for c in curves], rtol=1e-12)


def test_calibration_finds_the_smallest_noise_within_the_target():
    z = dd.calibrate(3.0, 1e-5, 1.0, 100, 582_026, 0.1, 30)

    def spent(multiplier):
        return dd.Mechanism.build(1.0, multiplier, 100, 582_026).epsilon({100: 30}, 0.1, 1e-5)

    assert 2.99 <= spent(z) <= 3.0 < spent(z * 0.995)
    # below half a grid step of noise a client adds next to nothing: no bound is claimed
    tiny = dd.Mechanism.build(1.0, 1e-12, 10, 1000)
    assert tiny.sigma < 0.5 and tiny.epsilon({10: 1}, 1.0, 1e-5) == math.inf


def test_the_accountants_resume_from_their_state():
    """What a checkpoint keeps (JSON-like: string keys) gives back the same epsilons, and the
    rounds after a resume add to it as without one."""
    import json

    m = dd.Mechanism.build(1.0, 1.0, 10, 1000)
    amplified, server = dd.DistributedAccountant(m, 1e-5, 0.5), dd.ServerAccountant(m, 1e-5)
    for summed in ([0, 1, 2], [1, 2], [2, 3, 4, 5]):
        amplified.step(len(summed))
        server.step(summed)
    state = json.loads(json.dumps({**amplified.state_dict(), **server.state_dict()}))
    again, server_again = dd.DistributedAccountant(m, 1e-5, 0.5), dd.ServerAccountant(m, 1e-5)
    again.load_state_dict(state)
    server_again.load_state_dict(state)
    assert again.epsilon() == amplified.epsilon() and server_again.epsilon() == server.epsilon()
    for accountant, step in ((amplified, 2), (again, 2)):
        accountant.step(step)
    server.step([2, 6])
    server_again.step([2, 6])
    assert again.epsilon() == amplified.epsilon() and server_again.epsilon() == server.epsilon()
    # client 2 was in all four sums, of 3, 2, 4 and 2 clients: the largest epsilon is its own
    assert server.epsilon() == pytest.approx(
        dd.epsilon_of_rdp(m.rdp(3, 1) + 2 * m.rdp(2, 1) + m.rdp(4, 1), 1e-5), rel=1e-12)


# --- in a run ------------------------------------------------------------------------------------
def test_distributed_dp_needs_secure_aggregation_and_a_fixed_clip():
    from pflalign.run.config import build_settings
    from pflalign.settings.options import ConfigError

    with pytest.raises(ConfigError, match="only secure aggregation's sum carries the noise"):
        build_settings({"dp": "distributed"})
    with pytest.raises(ConfigError, match="sees only their noised sum"):
        build_settings({"dp": "distributed", "secure-aggregation": "secagg+",
                        "dp-clipping": "adaptive"})
    with pytest.raises(ConfigError, match="cannot run dp = 'distributed'"):
        build_settings({"dp": "distributed", "secure-aggregation": "secagg+",
                        "methods": "scaffold", "eval-audit-fraction": 0.0})
    with pytest.raises(ConfigError, match="dp = 'distributed' forbids"):
        build_settings({"dp": "distributed", "secure-aggregation": "secagg+"})


@needs_fashion_mnist
def test_without_noise_the_release_is_central_dps_within_the_grid(tmp_path):
    """With no noise, round 1's global model is central DP's (the same clip, the same expected
    clients, no noise) to within the decoding error over the expected clients (at most n sqrt(d')
    grid steps in L2, over n) and the model's float32 rounding; no epsilon is reported."""
    from test_secagg import _run

    dp = {"dp-clip": 0.1, "dp-noise-multiplier": 0.0, "eval-audit-fraction": 0.0}
    central, central_models = _run(tmp_path / "c", **{"dp": "central", **dp})
    spread, spread_models = _run(tmp_path / "d", **{"dp": "distributed",
                                                     "secure-aggregation": "secagg+", **dp})
    m = dd.Mechanism.build(0.1, 0.0, 6, sum(v.size for v in central_models[0].values()))
    a, b = central_models[0], spread_models[0]
    error = max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a)
    assert 0 < error < m.gamma * math.sqrt(m.padded) + 1e-6
    assert all("dp-epsilon" not in r for r in spread["rounds"])


@needs_fashion_mnist
def test_the_clients_noise_reaches_the_sum_and_both_epsilons_are_accounted(tmp_path):
    """Round 1 with noise against the same round without (same seed, so the same training,
    rounding and rotation): the global models differ by the noise alone, whose standard
    deviation per value is z C / n_0 (n_0 = the 6 expected clients, all in the sum) within 2%.
    With a client dropping out after sharing its keys, every row's dp-clients is the clients
    unmasked, dp-epsilon the amplified accountant's (rate 1 here: fixed sampling) over those
    rounds, and dp-epsilon-server that of the client that was in the most sums."""
    from test_secagg import _run

    dp = {"dp": "distributed", "secure-aggregation": "secagg+", "dp-clip": 0.1,
          "eval-audit-fraction": 0.0, "rounds": 1, "eval-every": 1}
    _, quiet = _run(tmp_path / "z0", **dp, **{"dp-noise-multiplier": 0.0})
    _, noisy = _run(tmp_path / "z", **dp, **{"dp-noise-multiplier": 0.3})
    diff = np.concatenate([(noisy[0][k].astype(np.float64) - quiet[0][k]).ravel()
                           for k in quiet[0] if quiet[0][k].dtype.kind == "f"])
    assert abs(diff.std() / (0.3 * 0.1 / 6) - 1) < 0.02
    result, _ = _run(tmp_path / "drop", **{**dp, "rounds": 3, "eval-every": 3,
                                           "dp-noise-multiplier": 0.8,
                                           "client-dropout-rate": 0.3, "secagg-threshold": 2})
    rows = result["rounds"]
    assert [r["dp-clients"] for r in rows] == [r["clients-trained"] for r in rows]
    assert any(r["secagg-dropped"] for r in rows)
    m = dd.Mechanism.build(0.1, 0.8, 6, 582_026)
    history: dict[int, int] = {}
    for row in rows:
        history[row["dp-clients"]] = history.get(row["dp-clients"], 0) + 1
        assert row["dp-epsilon"] == pytest.approx(m.epsilon(history, 1.0, 1e-5), rel=1e-12)
    # every client was in every sum it could be; the one in the most: all rounds it survived
    assert rows[-1]["dp-epsilon-server"] >= rows[-1]["dp-epsilon"]
    assert result["final"]["dp-epsilon-server"] == rows[-1]["dp-epsilon-server"]


@needs_fashion_mnist
@pytest.mark.parametrize("flower", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_every_engine_gives_the_same_metrics_with_epsilon_in_every_row(tmp_path, flower):
    """dp = distributed on the sequential and batched engines (each client's noise drawn on its
    client, its rounding and the rotation from the seed): the same metrics; every row's epsilon
    is the accountant's for that many rounds of the round's clients (all three a round here,
    none dropping). The Flower engine runs the same client handler (SecAgg+'s, which
    test_attacks.py's Flower run covers); its own run of this config is slow-marked below."""
    from harness import three_engines

    values = {"num-clients": 6, "max-samples": 2000, "rounds": 2, "eval-every": 2,
              "fraction-train": 0.5, "local-steps": 2, "seed": 3, "save-models": "none",
              "methods": "fedavg,pflalign", "secure-aggregation": "secagg+",
              "dp": "distributed", "dp-clip": 0.5, "dp-noise-multiplier": 0.02,
              "dp-delta": 1e-3, "eval-audit-fraction": 0.0}
    result = three_engines(values, tmp_path, compared_at_least=60, flower=flower)
    for method in ("fedavg", "pflalign"):
        rows = result["methods"][method]["rounds"]
        assert [r["clients-trained"] for r in rows] == [3, 3] and rows[0]["dp-clip"] == 0.5
        m = dd.Mechanism.build(0.5, 0.02, 3, 582_026)  # the CNN's values
        assert [r["dp-epsilon"] for r in rows] == pytest.approx(
            [m.epsilon({3: k}, 1.0, 1e-3) for k in (1, 2)], rel=1e-12)
