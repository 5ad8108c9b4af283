"""mode = async (FedBuff): the staleness rule, the schedule, pFLAlign's stale offset, the clock,
every engine, and the refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import needs_fashion_mnist
from harness import server, three_engines

from pflalign.methods.pflalign import OFFSET
from pflalign.run.config import build_settings
from pflalign.run.driver import initial_model, simulate
from pflalign.server.aggregation import FlatSpec, fedavg
from pflalign.server.buffered import (
    Schedule,
    async_sizes,
    draw_client,
    rebase,
    server_step,
    staleness_weight,
)
from pflalign.server.clock import MB
from pflalign.settings.options import ConfigError
from pflalign.wire.messages import Stale, Update
from pflalign.wire.protocol import MODEL
from pflalign.wire.traffic import records_bytes
from scripts.compare_results import compare

#: 6 clients, 4 in flight, aggregating every 2 arrivals, on 1,200 Fashion-MNIST samples
ASYNC = {"engine": "sequential", "num-clients": 6, "max-samples": 1200, "rounds": 4,
         "eval-every": 2, "fraction-train": 0.5, "seed": 2, "mode": "async",
         "device-profiles": "lognormal", "concurrency": 4, "buffer-size": 2}


# --- the rule, by hand ---------------------------------------------------------------------------
def test_staleness_weights_are_fedbuffs_polynomial():
    assert staleness_weight(0, 0.5) == 1.0
    assert staleness_weight(3, 0.5) == 0.5  # 1 / sqrt(1 + 3)
    assert staleness_weight(7, 1.0) == 0.125
    assert staleness_weight(9, 0.0) == 1.0
    with pytest.raises(ValueError):
        staleness_weight(-1, 0.5)


def test_sizes_default_to_a_synchronous_rounds_clients_and_half_of_them():
    assert async_sizes(20, 0.4, 0, 0) == (8, 4)
    assert async_sizes(20, 0.25, 0, 0) == (5, 3)
    assert async_sizes(20, 0.4, 10, 3) == (10, 3)


def test_a_buffer_of_a_fresh_and_a_stale_update_moves_the_model_as_fedbuff_says():
    """x + eta * sum n_i w(s_i) (y_i - x_tau_i) / sum n_i, computed by hand: x = [1, 2]; a fresh
    update y1 = [3, 2] of 1 sample, and y2 = [2, 4] of 3 samples trained from [0, 0] three
    aggregations ago (w = 1/2); eta = 1/2."""
    current = {"w": np.array([1.0, 2.0], np.float32)}
    fresh = rebase({"w": np.array([3.0, 2.0], np.float32)}, current, current, 1.0, stale=False)
    stale = rebase({"w": np.array([2.0, 4.0], np.float32)}, {"w": np.zeros(2, np.float32)},
                   current, staleness_weight(3, 0.5), stale=True)
    np.testing.assert_array_equal(stale["w"], [2.0, 4.0])  # [1, 2] + ([2, 4] - [0, 0]) / 2
    average = fedavg([fresh, stale], [1, 3], FlatSpec.of(current))
    np.testing.assert_array_equal(average["w"], [2.25, 3.5])
    np.testing.assert_array_equal(server_step(current, average, 0.5)["w"], [1.625, 2.75])
    # a fresh update at weight 1 is passed as it is, and lr 1 keeps the aggregate
    assert fresh["w"] is not None and np.array_equal(fresh["w"], [3.0, 2.0])
    assert server_step(current, average, 1.0)["w"] is average["w"]
    # counters are not moved
    counted = rebase({"n": np.array(7)}, {"n": np.array(1)}, {"n": np.array(3)}, 0.5, True)
    assert int(counted["n"]) == 7


def test_the_schedule_trains_what_may_arrive_first_and_delivers_in_arrival_order():
    schedule = Schedule()
    a = schedule.dispatch(client=3, version=0, start=0.0, earliest=1.0)
    b = schedule.dispatch(client=5, version=0, start=0.0, earliest=3.0)
    assert schedule.must_train() == [a, b]  # nothing trained: either may be first
    a.arrival = 5.0
    assert schedule.must_train() == [b]  # b may still arrive before 5
    b.arrival = 4.0
    assert schedule.must_train() == [] and schedule.next_arrival() is b
    c = schedule.dispatch(client=1, version=1, start=4.0, earliest=6.0)
    assert schedule.must_train() == []  # c cannot beat a's 5.0
    assert schedule.next_arrival() is a and schedule.flying() == {1}
    c.arrival = 6.0
    d = schedule.dispatch(client=2, version=1, start=5.0, earliest=5.5)
    d.arrival = 6.0
    assert schedule.next_arrival() is c  # a tie goes to the earlier dispatch
    assert draw_client([4, 2, 9], seed=1, draw=7) == draw_client([9, 4, 2], seed=1, draw=7)


# --- pFLAlign's stale offset ---------------------------------------------------------------------
def test_pflaligns_server_held_offset_is_against_the_model_the_client_trained_from():
    """docs/pflalign.md: an asynchronous update's offset is upload minus the global model the
    client received (docs/algorithms.md 1.7), not rebased nor weighted; the global model gets the
    rebased, weighted upload as FedAvg does."""
    settings = build_settings({"methods": "pflalign", "num-clients": 4,
                               "pflalign-state": "server", **{k: v for k, v in ASYNC.items()
                                                             if k in ("mode", "device-profiles")}})
    rng = np.random.default_rng(0)
    initial = {"w": rng.normal(size=(3, 2)).astype(np.float32)}
    method, runtime, model = server("pflalign", settings, 4, initial, trainable=("w",))
    state = method.init_server(runtime, model)
    base = {"w": initial["w"] - 1.0}  # the older model client 1 trained from
    upload = {"w": base["w"] + 0.5}
    weight = staleness_weight(2, 0.5)
    moved = rebase(upload, base, state.model, weight, stale=True)
    update = Update(1, 10.0, {}, moved, stale=Stale(upload, base, 2, weight))
    new, diagnostics = method.aggregate(runtime, state, 3, [update])
    np.testing.assert_array_equal(new.offsets[1]["w"], upload["w"] - base["w"])
    np.testing.assert_array_equal(new.model["w"], moved["w"])
    assert diagnostics["delta-norm"] == pytest.approx(0.5 * math.sqrt(6), rel=1e-6)
    payload = method.train_payload(runtime, new, 1, 4).arrays
    np.testing.assert_array_equal(payload[OFFSET]["w"], upload["w"] - base["w"])
    np.testing.assert_array_equal(payload[MODEL]["w"], new.model["w"] + new.offsets[1]["w"])


# --- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("values", "message"), [
    ({"buffer-size": 5, "concurrency": 4}, r"buffer-size = 5 waits for more arrivals than the 4 "),
    ({"concurrency": 9}, r"concurrency = 9 keeps more clients in flight than the run's 6"),
    ({"device-profiles": "none"}, r"mode = 'async' on engine = 'sequential' .* needs device "),
    ({"round-deadline": 5.0}, r"round-deadline = 5 closes synchronous rounds"),
    ({"over-selection": 1.3}, r"over-selection = 1.3 closes synchronous rounds"),
    ({"train-audit-fraction": 0.5}, r"train-audit-fraction = 0.5 recomputes"),
    ({"methods": "scaffold"}, r"scaffold cannot run mode = 'async'"),
    ({"methods": "fedavg", "gga": True}, r"gga = true anneals"),
    ({"mode": "sync", "concurrency": 0}, r"buffer-size = 2 applies to mode = 'async'"),
    ({"mode": "sync", "concurrency": 0, "buffer-size": 0, "async-lr": 0.5},
     r"async-lr = 0.5 applies to mode = 'async'"),
])
def test_bad_async_configs_are_one_sentence_before_any_data_is_read(tmp_path, values, message):
    with pytest.raises(ConfigError, match=message):
        build_settings({**ASYNC, "out-dir": str(tmp_path / "out"), **values})
    assert not (tmp_path / "out").exists()


@needs_fashion_mnist
def test_a_deadline_no_client_can_meet_stops_the_run_before_training(tmp_path):
    with pytest.raises(ConfigError, match=r"round-deadline = 0.001 simulated s is shorter than "
                                          r"any client's round: the fastest, client \d+"):
        simulate(build_settings({**ASYNC, "mode": "sync", "concurrency": 0, "buffer-size": 0,
                                 "methods": "fedavg", "round-deadline": 0.001,
                                 "out-dir": str(tmp_path / "out")}))


# --- runs ----------------------------------------------------------------------------------------
@needs_fashion_mnist
def test_the_first_aggregation_waits_for_the_second_arrival_computed_by_hand(tmp_path):
    """Known speeds: four clients dispatched at 0 with the initial model; the first to arrive
    is replaced at once by a client drawn among the other two; the round ends at the second
    arrival (of the three originals left and the replacement), and every round aggregates
    buffer-size updates with concurrency clients in flight."""
    speeds = [(c, 200.0 + 100 * c, 0.5 + c, 2.0 + c) for c in range(6)]
    path = tmp_path / "trace.csv"
    path.write_text("client,compute,upload,download\n"
                    + "".join(f"{c},{k},{u},{d}\n" for c, k, u, d in speeds))
    settings = build_settings({**ASYNC, "methods": "fedavg", "device-profiles": str(path),
                               "out-dir": str(tmp_path / "run")})
    results = simulate(settings)
    model, _ = initial_model(settings)
    size = records_bytes([model])
    sizes = {c["id"]: c["num-train"] for c in results["partition"]["clients"]}

    def seconds(c: int) -> float:
        return size / (speeds[c][3] * MB) + sizes[c] / speeds[c][1] + size / (speeds[c][2] * MB)

    first: list[int] = []
    for draw in range(4):
        first.append(draw_client([c for c in range(6) if c not in first], 2, draw))
    t1, c1 = min((seconds(c), c) for c in first)
    replacement = draw_client([c for c in range(6) if c not in first], 2, 4)
    second = min([seconds(c) for c in first if c != c1] + [t1 + seconds(replacement)])
    rows = results["methods"]["fedavg"]["rounds"]
    assert math.isclose(rows[0]["sim-time"], second, rel_tol=1e-12)
    assert rows[0]["staleness-max"] == 0
    assert all(r["clients-trained"] == 2 for r in rows)
    # the arrival that filled the buffer is replaced, except after the last round
    assert [r["in-flight"] for r in rows] == [4, 4, 4, 3]
    assert all(b["sim-time"] >= a["sim-time"] for a, b in zip(rows, rows[1:], strict=False))
    assert max(r["staleness-max"] for r in rows) >= 1  # later rounds take stale updates
    usage = results["methods"]["fedavg"]["usage"]
    assert sum(u["used"] for u in usage) == 2 * len(rows)  # every aggregated update
    # four first dispatches, a replacement per arrival except after the last aggregation
    assert sum(u["dispatched"] for u in usage) == 4 + sum(r["arrivals"] for r in rows) - 1


@needs_fashion_mnist
def test_pflalign_holds_the_same_offsets_on_the_client_or_the_server_asynchronously(tmp_path):
    """With downloads that take no time (the server-held offset makes messages larger), the two
    places of pFLAlign's offset give the same personalization, stale updates included."""
    rows = "".join(f"{c},{100 + 37 * c},{1 + c % 3},1e12\n" for c in range(6))
    path = tmp_path / "trace.csv"
    path.write_text("client,compute,upload,download\n" + rows)
    results = simulate(build_settings({
        **ASYNC, "device-profiles": str(path), "rounds": 6,
        "methods": 'pflalign,pflalign(pflalign-state="server")',
        "out-dir": str(tmp_path / "run")}))
    client, held = (results["methods"][k]
                    for k in ("pflalign", 'pflalign(pflalign-state="server")'))
    assert max(r["staleness-max"] for r in client["rounds"]) >= 1
    for a, b in zip(client["rounds"], held["rounds"], strict=True):
        assert a.get("personal-acc") == b.get("personal-acc")
        assert a["train-loss"] == b["train-loss"]
    assert client["clients"] == held["clients"]


@needs_fashion_mnist
def test_async_runs_give_the_same_metrics_and_clock_on_every_engine(tmp_path):
    """Sequential, batched in this process, batched on two Ray workers and a real Flower
    simulation: the same rows (clock, staleness, bytes) and metrics bit for bit, with diurnal
    availability and a server learning rate."""
    values = {**ASYNC, "methods": "pflalign(pflalign-state=server)",
              "availability": "diurnal", "available-hours": 16.0, "async-lr": 0.8}
    results = three_engines(values, tmp_path, compared_at_least=80)
    workers = simulate(build_settings({**values, "engine": "batched", "batched-workers": "2",
                                       "out-dir": str(tmp_path / "w")}))
    differences, compared = compare(results, workers)
    assert differences == [] and compared >= 80
    rows = [r for entry in results["methods"].values() for r in entry["rounds"]]
    assert max(r["staleness-max"] for r in rows) >= 1
