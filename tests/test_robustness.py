"""A server that one client cannot break: reply checks, the update-norm bound, robust aggregation,
rollback, timeouts and seeded fault injection, in real simulations on real data."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import ROOT, needs_fashion_mnist
from harness import server

from pflalign.engines.faults import injected_fault, malicious_clients
from pflalign.engines.sequential import SequentialEngine
from pflalign.methods.registry import METHODS
from pflalign.outputs.results import Reporter
from pflalign.round.feature import RoundFeature
from pflalign.round.loop import RoundLoop
from pflalign.run.config import ConfigError, build_settings
from pflalign.run.driver import initial_model, template_model
from pflalign.server.aggregation import (
    FlatSpec,
    combine,
    coordinate_median,
    trimmed_mean,
    weighted_average,
)
from pflalign.server.bounds import NormBounds
from pflalign.server.runtime import ServerRuntime
from pflalign.server.validation import non_finite
from pflalign.wire.messages import Update
from pflalign.wire.state import ServerState

# --- the rules, by hand ----------------------------------------------------------------------


def test_coordinate_median_by_hand():
    vectors = [np.array([1.0, 10.0]), np.array([2.0, 20.0]), np.array([3.0, 30.0]),
               np.array([100.0, -5.0])]
    assert coordinate_median(vectors).tolist() == [2.5, 15.0]
    assert coordinate_median(vectors[:3]).tolist() == [2.0, 20.0]


def test_trimmed_mean_by_hand():
    vectors = [np.array([1.0, -50.0]), np.array([2.0, 4.0]), np.array([3.0, 5.0]),
               np.array([4.0, 6.0]), np.array([1e9, 7.0])]
    # floor(0.2 * 5) = 1 value dropped at each end of each coordinate
    assert trimmed_mean(vectors, 0.2).tolist() == [3.0, 5.0]
    # floor(0.1 * 5) = 0: the plain mean
    assert trimmed_mean(vectors, 0.1).tolist() == pytest.approx([(10 + 1e9) / 5, -28 / 5])
    with pytest.raises(ValueError, match="0.5"):
        trimmed_mean(vectors, 0.5)


def test_combine_mean_is_the_weighted_average_and_robust_rules_ignore_weights():
    rng = np.random.default_rng(0)
    vectors = [rng.normal(size=7) for _ in range(4)]
    weights = [1.0, 5.0, 2.0, 9.0]
    assert np.array_equal(combine(vectors, weights, "mean"), weighted_average(vectors, weights))
    assert np.array_equal(combine(vectors, weights, "median"), np.median(vectors, axis=0))
    # no trimming and equal weights: the trimmed mean is the mean
    np.testing.assert_allclose(combine(vectors, weights, "trimmed-mean", 0.0),
                               weighted_average(vectors, [1, 1, 1, 1]), rtol=1e-14)


def test_non_finite_names_the_entry():
    assert non_finite(ServerState(model={"w": np.ones(3, np.float32)})) is None
    assert "'model/w'" in non_finite(ServerState(model={"w": np.array([1.0, np.inf], np.float32)}))


def test_robust_aggregation_is_refused_where_it_is_not_an_average():
    with pytest.raises(ConfigError, match="scaffold"):
        build_settings({"methods": "fedavg,scaffold", "aggregation": "median"})
    build_settings({"methods": "fedavg,scaffold(aggregation=mean)", "aggregation": "median"})


def test_fault_keys_are_checked_together():
    with pytest.raises(ConfigError, match="do not go together"):
        build_settings({"attack": "signflip"})
    with pytest.raises(ConfigError, match="exceeds num-clients"):
        build_settings({"num-clients": 3, "malicious-clients": 4, "attack": "signflip"})
    with pytest.raises(ConfigError, match="below 1"):
        build_settings({"client-failure-rate": 0.6, "client-dropout-rate": 0.4})


def test_faults_are_seeded_and_at_the_requested_rate():
    settings = build_settings({"num-clients": 50, "malicious-clients": 5, "attack": "scale",
                         "client-failure-rate": 0.3})
    chosen = malicious_clients(settings)
    assert len(chosen) == 5 and chosen == malicious_clients(build_settings(settings.to_dict()))
    assert chosen != malicious_clients(settings.replace({"seed": 1}))
    draws = [injected_fault(settings, c, r) for c in range(50) for r in range(1, 41)]
    assert set(draws) == {None, "failure"}
    assert draws.count("failure") / len(draws) == pytest.approx(0.3, abs=0.03)


# --- attacks in a real (sequential-engine) simulation -----------------------------------------

BASE = {"num-clients": 6, "max-samples": 3000, "fraction-train": 1.0, "rounds": 2,
        "eval-every": 2, "local-steps": 5, "seed": 2, "engine": "sequential",
        "round-timeout": 5.0}


class _RecordModels(RoundFeature):
    """A round feature recording the global model before each round's training."""

    name = "record-models"

    def __init__(self):
        self.models: list[dict] = []

    def before_training(self, federation, server_round):
        self.models.append({k: v.copy() for k, v in federation.state.model.items()})
        return {}, 0, 0


def _run(method: str = "fedavg", **changes) -> tuple[dict, list[dict]]:
    """One method's run on the sequential engine: its results and the global model after each
    round."""
    settings = build_settings({**BASE, "methods": method, **changes})
    model, trainable = initial_model(settings)
    server = ServerRuntime(settings, method, model, trainable, template_model(settings))
    recorder = _RecordModels()
    federation = RoundLoop(server, METHODS[method].build(settings), SequentialEngine(settings),
                           Reporter(quiet=True), features=[recorder])
    result = federation.run(model)
    return result, [*recorder.models[1:], federation.state.model]


@pytest.fixture(scope="module")
def without_attacker():
    """The reference: the attacker never answers, so each round aggregates the honest replies
    only."""
    return {m: _run(m, **{"malicious-clients": 1, "attack": "hang"})
            for m in ("fedavg", "pflalign")}


def _same_models(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True))


@needs_fashion_mnist
@pytest.mark.parametrize("attack,scale", [("inflate-count", 1e12), ("scale", 1e30)])
@pytest.mark.parametrize("method", ["fedavg", "pflalign"])
def test_a_rejected_attacker_leaves_the_global_model_of_the_honest_replies(
        without_attacker, attack, scale, method):
    result, models = _run(method, **{"malicious-clients": 1, "attack": attack,
                                     "attack-scale": scale})
    reference, reference_models = without_attacker[method]
    assert [r["rejected"] for r in result["rounds"]] == [1, 1]
    assert [r["clients-trained"] for r in result["rounds"]] == [5, 5]
    assert [r["timeouts"] for r in reference["rounds"]] == [1, 1]
    assert _same_models(models, reference_models)


@needs_fashion_mnist
@pytest.mark.parametrize("method", ["fedavg", "pflalign"])
def test_a_scale_attacker_in_rounds_of_two_leaves_the_honest_aggregate(method):
    """6 clients, 2 a round: the update-norm bound's reference is then the norms accepted in
    earlier rounds (or, in round 1, the other upload's), so the attacker is refused in every
    round it is sampled and the global model is that of the run where it never answers."""
    changes = {"fraction-train": 0.4, "rounds": 6, "eval-every": 6, "malicious-clients": 1}
    attacked, models = _run(method, **changes, attack="scale", **{"attack-scale": 100.0})
    silent, reference = _run(method, **changes, attack="hang")
    assert [r["clients-trained"] for r in attacked["rounds"]] == [
        r["clients-trained"] for r in silent["rounds"]]
    assert [r["rejected"] for r in attacked["rounds"]] == [r["timeouts"] for r in silent["rounds"]]
    assert 1 <= sum(r["rejected"] for r in attacked["rounds"]) < 6
    assert _same_models(models, reference)


@needs_fashion_mnist
def test_faked_evaluation_is_rejected_and_the_table_says_so():
    clean, _ = _run()
    faked, _ = _run(**{"malicious-clients": 1, "attack": "fake-eval", "attack-scale": 1e6})
    attacker = next(iter(malicious_clients(build_settings({**BASE, "malicious-clients": 1,
                                                     "attack": "fake-eval"}))))
    final = faked["final"]
    assert (final["evaluated"], final["eval-clients"], final["eval-rejected"]) == (5, 6, 1)
    honest = [c for c in clean["clients"] if c["id"] != attacker]
    correct = sum(round(c["personal-acc"] * c["num-test"]) for c in honest)
    assert final["personal-acc"] == correct / sum(c["num-test"] for c in honest)
    assert [c["id"] for c in faked["clients"]] == [c["id"] for c in honest]


@needs_fashion_mnist
@pytest.mark.parametrize("method", ["fedavg", "pflalign"])
def test_a_poisoned_aggregate_is_rolled_back_when_evaluation_turns_non_finite(method):
    """With the norm bound off, a x1e30 update gets into the mean: the aggregate is finite but
    every client's loss of the global model is not, so the round is rolled back and the previous
    model evaluated; clients never keep a broken state."""
    result, models = _run(method, **{"malicious-clients": 1, "attack": "scale",
                                     "attack-scale": 1e30, "update-norm-bound": 0.0,
                                     "eval-every": 1})
    rows = result["rounds"]
    assert [r.get("rolled-back") for r in rows] == [1, 1]
    assert all(np.isfinite(r["personal-acc"]) and r["evaluated"] == 6 for r in rows)
    initial, _ = initial_model(build_settings({**BASE}))
    # both rounds were rolled back to the initial model
    assert all(np.array_equal(models[-1][k], initial[k]) for k in initial)
    if method == "fedavg":  # both evaluations scored the initial model
        assert rows[0]["personal-acc"] == rows[1]["personal-acc"]


def test_a_reply_array_of_another_dtype_is_rejected():
    spec = FlatSpec.of({"w": np.zeros(2, np.float32)})
    assert spec.problem_with({"w": np.array([1.0, 1e300])}) == (
        "array 'w' has dtype float64, expected float32")


@needs_fashion_mnist
def test_buffers_and_extra_records_are_norm_bounded_too():
    """A x1e30 batch-norm statistic or control-variate record is refused like a huge update."""
    settings = build_settings({**BASE, "model": "cnn-bn", "methods": "fedavg"})
    method, runtime, model = server("fedavg", settings, 6)
    state = method.init_server(runtime, model)
    warnings = []
    bounds = NormBounds(runtime, warnings.append)
    rng = np.random.default_rng(0)

    def honest(cid):
        upload = {k: v + 0.01 * rng.standard_normal(v.shape).astype(v.dtype)
                  if v.dtype.kind == "f" else v for k, v in model.items()}
        return Update(cid, 10, {}, upload, {"delta": {"c": rng.standard_normal(5)}})

    updates = [honest(c) for c in range(6)]
    buffer = next(k for k in model if k.endswith("running_var"))
    updates[1].model[buffer] = updates[1].model[buffer] * np.float32(1e30)
    updates[4].arrays["delta"]["c"] = updates[4].arrays["delta"]["c"] * 1e20
    kept, refused = bounds.bound_updates(updates, state.model)
    assert refused == 2 and [u.client for u in kept] == [0, 2, 3, 5]
    assert "client 1's buffer update norm" in warnings[0]
    assert "client 4's 'delta' record norm" in warnings[1]


# --- the Flower engine: failures, a hanging client, exact accounting --------------------------


@pytest.mark.slow
@needs_fashion_mnist
def test_flower_engine_counts_injected_failures_and_a_hanging_client_exactly(tmp_path):
    # round-timeout: long enough for the honest clients on a loaded machine (the suite runs two
    # test processes on 2 cores), so that only the hanging client times out
    changes = {"num-clients": 6, "max-samples": 3000, "fraction-train": 1.0, "rounds": 1,
               "eval-every": 1, "local-steps": 5, "seed": 2, "client-failure-rate": 0.3,
               "malicious-clients": 1, "attack": "hang", "round-timeout": 14.0}
    args = [f"--set={k}={v}" for k, v in changes.items()]
    run = subprocess.run([sys.executable, str(ROOT / "simulate.py"), *args, "--methods",
                          "fedavg", "--out", str(tmp_path), "--quiet"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())["methods"]["fedavg"]
    settings = build_settings({**changes, "methods": "fedavg"})
    hanging = malicious_clients(settings)
    for row in result["rounds"]:
        failed = {c for c in range(6) if c not in hanging
                  and injected_fault(settings, c, row["round"]) == "failure"}
        assert row["timeouts"] == 1
        assert row["failures"] == len(failed) + 1
        assert row["clients-trained"] == 6 - len(failed) - 1
        assert row["rejected"] == 0
    assert "did not reply within round-timeout = 14 s" in run.stderr
    assert "injected failure (client-failure-rate, round 1)" in run.stderr
    assert result["final"]["evaluated"] == 5
    assert "evaluated 5 of 6" in run.stdout


class _ForgetfulEngine(SequentialEngine):
    """A sequential engine whose clients lose their saved state after round 1 (a node restarted
    without a state-dir)."""

    def exchange(self, action, messages):
        if action == "train" and messages and messages[0].config["server-round"] == 2:
            self.states.clear()
        return super().exchange(action, messages)


@needs_fashion_mnist
def test_a_client_that_comes_back_without_its_state_is_warned_about(capsys):
    settings = build_settings({**BASE, "methods": "pflalign"})
    model, trainable = initial_model(settings)
    server = ServerRuntime(settings, "pflalign", model, trainable, template_model(settings))
    RoundLoop(server, METHODS["pflalign"].build(settings), _ForgetfulEngine(settings),
              Reporter(quiet=True)).run(model)
    warnings = [line for line in capsys.readouterr().err.splitlines()
                if "came back without it" in line]
    assert len(warnings) == 6
    assert warnings[0].startswith("WARNING: [pflalign] client 0 saved its pflalign state")


class _SilentGrid:
    """A Grid whose nodes take every message and never answer."""

    def __init__(self):
        self.pushed = 0

    def push_messages(self, messages):
        ids = []
        for message in messages:
            self.pushed += 1
            message.metadata.message_id = f"m{self.pushed}"
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, ids):
        return []


def test_the_flower_engine_names_the_clients_it_waits_for_and_gives_up_at_the_timeout():
    from strategies.flower import FlowerEngine

    lines = []
    reporter = Reporter(quiet=True)
    reporter.info = lines.append
    engine = FlowerEngine(_SilentGrid(), build_settings({"round-timeout": 0.5}), reporter)
    engine.notice_every = 0.2
    started = time.monotonic()
    replies, silent = engine.send({c: SimpleNamespace(metadata=SimpleNamespace(message_id=""))
                                   for c in (3, 0)})
    assert 0.5 <= time.monotonic() - started < 2
    assert replies == {} and silent == [0, 3]
    assert lines and lines[0].startswith("waiting for 2 clients (0, 3): ")


class _DiscoveryGrid:
    """A Grid of three nodes answering discovery; node 101 declares a huge training set."""

    def __init__(self, partition):
        self.partition, self.pushed = partition, {}

    def get_node_ids(self):
        return [100, 101, 102]

    def push_messages(self, messages):
        for message in messages:
            message.metadata.message_id = f"m{message.dst_node_id}"
            self.pushed[message.metadata.message_id] = message.dst_node_id
        return list(self.pushed)

    def pull_messages(self, ids):
        from flwr.app import Message, Metadata, MetricRecord, RecordDict

        replies = []
        for mid in ids:
            node = self.pushed[mid]
            cid = node - 100
            declared = 10**12 if node == 101 else len(self.partition.train[cid])
            replies.append(Message(metadata=Metadata(
                run_id=1, message_id="", src_node_id=node, dst_node_id=0,
                reply_to_message_id=mid, group_id="", created_at=0.0, ttl=60,
                message_type="query"), content=RecordDict({"metrics": MetricRecord({
                    "partition-id": cid, "num-train": declared,
                    "num-test": len(self.partition.test[cid]), "unseen": 0})})))
        return replies


@needs_fashion_mnist
def test_discovery_takes_sizes_from_the_partition_not_from_what_a_node_declares(monkeypatch):
    from types import SimpleNamespace

    import strategies.flower as flower
    from pflalign.data.federated import federated_dataset

    # outgoing messages need a running Flower run; the grid here only reads their destination
    monkeypatch.setattr(flower, "Message", lambda **kw: SimpleNamespace(
        metadata=SimpleNamespace(message_id=""), **kw))
    settings = build_settings({"num-clients": 3, "max-samples": 3000})
    partition = federated_dataset(settings).partition
    warnings = []
    reporter = Reporter(quiet=True)
    reporter.warn = warnings.append
    clients = flower.FlowerEngine(_DiscoveryGrid(partition), settings, reporter).discover()
    assert [clients[c].num_train for c in range(3)] == [len(partition.train[c]) for c in range(3)]
    assert len(warnings) == 1 and warnings[0].startswith(
        "client 1 (node 101) declared 1000000000000 train")


def test_update_clip_scales_each_update_to_the_rounds_median_and_rejects_none():
    """Norm bounding by hand: updates of norm 1, 2 and 30 over a zero model, factor 1: the
    round's median is 2, so the third is scaled to norm 2 along its direction; the others, and
    any non-trainable entry, are untouched."""
    from pflalign.server.aggregation import FlatSpec
    from pflalign.server.bounds import NormBounds
    from pflalign.wire.messages import Update

    class Server:  # the validator reads the trainable exchanged spec and the settings
        trainable_shared = FlatSpec.of({"w": np.zeros(2, np.float32)})
        settings = build_settings({})

    validator = NormBounds(Server(), lambda text: None)
    zero = {"w": np.zeros(2, np.float32), "count": np.array(3)}
    updates = [Update(client=c, num_examples=1, metrics={},
                      model={"w": np.array(w, np.float32), "count": np.array(3)})
               for c, w in enumerate([[1, 0], [0, 2], [18, 24]])]
    kept, clipped = validator.clip_updates(updates, zero, factor=1.0)
    assert clipped == 1 and [u.client for u in kept] == [0, 1, 2]
    np.testing.assert_array_equal(kept[0].model["w"], [1, 0])
    np.testing.assert_array_equal(kept[2].model["w"], np.array([1.2, 1.6], np.float32))
    assert kept[2].model["count"] == 3
    # factor 20: nobody exceeds 40
    assert validator.clip_updates(updates, zero, factor=20.0)[1] == 0
    # two uploads and no history: the smaller is the reference, so a scaled one is cut to it
    kept, clipped = validator.clip_updates(updates[1:], zero, factor=1.0)
    assert clipped == 1 and np.linalg.norm(kept[1].model["w"]) == pytest.approx(2.0)


@needs_fashion_mnist
def test_update_clip_bounds_a_scaled_update_that_passes_the_norm_bound():
    """6 clients, 2 a round, one scaling its update x10 (within update-norm-bound = 30, so never
    rejected): FedAvg's personal accuracy falls to chance (9.8% measured); clipping every
    update to the reference (update-clip = 1) rejects nobody and keeps 34.6% (41.6% when the
    attacker never answers)."""
    changes = {"fraction-train": 0.4, "rounds": 6, "eval-every": 6, "malicious-clients": 1,
               "attack": "scale", "attack-scale": 10.0}
    attacked, _ = _run("fedavg", **changes)
    clipped, _ = _run("fedavg", **changes, **{"update-clip": 1.0})
    assert all(r["rejected"] == 0 and r["clients-trained"] == 2
               for r in attacked["rounds"] + clipped["rounds"])
    assert all(r["clipped"] >= 1 for r in clipped["rounds"])
    assert attacked["final"]["personal-acc"] < 0.15
    assert clipped["final"]["personal-acc"] > attacked["final"]["personal-acc"] + 0.15
