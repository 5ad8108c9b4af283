"""pflalign.server.privacy: clipping, the Gaussian release, adaptive clipping, Poisson sampling
and the accountant, against values computed by hand and published figures."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import needs_fashion_mnist
from harness import three_engines

from pflalign.server import privacy
from pflalign.server.aggregation import FlatSpec
from pflalign.settings.options import ConfigError
from pflalign.training import privacy as local_dp
from pflalign.wire.protocol import MODEL


def test_clip_scales_to_the_bound_and_leaves_short_vectors_alone():
    clipped, norm = privacy.clip(np.array([3.0, 4.0]), 2.5)
    assert norm == 5.0
    np.testing.assert_array_equal(clipped, [1.5, 2.0])
    assert np.linalg.norm(clipped) == pytest.approx(2.5, abs=1e-15)
    short = np.array([0.3, -0.4], dtype=np.float32)
    same, norm = privacy.clip(short, 0.6)
    assert norm == pytest.approx(0.5) and same.dtype == np.float64
    np.testing.assert_array_equal(same, short.astype(np.float64))
    zero, norm = privacy.clip(np.zeros(3), 1.0)
    assert norm == 0.0 and not zero.any()
    with pytest.raises(ValueError, match="positive"):
        privacy.clip(np.ones(2), 0.0)


def test_without_noise_and_a_clip_nobody_reaches_the_release_is_the_uniform_mean():
    """z = 0 and a bound above every norm: (sum of the deltas) / m, the uniform average when m
    is the number of updates (docs/privacy.md: DP's weights are uniform, its denominator fixed)."""
    rng = np.random.default_rng(0)
    deltas = [rng.normal(size=7) for _ in range(4)]
    mean, norms = privacy.noised_mean(deltas, bound=100.0, std=0.0, denominator=4,
                                      rng=privacy.noise_rng(0, 1))
    np.testing.assert_allclose(mean, np.mean(deltas, axis=0), rtol=0, atol=1e-15)
    np.testing.assert_allclose(norms, [np.linalg.norm(d) for d in deltas])
    # a fixed denominator above the count that replied shrinks the step, as DP-FedAvg's does
    smaller, _ = privacy.noised_mean(deltas[:2], 100.0, 0.0, 4, privacy.noise_rng(0, 1))
    np.testing.assert_allclose(smaller, (deltas[0] + deltas[1]) / 4, atol=1e-15)
    # one clipped delta: its share is the clipped vector
    big = [np.array([6.0, 8.0]), np.array([0.1, 0.0])]
    mean, _ = privacy.noised_mean(big, 1.0, 0.0, 2, privacy.noise_rng(0, 1))
    np.testing.assert_allclose(mean, [(0.6 + 0.1) / 2, 0.8 / 2], atol=1e-15)


def test_the_noise_has_the_stated_standard_deviation():
    """200,000 draws at std 2.5 on a zero sum: the sample mean within 5 standard errors of 0 and
    the sample standard deviation within 5 of its standard errors (std / sqrt(2 n)) of 2.5."""
    n, std = 200_000, 2.5
    mean, _ = privacy.noised_mean([np.zeros(n)], bound=1.0, std=std, denominator=1.0,
                                  rng=privacy.noise_rng(3, 7))
    assert abs(mean.mean()) < 5 * std / math.sqrt(n)
    assert abs(mean.std() - std) < 5 * std / math.sqrt(2 * n)
    again, _ = privacy.noised_mean([np.zeros(n)], 1.0, std, 1.0, privacy.noise_rng(3, 7))
    np.testing.assert_array_equal(mean, again)  # keyed by (seed, round): a resume redraws it
    other, _ = privacy.noised_mean([np.zeros(n)], 1.0, std, 1.0, privacy.noise_rng(3, 8))
    assert not np.array_equal(mean, other)


def test_adaptive_clip_moves_geometrically_towards_the_quantile():
    # norms 0.5, 2.0, 0.8 at C = 1: two within, b = (0.5 - 0.5 + 0.5) / 3 + 0.5 = 2/3
    new = privacy.adapt_clip(1.0, [0.5, 2.0, 0.8], quantile=0.5, lr=0.2, count_std=0.0,
                             denominator=3, rng=privacy.noise_rng(0, 1))
    assert new == pytest.approx(math.exp(-0.2 * (2 / 3 - 0.5)), rel=1e-15)
    # every norm above: b = 0, the bound grows by exp(lr * quantile)
    grown = privacy.adapt_clip(2.0, [5.0, 6.0], 0.5, 0.2, 0.0, 2, privacy.noise_rng(0, 1))
    assert grown == pytest.approx(2.0 * math.exp(0.1), rel=1e-15)


def test_the_updates_noise_multiplier_leaves_the_count_its_share():
    assert privacy.update_noise_multiplier(1.0, 5.0) == pytest.approx((1 - 1 / 100) ** -0.5)
    assert privacy.update_noise_multiplier(1.3, 0.0) == 1.3
    assert privacy.update_noise_multiplier(0.0, 5.0) == 0.0
    with pytest.raises(ValueError, match="must exceed"):
        privacy.update_noise_multiplier(1.0, 0.5)


def test_poisson_sampling_is_reproducible_and_has_the_expected_size():
    pool = list(range(200))
    assert privacy.poisson_sample(pool, 0.1, 0, 3) == privacy.poisson_sample(pool[::-1], 0.1, 0, 3)
    assert privacy.poisson_sample(pool, 0.0, 0, 3) == []
    assert privacy.poisson_sample(pool, 1.0, 0, 3) == pool
    sizes = [len(privacy.poisson_sample(pool, 0.1, 0, r)) for r in range(1, 401)]
    # 400 rounds of Binomial(200, 0.1): mean 20, standard error sqrt(18 / 400)
    assert abs(np.mean(sizes) - 20) < 5 * math.sqrt(18 / 400)
    assert len(set(sizes)) > 5


def test_the_accountant_reproduces_the_published_dp_sgd_mnist_figures():
    """TensorFlow Privacy's MNIST DP-SGD tutorial (tutorials/README.md, "Select Parameters"):
    60,000 examples, batches of 256 (q = 256 / 60000), delta = 1e-5, by the RDP accountant with
    the classic conversion eps = min_a RDP(a) + log(1 / delta) / (a - 1) (Mironov 2017): noise
    1.12 for 60 epochs, 2.92; 0.6 for 30 epochs, 9.74; 1.2 for 10 epochs, 1.20. The run reports
    the tighter conversion of Balle et al. (2020, Theorem 21), below it. (Opacus's RDP gives
    2.922, 9.753 and 1.198: the table's figures to its last digit but the second's.)"""
    from opacus.accountants.analysis.rdp import compute_rdp

    orders = np.array([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
    q = 256 / 60000
    for z, epochs, published in ((1.12, 60, 2.92), (0.6, 30, 9.74), (1.2, 10, 1.20)):
        steps = epochs * 60000 // 256
        rdp = compute_rdp(q=q, noise_multiplier=z, steps=steps, orders=orders)
        classic = float(np.min(rdp + np.log(1 / 1e-5) / (orders - 1)))
        assert classic == pytest.approx(published, abs=0.015)
        accountant = privacy.Accountant(delta=1e-5, sample_rate=q)
        accountant.step(z, steps)
        balle = float(np.min(rdp + np.log((orders - 1) / orders)
                             - (np.log(1e-5) + np.log(orders)) / (orders - 1)))
        assert accountant.epsilon() == pytest.approx(balle, rel=1e-12)
        assert accountant.epsilon() < classic


def test_without_sampling_the_accountant_composes_the_gaussian_mechanism():
    """q = 1 (fixed-size sampling, no amplification): RDP(a) = T a / (2 z^2), converted by
    Balle et al.'s Theorem 21 over the accountant's orders, computed here by hand."""
    z, rounds, delta = 2.0, 50, 1e-5
    accountant = privacy.Accountant(delta=delta, sample_rate=1.0)
    for _ in range(rounds):
        accountant.step(z)
    assert accountant.history == [(z, 1.0, rounds)]
    orders = np.array([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
    by_hand = np.min(rounds * orders / (2 * z * z) + np.log((orders - 1) / orders)
                     - (np.log(delta) + np.log(orders)) / (orders - 1))
    assert accountant.epsilon() == pytest.approx(float(by_hand), rel=1e-12)
    restored = privacy.Accountant(delta=delta, sample_rate=1.0)
    restored.load_state_dict(accountant.state_dict())
    assert restored.epsilon() == accountant.epsilon()
    assert privacy.Accountant(delta, 1.0).epsilon() == 0.0
    silent = privacy.Accountant(delta, 1.0)
    silent.step(0.0)
    assert silent.epsilon() == math.inf


@pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha:UserWarning")
def test_calibration_spends_the_target_within_its_tolerance():
    q, rounds, delta = 0.1, 100, 1e-5
    for target in (1.0, 8.0):
        z = privacy.calibrate(target, delta, q, rounds)
        spent = privacy.epsilon_of([(z, q, rounds)], delta)
        assert target - 0.01 <= spent <= target
        assert privacy.epsilon_of([(z * 0.97, q, rounds)], delta) > spent
    with pytest.raises(ConfigError, match="cannot be reached"):
        privacy.calibrate(1e-9, delta, 1.0, rounds)


# --- dp = central in a run ----------------------------------------------------------------------

def _central(**values: object) -> privacy.CentralPrivacy:
    """A CentralPrivacy over a two-array model (a float32 2x2 weight and a bias of 2)."""
    from pflalign.run.config import build_settings
    from pflalign.server.aggregation import FlatSpec

    run = build_settings({"dp": "central", "methods": "fedavg", **values}).run
    spec = FlatSpec.of({"w": np.zeros((2, 2), np.float32), "b": np.zeros(2, np.float32)})
    return privacy.CentralPrivacy(run, seed=3, spec=spec, expected_clients=4)


def _model(w: list[list[float]], b: list[float]) -> dict[str, np.ndarray]:
    return {"w": np.array(w, np.float32), "b": np.array(b, np.float32)}


def test_the_central_release_clips_each_update_and_divides_by_the_expected_clients():
    """Hand values: base + (sum of the clipped updates) / m with m = 4 expected clients, two of
    whom replied; an update of norm 5 is scaled to the clip 2.5, one of norm 1 is not."""
    central = _central(**{"dp-noise-multiplier": 0.0, "dp-clip": 2.5})
    base = _model([[1, 1], [1, 1]], [0, 0])
    long = _model([[4, 1], [1, 1]], [4, 0])   # update (3, 0, 0, 0 | 4, 0): norm 5
    short = _model([[1, 2], [1, 1]], [0, 0])  # update (0, 1, 0, 0 | 0, 0): norm 1
    release = central.release(base, [long, short], server_round=1)
    # (1.5, 0, 0, 0 | 2, 0) + (0, 1, 0, 0 | 0, 0), over 4
    np.testing.assert_array_equal(release.model["w"], [[1.375, 1.25], [1, 1]])
    np.testing.assert_array_equal(release.model["b"], [0.5, 0])
    assert release.model["w"].dtype == np.float32 and release.entries == {"dp-clip": 2.5}
    # no noise: no guarantee, and no epsilon is reported
    assert central.account() == {} and central.accountant.history == [(0.0, 1.0, 1)]


def test_the_central_release_adds_noise_of_the_stated_scale_keyed_by_seed_and_round():
    central = _central(**{"dp-noise-multiplier": 2.0, "dp-clip": 0.5})
    base = _model([[0, 0], [0, 0]], [0, 0])
    first = central.release(base, [base], server_round=7).model
    again = central.release(base, [base], server_round=7).model
    other = central.release(base, [base], server_round=8).model
    np.testing.assert_array_equal(first["w"], again["w"])
    assert not np.array_equal(first["w"], other["w"])
    rng = privacy.noise_rng(3, 7)  # the same stream by hand: N(0, (z C)^2) / m
    expected = rng.normal(0.0, 2.0 * 0.5, 6) / 4
    np.testing.assert_array_equal(first["w"].reshape(-1), expected[:4].astype(np.float32))
    np.testing.assert_array_equal(first["b"], expected[4:].astype(np.float32))
    # every round is accounted, at the run's delta and (fixed-size sampling) rate 1
    assert central.account()["dp-epsilon"] == pytest.approx(
        privacy.epsilon_of([(2.0, 1.0, 1)], 1e-5), rel=1e-12)
    assert central.account()["dp-epsilon"] == privacy.epsilon_of([(2.0, 1.0, 2)], 1e-5)


def test_the_adaptive_clip_follows_the_noised_fraction_within_it():
    """Without noise the count is exact: norms 5 and 1 against C = 2.5, two of m = 4 expected:
    b = ((0 - 1/2) + (1 - 1/2)) / 4 + 1/2 = 1/2, C' = C exp(-0.2 (1/2 - 0.25))."""
    central = _central(**{"dp-noise-multiplier": 0.0, "dp-clip": 2.5, "dp-clipping": "adaptive",
                          "dp-clip-quantile": 0.25})
    base = _model([[1, 1], [1, 1]], [0, 0])
    central.release(base, [_model([[4, 1], [1, 1]], [4, 0]), _model([[1, 2], [1, 1]], [0, 0])],
                    server_round=1)
    assert central.bound == pytest.approx(2.5 * math.exp(-0.2 * 0.25), rel=1e-15)
    state = central.state_dict()
    fresh = _central(**{"dp-noise-multiplier": 0.0, "dp-clip": 2.5, "dp-clipping": "adaptive",
                        "dp-clip-quantile": 0.25})
    fresh.load_state_dict(state)
    assert fresh.bound == central.bound and fresh.accountant.history == []


def test_the_default_count_noise_leaves_the_updates_most_of_the_budget():
    central = _central(**{"dp-noise-multiplier": 1.5, "dp-clipping": "adaptive"})
    # m / 20 = 0.2 would leave the updates nothing at z = 1.5; the default is z itself
    assert central.count_std == 1.5
    assert central.update_multiplier == pytest.approx(1.5 / math.sqrt(0.75))


@pytest.mark.parametrize(("values", "message"), [
    ({"dp-clip": 2.0}, "dp-clip = 2.0 applies to differential privacy, and dp = 'off'"),
    ({"dp": "central", "methods": "scaffold"}, "scaffold cannot run dp = 'central'"),
    ({"dp": "central", "methods": "fedavg", "aggregation": "median"}, "no sum"),
    ({"dp": "central", "methods": 'pflalign(pflalign-state="server")'},
     "pflalign-state = 'server' cannot run under dp"),
    ({"dp": "central", "methods": "fedavg", "dp-epsilon": 0.001, "rounds": 1000},
     "cannot be reached"),
    ({"dp": "central", "methods": "fedavg", "dp-clip": 0.0}, "must be > 0"),
    ({"dp": "central", "methods": "fedavg", "dp-delta": 1.0}, "must be > 0 and < 1"),
    ({"dp": "central", "methods": "fedavg", "dp-clip-lr": 0.5}, "dp-clipping = 'fixed'"),
    ({"dp": "central", "methods": "fedavg", "dp-clipping": "adaptive", "dp-count-noise": 0.4},
     "must exceed half the noise multiplier"),
    ({"dp": "central", "methods": "fedavg", "dp-epsilon": 3.0, "dp-noise-multiplier": 2.0},
     "give one of them"),
    ({"dp": "central", "methods": "fedavg", "gga": True}, "gga = true sends"),
    ({"sampling": "poisson", "device-profiles": "lognormal", "over-selection": 1.3},
     "sampling = 'poisson'"),
    ({"dp": "central", "methods": "fedavg", "device-profiles": "lognormal",
      "over-selection": 1.3}, "over-selection = 1.3 uses the first replies"),
    ({"dp-secure": True}, "dp-secure = True applies to differential privacy"),
    # an entry's own round size is checked as the run's: here its count noise is too small
    ({"dp": "central", "methods": "fedavg,fedprox(fraction-train=1.0)", "sampling": "poisson",
      "fraction-train": 0.05, "dp-epsilon": 8.0, "dp-clipping": "adaptive",
      "dp-count-noise": 0.6}, "fedprox(fraction-train=1.0): dp-count-noise = 0.6"),
])
def test_a_run_with_dp_that_cannot_hold_is_refused_in_one_sentence(values, message):
    from pflalign.run.config import build_settings

    with pytest.raises(ConfigError, match=re.escape(message)):
        build_settings(values)


#: 6 clients on 1,500 Fashion-MNIST samples, each client in a round with probability 0.3: seed 4
#: draws clients in rounds 1 to 3 and none in round 4. The noise is far too small for any privacy
#: (with 1.8 clients a round, a useful one would wipe out the 582,026-value model): these runs
#: test the mechanics
POISSON_DP = {"num-clients": 6, "max-samples": 1500, "rounds": 4, "eval-every": 2,
              "fraction-train": 0.3, "local-steps": 2, "seed": 4, "methods": "fedavg,pflalign",
              "sampling": "poisson", "dp": "central", "dp-clipping": "adaptive",
              "dp-clip": 0.5, "dp-noise-multiplier": 0.002}


#: dp = local on the same clients, with a server rule that post-processes the noised uploads as
#: it likes (server-held offsets, a median)
LOCAL_DP = {"num-clients": 6, "max-samples": 1500, "rounds": 3, "eval-every": 3,
            "fraction-train": 0.5, "local-steps": 2, "seed": 2, "dp": "local", "dp-clip": 0.5,
            "dp-noise-multiplier": 0.002, "eval-audit-fraction": 0.0,
            "methods": "fedavg,pflalign(pflalign-state=server,aggregation=median)"}


@needs_fashion_mnist
def test_central_dp_runs_identically_on_both_in_process_engines_with_epsilon_in_every_row(
        tmp_path):
    """Poisson sampling, an adaptive clip and noise: the sequential and batched engines give the
    same metrics, and every row reports the epsilon its rounds spent (the accountant at the
    sampling rate 0.3), the empty round included."""
    assert [privacy.poisson_sample(range(6), 0.3, 4, r) for r in range(1, 5)][3] == []
    result = three_engines(POISSON_DP, tmp_path, compared_at_least=60, flower=False)
    z = 0.002
    for label, entry in result["methods"].items():
        rows = entry["rounds"]
        assert [r["dp-epsilon"] for r in rows] == pytest.approx(
            [privacy.epsilon_of([(z, 0.3, n)], 1e-5) for n in range(1, 5)], rel=1e-12), label
        assert rows[3]["clients-trained"] == 0 and all(r["clients-trained"] for r in rows[:3])
        assert rows[0]["dp-clip"] == 0.5 and len({r["dp-clip"] for r in rows}) == 4
        assert entry["final"]["dp-epsilon"] == rows[-1]["dp-epsilon"]
    from pflalign.outputs.results import comparison_table

    assert (f"Differential privacy: fedavg spent epsilon "
            f"{result['methods']['fedavg']['final']['dp-epsilon']:.3g}; pflalign spent epsilon"
            in comparison_table(result["methods"]))


@needs_fashion_mnist
def test_local_dp_runs_identically_on_both_in_process_engines_with_each_clients_epsilon(
        tmp_path):
    """Each client noises its own upload from its own generator, so the engines agree; a row's
    epsilon is that of the client that trained most often so far, each upload a Gaussian
    release at z / 2 (sensitivity: the clip ball's diameter), without amplification."""
    result = three_engines(LOCAL_DP, tmp_path, compared_at_least=40, flower=False)
    for label, entry in result["methods"].items():
        usage = {u["id"]: u["dispatched"] for u in entry["usage"]}
        most = max(usage.values())
        assert entry["rounds"][-1]["dp-epsilon"] == privacy.epsilon_of(
            [(0.001, 1.0, most)], 1e-5), label
        assert all(r["clients-trained"] == 3 for r in entry["rounds"])


def test_a_local_release_clips_the_clients_update_as_one_vector_and_adds_its_noise():
    received = {"w": np.ones((2, 2), np.float32), "b": np.zeros(2, np.float32)}
    upload = {"w": np.array([[4, 1], [1, 1]], np.float32), "b": np.array([4, 0], np.float32),
              "count": np.array(7)}
    out = local_dp.local_release(upload, received, bound=2.5, std=0.0, rng=privacy.noise_rng(0, 1))
    # the update (3, 0, 0, 0 | 4, 0) has norm 5: halved to the clip; an integer counter (which
    # would tell the client's steps) leaves as received, or as zero when it was not sent
    np.testing.assert_array_equal(out["w"], [[2.5, 1], [1, 1]])
    np.testing.assert_array_equal(out["b"], [2, 0])
    assert out["w"].dtype == np.float32 and out["count"] == 0
    sent_count = local_dp.local_release(upload, {**received, "count": np.array(3)}, 2.5, 0.0,
                                       privacy.noise_rng(0, 1))
    assert sent_count["count"] == 3
    noised = local_dp.local_release(upload, received, 2.5, 0.1,
                                   privacy.noise_rng(0, 1, local_dp.LOCAL_NOISE_STREAM, 5))
    noise = privacy.noise_rng(0, 1, local_dp.LOCAL_NOISE_STREAM, 5).normal(0.0, 0.1, 6)
    np.testing.assert_array_equal(noised["b"], (np.array([2.0, 0.0]) + noise[4:]).astype(
        np.float32))


def test_under_dp_secure_the_noise_is_not_the_seeds_and_has_its_scale():
    """dp-secure: a client's noise comes from a key of its own, so the seeded noise taken off
    what it releases leaves noise of twice the variance (two independent draws), not the clipped
    update; without dp-secure, the seeded noise is exactly what was added."""
    import torch

    from pflalign.engines.host import privatized
    from pflalign.run.config import build_settings
    from pflalign.wire.messages import Received, Upload

    size, clip, z = 20_000, 1.0, 0.5
    received = Received(server_round=3, arrays={MODEL: {"w": torch.zeros(size)}})
    upload = Upload(model={"w": torch.full((size,), 0.1)})  # norm 14.1: clipped to 1
    clipped = np.full(size, 0.1) * (clip / np.linalg.norm(np.full(size, 0.1)))
    seeded = local_dp.noise_rng(0, 3, local_dp.LOCAL_NOISE_STREAM, 7).normal(0.0, z * clip, size)
    for secure in (False, True):
        run = build_settings({"dp": "local", "methods": "fedavg", "eval-audit-fraction": 0.0,
                              "dp-clip": clip, "dp-noise-multiplier": z,
                              "dp-secure": secure}).run
        left = privatized(upload, received, run, 7).model["w"].double().numpy() - clipped
        if not secure:
            np.testing.assert_allclose(left, seeded, atol=1e-6)
            continue
        rest = left - seeded  # N(0, 2 z^2 C^2) per value if the noise is another draw
        assert abs(rest.std() / (math.sqrt(2) * z * clip) - 1) < 0.03
        assert abs(np.corrcoef(left, seeded)[0, 1]) < 0.05


def test_under_dp_secure_the_server_samples_and_noises_with_a_key_no_output_holds():
    """Central dp-secure: the Poisson draw and the release's noise are keyed by the runtime's
    secret (not the seed), the same secret for both, a different one in every run, and the
    checkpointed privacy state carries it so that a resumed run keeps it."""
    from pflalign.run.config import build_settings
    from pflalign.server.runtime import ServerRuntime
    from pflalign.wire.messages import ClientInfo

    values = {"dp": "central", "methods": "fedavg", "sampling": "poisson", "num-clients": 50,
              "fraction-train": 0.2, "dp-noise-multiplier": 1.0, "dp-secure": True}
    settings = build_settings(values)
    first, second = (ServerRuntime(settings, "fedavg", {"w": np.zeros(2, np.float32)}, ("w",),
                                   object) for _ in range(2))
    for runtime in (first, second):
        runtime.clients = {c: ClientInfo(c, 1, 1, False) for c in range(50)}
    assert first.private_key not in (second.private_key, settings.run.seed)
    assert first.sample(4) == privacy.poisson_sample(range(50), 0.2, first.private_key, 4)
    spec = FlatSpec.of({"w": np.zeros(2)})
    central = privacy.CentralPrivacy(settings.run, first.private_key, spec, 10.0)
    state = central.state_dict()
    resumed = privacy.CentralPrivacy(settings.run, second.private_key, spec, 10.0)
    resumed.load_state_dict(state)
    assert resumed.seed == first.private_key
    base = {"w": np.zeros(2)}
    assert np.array_equal(central.release(base, [], 2).model["w"],
                          resumed.release(base, [], 2).model["w"])


@pytest.mark.parametrize(("values", "message"), [
    ({"dp": "local", "methods": "fedavg"}, "eval-audit-fraction = 0.2 has clients send"),
    ({"dp": "local", "methods": "fedavg", "eval-audit-fraction": 0.0,
      "dp-clipping": "adaptive"}, "dp-clipping = 'adaptive' has the server count"),
    ({"dp": "local", "methods": "feddyn", "eval-audit-fraction": 0.0},
     "feddyn cannot run dp = 'local'"),
])
def test_local_dp_refuses_what_would_send_a_clients_own_data_in_one_sentence(values, message):
    from pflalign.run.config import build_settings

    with pytest.raises(ConfigError, match=re.escape(message)):
        build_settings(values)


def assert_uploads_clipped_and_noised(uploads: Path, seed: int, clip: float, z: float) -> int:
    """Every training reply recorded in ``uploads`` (``record-uploads``) is, to float32's
    precision, what the server sent plus an update of norm at most ``clip`` plus the client's
    own noise for its round: nothing unclipped or un-noised reached the server. Returns how many
    replies were checked."""
    checked = 0
    for path in sorted(uploads.glob("*/round-*/client-*.npz")):
        server_round = int(path.parent.name.split("-")[1])
        client = int(path.stem.split("-")[1])
        with np.load(path) as record:
            keys = [k.split("/", 2)[2] for k in record.files
                    if k.startswith(f"upload/{MODEL}/")]
            assert keys and all(k.startswith((f"upload/{MODEL}/", f"sent/{MODEL}/"))
                                for k in record.files), record.files
            upload = {k: record[f"upload/{MODEL}/{k}"] for k in keys}
            sent = {k: record[f"sent/{MODEL}/{k}"] for k in keys}
        order = [k for k in upload if upload[k].dtype.kind == "f"]  # the client's packing order
        arrived = np.concatenate([upload[k].reshape(-1).astype(np.float64) for k in order])
        base = np.concatenate([sent[k].reshape(-1).astype(np.float64) for k in order])
        noise = local_dp.noise_rng(seed, server_round, local_dp.LOCAL_NOISE_STREAM, client).normal(
            0.0, z * clip, base.size)
        assert np.linalg.norm(arrived - base) > 10 * clip  # the noise is there...
        update = arrived - base - noise
        assert np.linalg.norm(update) <= clip * (1 + 1e-3), (path, np.linalg.norm(update))
        checked += 1
    return checked


@needs_fashion_mnist
def test_under_local_dp_the_server_receives_only_clipped_noised_updates(tmp_path):
    """What reaches the server (``record-uploads``, read before any check) is the sent model
    plus a clipped update plus the client's own noise: the update within 0.05 once the
    client's noise is taken off, which a trained update (norm far above) never is unclipped."""
    from pflalign.outputs.results import Reporter
    from pflalign.run.config import build_settings
    from pflalign.run.driver import simulate

    values = {**LOCAL_DP, "methods": "fedavg", "rounds": 2, "dp-clip": 0.05,
              "dp-noise-multiplier": 0.5, "record-uploads": True, "engine": "sequential",
              "out-dir": str(tmp_path)}
    simulate(build_settings(values), Reporter(quiet=True))
    assert assert_uploads_clipped_and_noised(tmp_path / "uploads", 2, 0.05, 0.5) == 6


@needs_fashion_mnist
@pytest.mark.slow
@pytest.mark.parametrize("values", [POISSON_DP, LOCAL_DP], ids=["central", "local"])
def test_dp_runs_identically_on_the_flower_engine(values, tmp_path):
    """The same runs on a real Flower simulation (the noise of dp = local drawn in the
    ClientApps on Ray) and on the batched engine's two Ray actors give the in-process engines'
    metrics bit for bit. About 60 s each."""
    from pflalign.run.config import build_settings
    from pflalign.run.driver import simulate
    from scripts.compare_results import compare

    sequential = three_engines(values, tmp_path, compared_at_least=40)
    workers = simulate(build_settings({**values, "engine": "batched", "batched-workers": "2",
                                       "out-dir": str(tmp_path / "w")}))
    differences, compared = compare(sequential, workers)
    assert differences == [] and compared >= 40



def test_a_dp_run_is_warned_of_no_noise_and_of_a_delta_as_large_as_one_over_the_clients():
    from pflalign.run.config import build_settings

    def warnings(**values):
        return privacy.privacy_warnings(build_settings({"methods": "fedavg", **values}).run, 4)

    both = warnings(dp="central", **{"dp-noise-multiplier": 0.0, "dp-delta": 0.25})
    assert len(both) == 2 and "there is no privacy guarantee" in both[0]
    assert "dp-delta = 0.25 is at least 1 / 4 (the training clients)" in both[1]
    assert warnings(dp="central", **{"dp-delta": 0.2}) == []
    assert warnings() == []
