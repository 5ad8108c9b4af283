"""The robust aggregation rules (pflalign/server/robust.py) on planted updates whose answer is
computed by hand, and against Flower's own Krum, Multi-Krum and Bulyan on the same updates."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import needs_fashion_mnist
from flwr.server.strategy.aggregate import aggregate_bulyan, aggregate_krum

from pflalign.server.robust import (
    bulyan,
    centered_clip,
    fltrust,
    krum,
    krum_scores,
    multi_krum,
    squared_distances,
)

# four honest updates around the origin and one attacker far away
PLANTED = [np.array(v, dtype=np.float64) for v in ([0, 0], [1, 0], [0, 1], [1, 1], [10, 10])]


def test_krum_scores_by_hand():
    # n = 5, f = 1: each vector's two nearest (n - f - 2). The honest corners all score 1 + 1;
    # the attacker's nearest are [1, 1] (81 + 81) and [1, 0] (81 + 100).
    scores = krum_scores(np.stack(PLANTED), f=1)
    assert scores.tolist() == [2.0, 2.0, 2.0, 2.0, 162.0 + 181.0]


def test_krum_picks_the_planted_honest_cluster():
    chosen, kept = krum(PLANTED, f=1)
    assert kept.indices == (0,)  # the four honest tie at 2; the lowest index is taken
    assert chosen.tolist() == [0.0, 0.0]
    average, kept = multi_krum(PLANTED, f=1, m=4)
    assert kept.indices == (0, 1, 2, 3)
    assert average.tolist() == [0.5, 0.5]


def test_bulyan_by_hand():
    # 1-D: honest 0..5, one attacker at 100; n = 7, f = 1 (n >= 4f + 3), theta = 5, beta = 3.
    # Krum picks 2 (score 10, tied with 3), then 3 (9), then 1 (10, tied with 4), then 4 (1),
    # then 0 (25, tied with 5): the attacker and 5 are left out. Median of {0, 1, 2, 3, 4} is 2;
    # the beta = 3 values nearest it are 1, 2, 3, whose mean is 2.
    values = [np.array([float(v)]) for v in (0, 1, 2, 3, 4, 5, 100)]
    out, kept = bulyan(values, f=1)
    assert kept.indices == (0, 1, 2, 3, 4)
    assert out.tolist() == [2.0]
    with pytest.raises(ValueError, match="needs at least 11 vectors"):
        bulyan(values, f=2)


def test_centered_clipping_by_hand_and_its_fixed_point():
    # x = (3, 0), (0, 0), (0, 0) from v = 0 with tau = 1: only the first is clipped, to (1, 0),
    # so v = (1/3, 0); the next iteration clips it to norm 1 again: v = 1/3 + (1 - 2/3)/3 = 4/9.
    # The fixed point solves 1 - 2v = 0: v = 1/2.
    xs = [np.array([3.0, 0.0]), np.zeros(2), np.zeros(2)]
    one, kept = centered_clip(xs, np.zeros(2), tau=1.0, iterations=1)
    assert one.tolist() == pytest.approx([1 / 3, 0.0], abs=1e-15) and kept.clipped == 1
    two, _ = centered_clip(xs, np.zeros(2), tau=1.0, iterations=2)
    assert two.tolist() == pytest.approx([4 / 9, 0.0], abs=1e-15)
    fixed, _ = centered_clip(xs, np.zeros(2), tau=1.0, iterations=200)
    assert fixed.tolist() == pytest.approx([0.5, 0.0], abs=1e-12)
    # no vector beyond tau: one iteration is the plain mean
    plain, kept = centered_clip(xs, np.zeros(2), tau=10.0)
    assert plain.tolist() == [1.0, 0.0] and kept.clipped == 0


def test_centered_clipping_median_radius():
    # tau = 0: the radius is the median distance to the centre (here 1, of 0, 1 and 5)
    xs = [np.array([0.0]), np.array([1.0]), np.array([5.0])]
    out, kept = centered_clip(xs, np.zeros(1), tau=0.0)
    assert out.tolist() == [(0 + 1 + 1) / 3] and kept.clipped == 1


def test_fltrust_by_hand():
    # root update (1, 0); clients (2, 0): cos 1; (0, 3): cos 0; (-1, 0): cos -1 -> 0;
    # (1, 1): cos 1/sqrt 2. Rescaled to |g0| = 1: (1, 0) and (1, 1)/sqrt 2.
    ref = np.array([5.0, 5.0])
    clients = [ref + np.array(v) for v in ([2.0, 0.0], [0.0, 3.0], [-1.0, 0.0], [1.0, 1.0])]
    out, kept = fltrust(clients, ref, ref + np.array([1.0, 0.0]))
    s = 1 / math.sqrt(2)
    expected = (np.array([1.0, 0.0]) + s * np.array([s, s])) / (1 + s)
    assert (out - ref).tolist() == pytest.approx(expected.tolist(), abs=1e-15)
    assert kept.indices == (0, 3)
    assert kept.weights == pytest.approx((1.0, 0.0, 0.0, s))
    # no client agrees with the root: no step
    out, kept = fltrust(clients[1:3], ref, ref + np.array([1.0, 0.0]))
    assert out.tolist() == ref.tolist() and kept.indices == ()


def test_distances_are_exact_squared_distances():
    rng = np.random.default_rng(0)
    stacked = rng.normal(size=(6, 50))
    direct = ((stacked[:, None, :] - stacked[None, :, :]) ** 2).sum(-1)
    assert np.allclose(squared_distances(stacked), direct, rtol=1e-12, atol=1e-12)


def _layers(vector: np.ndarray) -> list[np.ndarray]:
    """A flat vector as a two-layer model, as Flower's rules take it."""
    return [vector[:6].reshape(2, 3), vector[6:]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_krum_and_multi_krum_agree_with_flower(seed):
    rng = np.random.default_rng(seed)
    vectors = [rng.normal(size=10) for _ in range(8)] + [rng.normal(size=10) * 30 + 5]
    results = [(_layers(v), 10) for v in vectors]  # equal weights: Flower's mean is ours
    for f in (1, 2):
        ours, _ = krum(vectors, f)
        theirs = aggregate_krum(results, num_malicious=f, to_keep=0)
        assert np.allclose(ours, np.concatenate([a.ravel() for a in theirs]), atol=1e-12)
        for m in (3, 6):
            ours, _ = multi_krum(vectors, f, m)
            theirs = aggregate_krum(results, num_malicious=f, to_keep=m)
            assert np.allclose(ours, np.concatenate([a.ravel() for a in theirs]), atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bulyan_agrees_with_flower(seed):
    # Flower's aggregate_bulyan is the paper's: Krum applied theta times, each to the rest, then
    # the beta values nearest the coordinate median. (Its newer serverapp Bulyan selects theta
    # by one Multi-Krum ranking instead, which is not the paper's iteration.)
    rng = np.random.default_rng(seed)
    vectors = [rng.normal(size=10) for _ in range(9)] + [rng.normal(size=10) * 30 + 5] * 2
    for f in (1, 2):
        ours, _ = bulyan(vectors, f)
        results = [(_layers(v.copy()), 10) for v in vectors]
        theirs = aggregate_bulyan(results, num_malicious=f, aggregation_rule=aggregate_krum,
                                  to_keep=0)
        assert np.allclose(ours, np.concatenate([a.ravel() for a in theirs]), atol=1e-12)


# --- FLTrust's root set ------------------------------------------------------------------------
@needs_fashion_mnist
def test_the_root_set_holds_no_clients_sample():
    from pflalign.data.federated import federated_dataset, root_set
    from pflalign.run.config import build_settings

    settings = build_settings({"num-clients": 6, "max-samples": 3000, "aggregation": "fltrust"})
    federation = federated_dataset(settings)
    root = root_set(settings, 100)
    assert root.num_train == 100
    rows = {bytes(x.numpy().tobytes()) for x in root.train_x}
    clients = {bytes(federation.dataset.images[i].tobytes()) for i in federation.pool}
    assert len(rows & clients) <= 1  # (an identical image may exist twice in the dataset)
    again = root_set(settings, 100)  # drawn from the seed: the same set
    assert (again.train_x == root.train_x).all() and (again.train_y == root.train_y).all()


def test_fltrust_without_free_samples_is_one_sentence(tmp_path):
    from pflalign.run.config import build_settings
    from pflalign.run.driver import simulate
    from pflalign.settings.options import ConfigError

    settings = build_settings({"dataset": "synthetic", "num-clients": 4, "rounds": 1,
                               "aggregation": "fltrust", "engine": "sequential",
                               "out-dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="has no such pool"):
        simulate(settings)


# --- the rules in the server's runtime ---------------------------------------------------------
def _runtime(**changes):
    from harness import server

    from pflalign.run.config import build_settings

    initial = {"w": np.zeros(2, dtype=np.float32), "b": np.zeros(1, dtype=np.float32)}
    _, runtime, _ = server("fedavg", build_settings({"num-clients": 12, **changes}), 12,
                           initial=initial, trainable=("w", "b"))
    return runtime, initial


def _states(rows):
    return [{"w": np.array(r[:2], dtype=np.float32), "b": np.array(r[2:], dtype=np.float32)}
            for r in rows]


def test_krum_in_the_runtime_picks_the_honest_upload_and_reports_it():
    runtime, initial = _runtime(aggregation="krum", **{"byzantine-fraction": 0.2})
    runtime.set_references([initial])
    rows = [[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0], [10, 10, 10]]  # f = floor(0.2 * 5) = 1
    out = runtime.average(_states(rows), [1.0] * 5)
    assert out["w"].tolist() == [0.0, 0.0] and out["b"].tolist() == [0.0]
    kept, seconds = runtime.take_defence_log()
    assert [k.indices for k in kept] == [(0,)] and seconds >= 0
    assert runtime.take_notices() == []


def test_rules_that_cannot_act_at_a_round_size_say_so_once():
    runtime, initial = _runtime(aggregation="krum")
    runtime.average(_states([[0, 0, 0], [5, 5, 5]]), [1.0, 1.0])
    runtime.average(_states([[0, 0, 0], [5, 5, 5]]), [1.0, 1.0])
    assert runtime.take_notices() == [
        "aggregation = 'krum' at 2 uploads cannot tell an outlier: it takes the first by "
        "client id."]
    runtime, _ = _runtime(aggregation="bulyan", **{"byzantine-fraction": 0.3})
    runtime.average(_states([[i, 0, 0] for i in range(7)]), [1.0] * 7)  # f = 2 needs 11
    (note,) = runtime.take_notices()
    assert note.startswith("aggregation = 'bulyan' at 7 uploads assumes f = 1 Byzantine, not 2")


def test_centered_clipping_in_the_runtime_starts_from_the_global_model():
    runtime, initial = _runtime(aggregation="centered-clip", **{"cc-tau": 1.0})
    glob = {"w": np.array([1.0, 1.0], dtype=np.float32), "b": np.array([0.0], dtype=np.float32)}
    runtime.set_references([glob])
    # updates from the global model: (3, 0, 0), 0, 0 -> the first is clipped to norm 1
    out = runtime.average(_states([[4, 1, 0], [1, 1, 0], [1, 1, 0]]), [1.0] * 3)
    assert out["w"].tolist() == pytest.approx([1 + 1 / 3, 1.0]) and out["b"].tolist() == [0.0]
