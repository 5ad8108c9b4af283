"""Every process's peak memory in results.json: each training and evaluation reply carries the
process metrics of the process that computed it (host id, pid, peak resident memory), the
reply schema bounds them, the audit never compares them, and a method entry's ``processes``
lists the server and each client process with its largest peak; no row or metric changes."""

from __future__ import annotations

import itertools
import json
import os
import re

import pytest
from conftest import needs_fashion_mnist
from harness import method_settings, server, train_metrics
from test_reply_schema import INITIAL

from pflalign.engines import host
from pflalign.process.memory import host_id, peak_rss_mb
from pflalign.run.config import build_settings
from pflalign.run.driver import simulate
from pflalign.server.validation import ClientFailure, ReplyValidator
from pflalign.wire.messages import Reply
from pflalign.wire.protocol import (
    EVALUATE,
    MODEL,
    PROCESS_HOST,
    PROCESS_ID,
    PROCESS_METRICS,
    PROCESS_PEAK_RSS_MB,
    TRAIN,
    process_metrics,
)
from scripts.compare_results import compare

TINY = {"num-clients": 4, "num-unseen-clients": 0, "max-samples": 400, "rounds": 1,
        "eval-every": 1, "fraction-train": 1.0, "local-steps": 2, "methods": "fedavg",
        "engine": "sequential", "seed": 1}


def _rss_mb() -> float:
    """This process's resident memory now, in MiB (``VmRSS`` of /proc/self/status)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("/proc/self/status has no VmRSS line")


def _no_process_metric_in_a_row(entry: dict) -> None:
    for row in [*entry["rounds"], entry["final"], *entry["clients"]]:
        assert not any(key.startswith("process-") or "rss" in key for key in row), row


# --- a run ------------------------------------------------------------------------------------


def test_the_peak_is_read_at_most_every_half_second_unless_fresh(monkeypatch):
    from pflalign.process import memory

    reads = []

    class Usage:
        ru_maxrss = 2048

    def getrusage(who):
        reads.append(who)
        return Usage

    monkeypatch.setattr(memory.resource, "getrusage", getrusage)
    monkeypatch.setattr(memory, "_last_read", [-float("inf"), 0.0])
    clock = [100.0]
    monkeypatch.setattr(memory.time, "monotonic", lambda: clock[0])
    linux = memory.sys.platform != "darwin"
    assert peak_rss_mb() == (2.0 if linux else 2048 / 2**20) and len(reads) == 1
    Usage.ru_maxrss = 4096
    clock[0] += 0.49  # within PEAK_READ_EVERY: the last read
    assert peak_rss_mb() == (2.0 if linux else 2048 / 2**20) and len(reads) == 1
    assert peak_rss_mb(fresh=True) == (4.0 if linux else 4096 / 2**20) and len(reads) == 2
    clock[0] += 0.5
    Usage.ru_maxrss = 8192
    assert peak_rss_mb() == (8.0 if linux else 8192 / 2**20) and len(reads) == 3


@needs_fashion_mnist
def test_a_sequential_run_lists_its_one_process_as_server_and_clients(tmp_path):
    # a peak is at least any earlier resident size (not a later one: writing results.json after
    # the entry's peak was measured may take this process above it)
    rss_before = _rss_mb()
    results = simulate(build_settings({**TINY, "out-dir": str(tmp_path)}))
    written = json.loads((tmp_path / "results.json").read_text())
    entry = written["methods"]["fedavg"]
    assert entry["processes"] == results["methods"]["fedavg"]["processes"]
    server_entry, *clients = entry["processes"]
    assert set(server_entry) == {"role", "host", "pid", "peak-rss-mb"}
    assert server_entry["role"] == "server" and server_entry["pid"] == os.getpid()
    assert server_entry["host"] == host_id()
    assert rss_before <= server_entry["peak-rss-mb"] <= peak_rss_mb(fresh=True)
    # the clients ran in this process: one client process, the server's, 4 trainings and 4
    # evaluations, its peak reported before the server's was measured
    assert clients == [{"role": "clients", "host": host_id(), "pid": os.getpid(),
                        "peak-rss-mb": clients[0]["peak-rss-mb"], "replies": 8}]
    assert 0 < clients[0]["peak-rss-mb"] <= server_entry["peak-rss-mb"]
    _no_process_metric_in_a_row(entry)


@needs_fashion_mnist
def test_the_audit_compares_no_process_metric_and_the_list_keeps_each_claim(tmp_path,
                                                                            monkeypatch):
    """Every reply (and the server's recomputation of it) claims another process: every reply
    is audited, none is rejected, and each claim is one client process of the list; the rows
    are those of the honest run."""
    honest = simulate(build_settings({**TINY, "out-dir": str(tmp_path / "honest"),
                                      "eval-audit-fraction": 1.0, "train-audit-fraction": 1.0}))
    counter = itertools.count(1000)

    def another_process() -> dict:
        n = next(counter)
        return {PROCESS_HOST: 7, PROCESS_ID: n, PROCESS_PEAK_RSS_MB: float(n)}

    monkeypatch.setattr(host, "process_metrics", another_process)
    claimed = simulate(build_settings({**TINY, "out-dir": str(tmp_path / "claimed"),
                                       "eval-audit-fraction": 1.0,
                                       "train-audit-fraction": 1.0}))
    (row,) = claimed["methods"]["fedavg"]["rounds"]
    assert row["train-audited"] == 4 and row["train-audit-rejected"] == 0
    assert row["eval-audited"] == 4 and row["eval-audit-rejected"] == 0
    assert row["rejected"] == 0 and row["eval-rejected"] == 0
    clients = claimed["methods"]["fedavg"]["processes"][1:]
    assert len(clients) == 8 and {c["host"] for c in clients} == {7}
    assert [c["pid"] for c in clients] == sorted(c["pid"] for c in clients)
    assert all(c["peak-rss-mb"] == c["pid"] and c["replies"] == 1 for c in clients)
    differences, compared = compare(honest, claimed)
    assert differences == [] and compared > 20


# --- the schema, by hand ----------------------------------------------------------------------


def _validator(name: str) -> tuple[object, ReplyValidator]:
    settings = method_settings(name, {"num-clients": 3, "methods": name})
    method, runtime, _ = server(name, settings, 3, INITIAL, tuple(INITIAL))
    runtime.num_classes = 10
    return method, ReplyValidator(runtime, lambda text: None)


def _validate(action: str, name: str = "fedavg", **process: float) -> dict:
    method, validator = _validator(name)
    if action == TRAIN:
        reply = Reply(0, "client 0", metrics={**train_metrics(0), **process},
                      arrays={MODEL: dict(INITIAL)})
        return validator.validate(reply, {MODEL: validator.server.flat},
                                  method.reply_metrics(TRAIN))[0]
    reply = Reply(0, "client 0", metrics={"partition-id": 0, "num-test": 5,
                                          "personal-correct": 3, "personal-loss": 0.7,
                                          "global-correct": 2, "global-loss": 0.9, **process})
    return validator.validate(reply, {}, method.reply_metrics(EVALUATE))[0]


@pytest.mark.parametrize("action", [TRAIN, EVALUATE])
def test_honest_process_metrics_pass_and_are_optional(action):
    honest = process_metrics()
    assert set(honest) == set(PROCESS_METRICS)
    assert honest[PROCESS_ID] == os.getpid() and honest[PROCESS_PEAK_RSS_MB] > 0
    assert {k: _validate(action, **honest)[k] for k in PROCESS_METRICS} == honest
    assert not set(PROCESS_METRICS) & set(_validate(action))  # a reply without them passes
    if action == TRAIN:  # pFLAlign's GENIE variant leaves out its own training metrics only
        assert _validate(action, "pflalign-genie", **honest)[PROCESS_ID] == os.getpid()


@pytest.mark.parametrize("action", [TRAIN, EVALUATE])
@pytest.mark.parametrize("key,value,expected", [
    (PROCESS_PEAK_RSS_MB, 1e300, "expected 0 .. 1e+08"),
    (PROCESS_PEAK_RSS_MB, -1.0, "expected 0 .. 1e+08"),
    (PROCESS_PEAK_RSS_MB, float("nan"), "non-finite or non-scalar"),
    (PROCESS_PEAK_RSS_MB, float("inf"), "non-finite or non-scalar"),
    (PROCESS_ID, 2.5, "expected an integer"),
    (PROCESS_ID, -1, "expected 0 .. 4.29497e+09"),
    (PROCESS_HOST, 2.0**40, "expected 0 .. 4.29497e+09"),
])
def test_process_metrics_outside_their_range_are_rejected(action, key, value, expected):
    with pytest.raises(ClientFailure, match=f"^client 0 .*{re.escape(expected)}"):
        _validate(action, **{**process_metrics(), key: value})


def test_compare_results_skips_the_processes():
    def results(pid: int) -> dict:
        entry = {"rounds": [{"round": 1, "personal-acc": 0.5}], "final": {}, "clients": [],
                 "processes": [{"role": "server", "host": 1, "pid": pid, "peak-rss-mb": 1.5}]}
        return {"config": {}, "methods": {"m": entry}}

    assert compare(results(1), results(2)) == ([], 2)
