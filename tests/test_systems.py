"""Systems heterogeneity: device profiles, the simulated clock, deadlines and over-selection."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import needs_fashion_mnist
from harness import three_engines

from pflalign.run.config import build_settings
from pflalign.run.driver import initial_model, simulate
from pflalign.server.clock import (
    MB,
    Availability,
    DeviceProfiles,
    availability_of,
    close_round,
    drawn_profiles,
    read_trace,
    read_windows,
    sample_available,
)
from pflalign.server.sampling import sample_clients
from pflalign.settings.options import ConfigError
from pflalign.wire.traffic import records_bytes
from scripts.compare_results import compare

#: 6 clients, 3 rounds of 3 (FedAvg and pFLAlign), on 1,200 Fashion-MNIST samples
RUN = {"engine": "sequential", "num-clients": 6, "max-samples": 1200, "rounds": 3,
       "eval-every": 3, "fraction-train": 0.5, "seed": 2, "methods": "fedavg,pflalign"}


def test_lognormal_profiles_have_the_declared_median_and_spread_and_depend_on_the_seed_alone():
    profiles = drawn_profiles(200_000, seed=1, compute=80.0, upload_mb=2.0, download_mb=10.0,
                              spread=0.7)
    for values, median in ((profiles.compute, 80.0), (profiles.upload, 2.0 * MB),
                           (profiles.download, 10.0 * MB)):
        assert abs(np.median(values) / median - 1) < 0.01
        assert abs(np.log(values).std() - 0.7) < 0.01
    # the three are drawn independently
    assert abs(np.corrcoef(np.log(profiles.compute), np.log(profiles.upload))[0, 1]) < 0.01
    again = drawn_profiles(200_000, seed=1, compute=80.0, upload_mb=2.0, download_mb=10.0,
                           spread=0.7)
    assert np.array_equal(again.compute, profiles.compute)
    flat = drawn_profiles(10, seed=1, compute=80.0, upload_mb=2.0, download_mb=10.0, spread=0.0)
    assert np.all(flat.compute == 80.0) and np.all(flat.upload == 2e6)


def test_a_clients_time_is_download_compute_and_upload():
    profiles = DeviceProfiles(compute=np.array([50.0, 10.0]), upload=np.array([1e6, 2e6]),
                              download=np.array([4e6, 1e6]))
    # 2 MB down at 4 MB/s, 100 samples at 50/s, 1 MB up at 1 MB/s
    assert profiles.seconds(0, 2_000_000, 100, 1_000_000) == 0.5 + 2.0 + 1.0
    assert profiles.seconds(1, 1_000_000, 30, 4_000_000) == 1.0 + 3.0 + 2.0


def test_a_round_closes_on_the_replies_that_arrive_first_and_in_time():
    arrivals = [5.0, None, 2.0, 9.0, 7.0]  # client 1 never replies
    closed = close_round(arrivals, wanted=3, deadline=8.0)
    assert (closed.used, closed.late, closed.unneeded, closed.seconds) == ([0, 2, 4], 1, 0, 7.0)
    # a deadline that leaves the round short: it waited until the deadline
    closed = close_round(arrivals, wanted=3, deadline=6.0)
    assert (closed.used, closed.late, closed.unneeded, closed.seconds) == ([0, 2], 2, 0, 6.0)
    # over-selection: the first 2 of 4 arrivals, the round over when the second arrives
    closed = close_round(arrivals, wanted=2, deadline=0.0)
    assert (closed.used, closed.late, closed.unneeded, closed.seconds) == ([0, 2], 0, 2, 5.0)
    # no deadline, everyone wanted: the slowest sets the round's time
    assert close_round(arrivals, wanted=5, deadline=0.0).seconds == 9.0
    # ties go by reply order
    assert close_round([3.0, 3.0, 3.0], wanted=2, deadline=0.0).used == [0, 1]


def _trace(tmp_path, text: str, name: str = "trace.csv") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_the_example_trace_serves_twenty_clients():
    from conftest import ROOT

    profiles = read_trace(ROOT / "configs" / "device-trace-example.csv", 20)
    assert profiles.compute[0] == 100.1 and profiles.upload[1] == 0.63 * MB


def test_a_trace_file_gives_each_clients_profile(tmp_path):
    rows = "\n".join(f"{c},{10 * (c + 1)},{c + 1},{2 * (c + 1)}" for c in range(4))
    csv_path = _trace(tmp_path, "client,compute,upload,download\n" + rows + "\n")
    profiles = read_trace(csv_path, 4)
    assert profiles.compute.tolist() == [10.0, 20.0, 30.0, 40.0]
    assert profiles.upload.tolist() == [1e6, 2e6, 3e6, 4e6]
    assert profiles.download.tolist() == [2e6, 4e6, 6e6, 8e6]
    entries = [{"client": c, "compute": 10 * (c + 1), "upload": c + 1, "download": 2 * (c + 1)}
               for c in reversed(range(4))]
    json_path = _trace(tmp_path, json.dumps(entries), "trace.json")
    assert np.array_equal(read_trace(json_path, 4).download, profiles.download)
    settings = build_settings({"device-profiles": json_path, "num-clients": 3,
                               "num-unseen-clients": 1})
    assert settings.run.device_profiles == json_path


@pytest.mark.parametrize(("text", "message"), [
    ("client,compute,upload\n0,1,1\n", r"needs the header client,compute,upload,download "
                                       r"\(missing: download\)"),
    ("client,compute,upload,download\n0,1,1,1\n1,fast,1,1\n", "line 3: give client as a whole"),
    ("client,compute,upload,download\n0,1,1,1\n1,0,1,1\n", "line 3: client 1's speeds must be "
                                                           "positive"),
    ("client,compute,upload,download\n0,1,1,1\n1,1,-2,1\n", "speeds must be positive"),
    ("client,compute,upload,download\n0,1,1,1\n0,1,1,1\n", "client 0 appears twice"),
    ("client,compute,upload,download\n0,1,1,1\n", r"has no row for 1 of the run's 2 clients "
                                                  r"\(the first: 1\)"),
    ("client,compute,upload,download\n0,1,1,1\n1,1,1,1\n2,1,1,1\n", "client 2 is outside"),
])
def test_a_bad_trace_is_one_sentence_before_any_data_is_read(tmp_path, text, message):
    path = _trace(tmp_path, text)
    with pytest.raises(ConfigError, match=message):
        build_settings({"device-profiles": path, "num-clients": 2})


def test_bad_systems_keys_are_one_sentence(tmp_path):
    with pytest.raises(ConfigError, match="the trace file does not exist"):
        build_settings({"device-profiles": str(tmp_path / "none.csv")})
    with pytest.raises(ConfigError, match="a trace file ending in .csv or .json"):
        build_settings({"device-profiles": "traces.txt"})
    with pytest.raises(ConfigError, match="is not valid JSON"):
        build_settings({"device-profiles": _trace(tmp_path, "[{", "t.json")})
    for key, value in (("round-deadline", 10.0), ("over-selection", 1.3)):
        with pytest.raises(ConfigError, match=f"{key} = .* needs device profiles"):
            build_settings({key: value})
    with pytest.raises(ConfigError, match="over-selection"):
        build_settings({"device-profiles": "lognormal", "over-selection": 0.5})


@needs_fashion_mnist
def test_the_clock_is_each_rounds_slowest_client_from_its_profile_and_bytes(tmp_path):
    """A trace of known speeds: every round's sim-seconds is, computed here by hand, the
    largest of its sampled clients' download (the model's bytes), training (their samples) and
    upload (the model's bytes) times; sim-time adds them up."""
    speeds = [(c, 200.0 + 100 * c, 0.5 + c, 2.0 + c) for c in range(6)]
    path = _trace(tmp_path, "client,compute,upload,download\n"
                  + "".join(f"{c},{k},{u},{d}\n" for c, k, u, d in speeds))
    values = {**RUN, "methods": "fedavg", "device-profiles": path,
              "out-dir": str(tmp_path / "run")}
    settings = build_settings(values)
    results = simulate(settings)
    model, _ = initial_model(settings)
    model_bytes = records_bytes([model])
    sizes = {c["id"]: c["num-train"] for c in results["partition"]["clients"]}
    clock = 0.0
    for row in results["methods"]["fedavg"]["rounds"]:
        sampled = sample_clients(range(6), 0.5, 2, row["round"])
        times = [model_bytes / (speeds[c][3] * MB) + sizes[c] / speeds[c][1]
                 + model_bytes / (speeds[c][2] * MB) for c in sampled]
        assert math.isclose(row["sim-seconds"], max(times), rel_tol=1e-12)
        clock += max(times)
        assert math.isclose(row["sim-time"], clock, rel_tol=1e-12)
        assert row["clients-trained"] == 3 and "late" not in row


@needs_fashion_mnist
def test_equal_profiles_and_no_deadline_change_no_metric(tmp_path):
    """With every device the median one and no deadline the clock only adds its entries: the
    metrics are those of a run without profiles, bit for bit."""
    plain = simulate(build_settings({**RUN, "out-dir": str(tmp_path / "plain")}))
    timed = simulate(build_settings({**RUN, "device-profiles": "lognormal", "device-spread": 0.0,
                                     "out-dir": str(tmp_path / "timed")}))
    differences, compared = compare(plain, {**timed, "config": plain["config"]}, allow_new=True)
    assert differences == [] and compared > 40
    assert all(row["sim-seconds"] > 0 for row in timed["methods"]["pflalign"]["rounds"])


@needs_fashion_mnist
def test_a_deadline_drops_the_late_and_over_selection_keeps_the_first(tmp_path):
    """A deadline below every round's slowest client: the late ones are counted and not used,
    and each round lasts until its deadline; over-selection samples more and uses the first
    fraction-train to arrive."""
    base = {**RUN, "methods": "fedavg", "device-profiles": "lognormal", "device-spread": 1.0}
    free = simulate(build_settings({**base, "out-dir": str(tmp_path / "free")}))
    times = sorted(r["sim-seconds"] for r in free["methods"]["fedavg"]["rounds"])
    deadline = times[0] * 0.9  # below every round's slowest client: someone is late each round
    timed = simulate(build_settings({**base, "round-deadline": deadline,
                                     "out-dir": str(tmp_path / "deadline")}))
    rows = timed["methods"]["fedavg"]["rounds"]
    assert all(r["late"] >= 1 and r["clients-trained"] == 3 - r["late"] for r in rows)
    # usage: every sampled client was sent a training, and only those on time were aggregated
    usage = timed["methods"]["fedavg"]["usage"]
    assert sum(u["dispatched"] for u in usage) == 3 * len(rows)
    assert sum(u["used"] for u in usage) == sum(r["clients-trained"] for r in rows)
    assert any(u["used"] < u["dispatched"] for u in usage)
    assert all(r["sim-seconds"] == deadline for r in rows)
    over = simulate(build_settings({**base, "over-selection": 1.5,
                                    "out-dir": str(tmp_path / "over")}))
    rows = over["methods"]["fedavg"]["rounds"]
    assert all(r["clients-trained"] == 3 and r["unneeded"] == 1 for r in rows)  # 4 sampled


@needs_fashion_mnist
def test_the_clock_and_metrics_are_the_same_on_every_engine(tmp_path):
    results = three_engines({**RUN, "device-profiles": "lognormal", "device-spread": 1.0,
                             "round-deadline": 6.0, "over-selection": 1.4,
                             "availability": "diurnal", "available-hours": 16.0}, tmp_path,
                            compared_at_least=60)
    rows = [r for entry in results["methods"].values() for r in entry["rounds"]]
    assert sum(r["late"] for r in rows) > 0 and all("unneeded" in r for r in rows)


def test_a_diurnal_window_opens_at_each_clients_phase():
    """Client c is reachable while (t / 3600 + phase_c) mod 24 < hours."""
    days = Availability(phase=np.array([0.0, 20.0, 6.0]), hours=8.0)
    assert days.available([0, 1, 2], 0.0) == [0, 2]  # hours 0, 20, 6
    # at 1 h: hours 1, 21, 7 -> clients 0 and 2; at 5 h: 5, 1, 11 -> 0 and 1
    assert days.available([0, 1, 2], 3600.0) == [0, 2]
    assert days.available([0, 1, 2], 5 * 3600.0) == [0, 1]
    # at 9 h: 9, 5, 15 -> only client 1; the next opening for {0, 2} is client 2's at 18 h
    assert days.available([0, 1, 2], 9 * 3600.0) == [1]
    assert days.next_opening([0, 2], 9 * 3600.0) == 18 * 3600.0
    assert days.next_opening([1], 9 * 3600.0) == 9 * 3600.0


def test_sampling_among_the_reachable_takes_what_there_is():
    assert sample_available([7, 3, 9], 5, seed=1, server_round=2) == [3, 7, 9]
    drawn = sample_available(list(range(100)), 10, seed=1, server_round=2)
    assert drawn == sample_available(list(range(100)), 10, seed=1, server_round=2)
    assert len(drawn) == 10 and drawn != sample_available(list(range(100)), 10, 1, 3)


def test_availability_needs_profiles_and_a_day_of_hours():
    with pytest.raises(ConfigError, match="availability = 'diurnal' .* needs device profiles"):
        build_settings({"availability": "diurnal"})
    with pytest.raises(ConfigError, match="available-hours"):
        build_settings({"device-profiles": "lognormal", "availability": "diurnal",
                        "available-hours": 30})


@needs_fashion_mnist
def test_each_round_samples_among_the_clients_reachable_when_it_starts(tmp_path):
    """Each row's available count is, computed here from the drawn phases and the clock at the
    round's start, the clients whose window is open; a round trains at most that many."""
    values = {**RUN, "num-clients": 12, "methods": "fedavg", "device-profiles": "lognormal",
              "availability": "diurnal", "available-hours": 6.0,
              "out-dir": str(tmp_path / "run")}
    settings = build_settings(values)
    results = simulate(settings)
    days = availability_of(settings.run, 12)
    start = 0.0
    for row in results["methods"]["fedavg"]["rounds"]:
        start += row.get("waited", 0.0)
        assert row["available"] == len(days.available(range(12), start)) > 0
        assert row["clients-trained"] <= min(6, row["available"])
        start = row["sim-time"]


@needs_fashion_mnist
def test_each_method_is_reported_at_the_time_budget(tmp_path):
    """time-budget: each method's last evaluation in a round that ended by then, in
    results.json and under the comparison table."""
    from pflalign.outputs.results import comparison_table

    values = {**RUN, "eval-every": 1, "device-profiles": "lognormal",
              "out-dir": str(tmp_path / "free")}
    free = simulate(build_settings(values))
    rows = free["methods"]["pflalign"]["rounds"]
    budget = (rows[1]["sim-time"] + rows[2]["sim-time"]) / 2  # after round 2, before round 3
    timed = simulate(build_settings({**values, "time-budget": budget,
                                     "out-dir": str(tmp_path / "budget")}))
    at = timed["methods"]["pflalign"]["final"]["at-time-budget"]
    assert at == {"budget": budget, "round": 2, "sim-time": rows[1]["sim-time"],
                  "personal-acc": rows[1]["personal-acc"], "global-acc": rows[1]["global-acc"]}
    table = comparison_table(timed["methods"])
    assert f"At the time budget of {budget:g} simulated s" in table
    assert f"  pflalign: personal-acc {100 * rows[1]['personal-acc']:.2f}%" in table
    early = simulate(build_settings({**values, "time-budget": rows[0]["sim-time"] / 2,
                                     "out-dir": str(tmp_path / "early")}))
    assert "round" not in early["methods"]["fedavg"]["final"]["at-time-budget"]
    assert "fedavg: no evaluation within the budget" in comparison_table(early["methods"])
    with pytest.raises(ConfigError, match="time-budget = 5 .* needs device profiles"):
        build_settings({"time-budget": 5})


# --- availability windows from a trace file ------------------------------------------------------
WINDOWED = ("client,compute,upload,download,windows\n"
            "0,100,1,5,0-8\n1,100,1,5,6-10;20-24\n2,100,1,5,12-13\n")


def test_trace_windows_say_who_can_be_reached_each_hour_of_the_day(tmp_path):
    windows = read_windows(_trace(tmp_path, WINDOWED), 3)
    hour = 3600.0
    assert windows.available([0, 1, 2], 0.0) == [0]
    assert windows.available([2, 1, 0], 7 * hour) == [1, 0]  # in the order asked
    assert windows.available([0, 1, 2], 11 * hour) == []
    assert windows.available([0, 1, 2], (24 + 12.5) * hour) == [2]  # every day again
    # at 11 h nobody: client 2 opens at 12 h; client 0 alone opens at 24 h
    assert windows.next_opening([0, 1, 2], 11 * hour) == 12 * hour
    assert windows.next_opening([0], 11 * hour) == 24 * hour
    assert windows.next_opening([1], 21 * hour) == 21 * hour
    as_json = [{"client": c, "compute": 100, "upload": 1, "download": 5, "windows": w}
               for c, w in enumerate([[[0, 8]], [[6, 10], [20, 24]], [[12, 13]]])]
    again = read_windows(_trace(tmp_path, json.dumps(as_json), "t.json"), 3)
    assert np.array_equal(again.start, windows.start) and np.array_equal(again.end, windows.end)
    assert read_windows(_trace(tmp_path, "client,compute,upload,download\n0,1,1,1\n"), 1) is None


@pytest.mark.parametrize(("window", "message"), [
    ("8-4", r"client 1's window 8-4 is not within the day"),
    ("0-25", r"window 0-25 is not within the day"),
    ("6-10;2-4", r"client 1's windows are out of order or overlap \(one starts at 2 h, before "
                 r"10 h\)"),
    ("6-10;9-12", r"out of order or overlap"),
    ("", r"client 1 has no availability window"),
    ("morning", r"client 1's windows 'morning' are not start-end pairs"),
])
def test_bad_windows_are_one_sentence_before_any_data_is_read(tmp_path, window, message):
    path = _trace(tmp_path, f"client,compute,upload,download,windows\n0,1,1,1,0-24\n"
                            f"1,1,1,1,{window}\n")
    with pytest.raises(ConfigError, match=message):
        build_settings({"device-profiles": path, "num-clients": 2, "availability": "trace"})


def test_trace_availability_needs_a_trace_with_windows_and_windows_need_it(tmp_path):
    with pytest.raises(ConfigError, match="availability = 'trace' reads the windows column of a "
                                          "trace file, and device-profiles = 'lognormal'"):
        build_settings({"device-profiles": "lognormal", "availability": "trace"})
    plain = _trace(tmp_path, "client,compute,upload,download\n0,1,1,1\n1,1,1,1\n")
    with pytest.raises(ConfigError, match="has none: add one"):
        build_settings({"device-profiles": plain, "num-clients": 2, "availability": "trace"})
    windowed = _trace(tmp_path, WINDOWED, "w.csv")
    with pytest.raises(ConfigError, match="has availability windows, and availability = "
                                          "'always': set availability = 'trace'"):
        build_settings({"device-profiles": windowed, "num-clients": 3})


@needs_fashion_mnist
def test_rounds_train_only_the_clients_their_trace_windows_open(tmp_path):
    """Clients 0-2 open 0-12 h, clients 3-5 12-24 h: the first rounds (hours 0..) sample only
    among 0-2 (each round's 3 of them), and every row says 3 were reachable."""
    rows = "".join(f"{c},50,1,5,{'0-12' if c < 3 else '12-24'}\n" for c in range(6))
    path = _trace(tmp_path, "client,compute,upload,download,windows\n" + rows)
    results = simulate(build_settings({**RUN, "methods": "fedavg", "device-profiles": path,
                                       "availability": "trace",
                                       "out-dir": str(tmp_path / "run")}))
    for row in results["methods"]["fedavg"]["rounds"]:
        assert row["sim-time"] < 12 * 3600 and row["available"] == 3
        assert row["clients-trained"] == 3
