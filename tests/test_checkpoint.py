"""Checkpoints and ``resume``: a run killed with SIGKILL and resumed gives exactly the results of
an uninterrupted run; a checkpoint or results.json of another config is refused; the Flower
engine's state query and restored states round-trip through the real ClientApp."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, needs_fashion_mnist
from processes import kill_once

from pflalign.engines.sequential import SequentialEngine
from pflalign.outputs.results import Reporter, slug
from pflalign.process import interrupt
from pflalign.process.interrupt import Interrupted, request_stop
from pflalign.round.checkpoint import Checkpoint, Snapshot, checkpoint_path, entry_fingerprint
from pflalign.run.config import ConfigError, build_settings
from pflalign.run.driver import run_methods

#: fedavg (nothing but the model), scaffold (server state), ditto (client state), pflalign with
#: each client's offset held by the client and by the server
METHODS = ["fedavg", "scaffold", "ditto", "pflalign", 'pflalign(pflalign-state="server")']
#: two clients a round, and a tight update-norm bound, so that which replies are kept depends on
#: the norms accepted in earlier rounds (checkpointed: the bound's reference in such rounds)
TINY = {"engine": "sequential", "num-clients": 6, "max-samples": 1500, "rounds": 4,
        "eval-every": 1, "fraction-train": 0.3, "local-steps": 2, "update-norm-bound": 1.3}

#: runs ``simulate`` on the sequential engine: argv = settings as JSON, then "resume" or not
DRIVER = ("import json, sys\n"
          "from pflalign.run.config import build_settings\n"
          "from pflalign.run.driver import simulate\n"
          "from pflalign.outputs.results import Reporter\n"
          "simulate(build_settings(json.loads(sys.argv[1])), Reporter(quiet=False),\n"
          "         resume=sys.argv[2] == 'resume')\n")


@pytest.fixture(autouse=True)
def _no_stop_left_over():
    interrupt.reset()
    yield
    interrupt.reset()


def comparable(value: object) -> object:
    """``value`` without timings (keys with 'seconds' in their name, and 'started') and the
    run's processes (its pids and peak memory)."""
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items()
                if "seconds" not in k and k not in ("started", "processes", "audit-secret")}
    if isinstance(value, list):
        return [comparable(v) for v in value]
    return value


def run_results(results: dict) -> dict:
    """``results`` without what may differ between two runs of one config: timings, and the
    config keys that change nothing computed (``checkpoint-every``, ``out-dir``)."""
    return comparable({**results, "config": {k: v for k, v in results["config"].items()
                                             if k not in ("checkpoint-every", "out-dir")}})


class _StopAt(Reporter):
    """A quiet reporter that requests a stop when a line starts with ``line_start``, and keeps
    every line."""

    def __init__(self, line_start: str = "\0"):
        super().__init__(quiet=True)
        self.line_start, self.lines = line_start, []

    def info(self, text: str) -> None:
        self.lines.append(text)
        if text.startswith(self.line_start):
            request_stop(signal.SIGINT)


# --- the file ------------------------------------------------------------------------------------
def test_slugs_are_safe_distinct_file_names_and_checkpoints_fall_on_every_nth_round(tmp_path):
    assert slug("fedavg") == "fedavg"
    named = slug('pflalign(pflalign-state="server")')
    assert named.startswith("pflalign-pflalign-state-server") and "/" not in named
    assert named != slug('pflalign(pflalign-state="client")')
    assert checkpoint_path(tmp_path, "fedavg") == tmp_path / "checkpoints" / "fedavg.npz"
    checkpoint = Checkpoint(tmp_path / "x.npz", "fedavg", "f", every=2, rounds=6)
    assert [r for r in range(1, 7) if checkpoint.due(r)] == [2, 4]  # never after the last
    assert not any(Checkpoint(tmp_path / "x.npz", "fedavg", "f", 0, 6).due(r) for r in range(7))


def test_a_snapshot_round_trips_exactly_and_a_foreign_one_is_refused(tmp_path):
    settings = build_settings({**TINY, "methods": "ditto"})
    path = tmp_path / "checkpoints" / "ditto.npz"
    checkpoint = Checkpoint(path, "ditto", entry_fingerprint(settings, "ditto"), 1, 4)
    rng = np.random.default_rng(0)
    snapshot = Snapshot(
        round=2, server={"model/w": rng.normal(size=(3, 2)).astype(np.float32)},
        before_aggregation=None,
        clients={4: {"personal/w": rng.normal(size=3), "count": np.array(7)}, 1: {}},
        rounds=[{"round": 1, "personal-acc": 0.1 + 0.2, "bytes-up": 10}],
        client_results=[{"id": 4, "personal-acc": 1 / 3}], saved_state=[4], last_eval={"x": 1.5},
        rng_arrays={"t": np.arange(5, dtype=np.uint8)}, rng_meta={"numpy": ["MT19937", 1, 0, 0.0]},
        features={"update-bounds": {"norms": {"update": [[0.1 + 0.2, 1e-300], []]}}})
    checkpoint.write(snapshot)
    back = checkpoint.read()
    assert back.round == 2 and back.before_aggregation is None and back.rounds == snapshot.rounds
    assert back.client_results == snapshot.client_results and back.last_eval == {"x": 1.5}
    assert back.features == {"update-bounds": {"norms": {"update": [[0.1 + 0.2, 1e-300], []]}}}
    assert sorted(back.clients) == [1, 4] and back.clients[1] == {}
    for name, value in snapshot.clients[4].items():
        assert back.clients[4][name].dtype == value.dtype
        assert back.clients[4][name].shape == value.shape  # a 0-d array stays 0-d
        assert np.array_equal(back.clients[4][name], value)
    assert np.array_equal(back.server["model/w"], snapshot.server["model/w"])
    # another config of the same entry: one sentence naming the file and the way out
    other = Checkpoint(path, "ditto", entry_fingerprint(settings.replace({"lr": 0.1}), "ditto"),
                       1, 4)
    with pytest.raises(ConfigError, match=r"checkpoint '.*ditto\.npz' was written by a run of "
                                          r"'ditto' with another config"):
        other.read()
    # the keys that change nothing computed are not part of the fingerprint
    assert entry_fingerprint(settings.replace({"checkpoint-every": 9, "out-dir": "/x"}),
                             "ditto") == entry_fingerprint(settings, "ditto")
    checkpoint.remove()
    assert not path.exists() and not path.parent.exists()


@needs_fashion_mnist
def test_a_results_json_or_checkpoint_of_another_config_is_refused(tmp_path):
    settings = build_settings({**TINY, "rounds": 3, "checkpoint-every": 1, "methods": "fedavg",
                         "out-dir": str(tmp_path)})
    with pytest.raises(Interrupted):
        run_methods(settings, SequentialEngine, _StopAt("[fedavg] round   2/3"))
    interrupt.reset()
    assert (tmp_path / "checkpoints" / "fedavg.npz").exists()
    other = settings.replace({"lr": 0.1})
    with pytest.raises(ConfigError, match=r"Cannot resume from '.*results\.json': it was written "
                                          r"with another config \('lr' is 0.05 there and 0.1 "
                                          r"here\)"):
        run_methods(other, SequentialEngine, Reporter(quiet=True), resume=True)
    (tmp_path / "results.json").unlink()
    with pytest.raises(ConfigError, match="was written by a run of 'fedavg' with another config"):
        run_methods(other, SequentialEngine, Reporter(quiet=True), resume=True)
    # the same config (checkpoint-every aside) resumes after round 2, and then removes the file
    reporter = _StopAt()
    results = run_methods(settings.replace({"checkpoint-every": 0}), SequentialEngine, reporter,
                          resume=True)
    assert f"[fedavg] resumed from round 2 (checkpoint {tmp_path}/checkpoints/fedavg.npz)" in \
        reporter.lines
    assert [r["round"] for r in results["methods"]["fedavg"]["rounds"]] == [1, 2, 3]
    assert "interrupted" not in results and not (tmp_path / "checkpoints").exists()


# --- SIGKILL and resume ------------------------------------------------------------------------
def _start(settings: dict, resume: bool, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-c", DRIVER, json.dumps(settings), "resume" if resume else "new"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


def _kill_once_written(proc: subprocess.Popen, target: Path, log: Path) -> None:
    """SIGKILL ``proc`` as soon as the file ``target`` (its checkpoint) exists."""
    kill_once(proc, target.exists, log)


@needs_fashion_mnist
def test_a_run_killed_in_every_entry_and_resumed_gives_exactly_the_uninterrupted_results(
        tmp_path):
    methods = ",".join(METHODS)
    killed = {**TINY, "methods": methods, "checkpoint-every": 2, "out-dir": str(tmp_path / "k")}
    # the reference: an uninterrupted run without checkpoints, in this process
    run_methods(build_settings({**killed, "checkpoint-every": 0, "out-dir": str(tmp_path / "ref")}),
                SequentialEngine, Reporter(quiet=True))
    for i, label in enumerate(METHODS):
        # run (resuming the previous entry killed after its round 2), then kill this entry
        # once its checkpoint after round 2 exists, during round 3 or 4
        proc = _start(killed, resume=i > 0, log=tmp_path / f"run{i}.log")
        target = checkpoint_path(killed["out-dir"], label)
        _kill_once_written(proc, target, tmp_path / f"run{i}.log")
        assert target.exists()
        written = json.loads((tmp_path / "k" / "results.json").read_text()) if i else {}
        assert list(written.get("methods", {})) == METHODS[:i]  # the finished entries
        if i:
            log = (tmp_path / f"run{i}.log").read_text()
            assert f"[{METHODS[i - 1]}] resumed from round 2 (checkpoint " in log, log[-3000:]
            assert all(f"[{m}] finished earlier: kept from results.json." in log
                       for m in METHODS[:i - 1])
    proc = _start(killed, resume=True, log=tmp_path / "last.log")
    assert proc.wait(timeout=300) == 0, (tmp_path / "last.log").read_text()[-3000:]
    assert f"[{METHODS[-1]}] resumed from round 2" in (tmp_path / "last.log").read_text()
    resumed = json.loads((tmp_path / "k" / "results.json").read_text())
    assert not (tmp_path / "k" / "checkpoints").exists()
    assert list(resumed["methods"]) == METHODS
    assert not {"interrupted", "unfinished", "partial"} & set(resumed)
    expected = json.loads((tmp_path / "ref" / "results.json").read_text())
    for label in METHODS:  # identical floats, round by round, client by client
        assert comparable(resumed["methods"][label]) == comparable(expected["methods"][label])
        assert len(resumed["methods"][label]["rounds"]) == 4
    assert run_results(resumed) == run_results(expected)


# --- the Flower engine: state query and restore through the real ClientApp ---------------------
class _InProcessGrid:
    """A Flower Grid whose nodes are the real ClientApp called in this process, each with its
    own Context (node state), as SuperNodes would run it."""

    def __init__(self, num_nodes: int):
        from flwr.app import Context, RecordDict

        self.contexts = {100 + i: Context(run_id=7, node_id=100 + i,
                                          node_config={"partition-id": i}, state=RecordDict(),
                                          run_config={}) for i in range(num_nodes)}
        self.inbox: dict = {}
        self.actions: list[str] = []

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages) -> list[str]:
        for message in messages:
            # as the SuperLink does when it accepts a message
            message.metadata.__dict__["_message_id"] = f"m{time.monotonic_ns()}"
            self.inbox[message.metadata.message_id] = message
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, ids) -> list:
        from clients.app import app

        replies = []
        for mid in ids:
            message = self.inbox.pop(mid)
            self.actions.append(message.metadata.message_type)
            replies.append(app(message, self.contexts[message.metadata.dst_node_id]))
        return replies

    def node_states(self) -> dict[int, dict[str, np.ndarray]]:
        states = {}
        for node, context in self.contexts.items():
            for record in context.state.array_records.values():
                states[node] = {k: a.numpy() for k, a in record.items()}
        return states


@needs_fashion_mnist
def test_the_flower_engines_state_query_and_restore_round_trip_through_the_client_app(
        tmp_path, monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    from strategies.flower import FlowerEngine

    # what a ServerApp process has set when it creates messages (run, node and task ids)
    for name, value in (("_run_id", 7), ("_node_id", 1), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)

    base = {**TINY, "engine": "flower", "num-clients": 4, "rounds": 3, "methods": "pflalign",
            "checkpoint-every": 1}

    def run(out: str, grid: _InProcessGrid, reporter: Reporter, resume: bool = False) -> dict:
        settings = build_settings({**base, "out-dir": str(tmp_path / out)})
        return run_methods(settings, lambda s: FlowerEngine(grid, s, reporter), reporter,
                           resume=resume)

    uninterrupted_grid = _InProcessGrid(4)
    reference = run("ref", uninterrupted_grid, Reporter(quiet=True))
    # a stop requested as round 2 ends: the state query for its checkpoint is interrupted (the
    # Flower engine checks for a stop while it waits), so the checkpoint of round 1 remains
    with pytest.raises(Interrupted):
        run("k", _InProcessGrid(4), _StopAt("[pflalign] round   2/3"))
    interrupt.reset()
    fresh = _InProcessGrid(4)  # new nodes: every client's state is in the checkpoint only
    reporter = _StopAt()
    resumed = run("k", fresh, reporter, resume=True)
    assert any(line.startswith("[pflalign] resumed from round 1") for line in reporter.lines)
    assert comparable(resumed["methods"]) == comparable(reference["methods"])
    assert "query.state" in fresh.actions  # the checkpoint after round 2 asked for the states
    # every node ends with exactly the state it has in the uninterrupted run, shapes included
    expected, got = uninterrupted_grid.node_states(), fresh.node_states()
    assert expected.keys() == got.keys() and expected
    for node, state in expected.items():
        assert state.keys() == got[node].keys()
        for name, value in state.items():
            assert got[node][name].shape == value.shape and got[node][name].dtype == value.dtype
            assert np.array_equal(got[node][name], value), (node, name)


class _CountingStateQueries(SequentialEngine):
    """The sequential engine, recording how many clients each state query asks."""

    asked: list[int] = []

    def exchange(self, action, messages):
        if action == "state":
            _CountingStateQueries.asked.append(len(messages))
        return super().exchange(action, messages)


@needs_fashion_mnist
def test_a_checkpoint_streams_client_states_and_a_resume_reads_them_one_by_one(tmp_path,
                                                                               monkeypatch):
    """States are asked STATE_CHUNK clients at a time and written as they come; a resumed run
    reads each from the file when it sends it back, and ends as the uninterrupted run does."""
    from pflalign.round import checkpoint as rounds
    from pflalign.round.checkpoint import StoredStates

    monkeypatch.setattr(rounds, "STATE_CHUNK", 2)
    settings = build_settings({**TINY, "fraction-train": 1.0, "checkpoint-every": 2,
                               "eval-audit-fraction": 0.0,  # its state queries are not counted
                               "methods": "pflalign", "out-dir": str(tmp_path / "k")})
    reference = run_methods(settings.replace({"checkpoint-every": 0,
                                              "out-dir": str(tmp_path / "ref")}),
                            SequentialEngine, Reporter(quiet=True))
    _CountingStateQueries.asked = []
    with pytest.raises(Interrupted):
        run_methods(settings, _CountingStateQueries, _StopAt("[pflalign] round   3/4"))
    interrupt.reset()
    assert _CountingStateQueries.asked == [2, 2, 2]  # 6 clients with state, 2 per query
    snapshot = Checkpoint.for_entry(settings.run.out_dir, "pflalign", settings).read()
    assert isinstance(snapshot.clients, StoredStates) and sorted(snapshot.clients) == list(range(6))
    assert snapshot.clients[3] and all(isinstance(v, np.ndarray)
                                       for v in snapshot.clients[3].values())
    resumed = run_methods(settings, SequentialEngine, Reporter(quiet=True), resume=True)
    assert comparable(resumed["methods"]) == comparable(reference["methods"])


def _reference_and_resumed(values: dict, label: str, tmp_path: Path) -> tuple[dict, dict]:
    """The entry ``label`` of an uninterrupted in-process run of ``values``, and of the same run
    in a process SIGKILLed once its first checkpoint is written and then resumed."""
    values = {**values, "out-dir": str(tmp_path / "k")}
    reference = run_methods(build_settings({**values, "checkpoint-every": 0,
                                            "out-dir": str(tmp_path / "ref")}),
                            SequentialEngine, Reporter(quiet=True))
    proc = _start(values, resume=False, log=tmp_path / "run.log")
    _kill_once_written(proc, checkpoint_path(values["out-dir"], label), tmp_path / "run.log")
    proc = _start(values, resume=True, log=tmp_path / "last.log")
    assert proc.wait(timeout=300) == 0, (tmp_path / "last.log").read_text()[-3000:]
    assert f"[{label}] resumed from round" in (tmp_path / "last.log").read_text()
    resumed = json.loads((tmp_path / "k" / "results.json").read_text())
    return reference["methods"][label], resumed["methods"][label]


@needs_fashion_mnist
def test_a_run_on_the_simulated_clock_killed_and_resumed_gives_the_uninterrupted_results(
        tmp_path):
    """Profiles, diurnal availability, a deadline and over-selection: the clock (sim-time) goes
    on from the checkpoint's last row, so who is reachable, who is late and every metric are
    those of the uninterrupted run."""
    systems = {**TINY, "methods": "pflalign", "rounds": 5, "checkpoint-every": 2,
               "device-profiles": "lognormal", "availability": "diurnal",
               "available-hours": 12.0, "round-deadline": 9.0, "over-selection": 1.5}
    reference, resumed = _reference_and_resumed(systems, "pflalign", tmp_path)
    assert reference["rounds"][-1]["sim-time"] > 0
    assert all("available" in r for r in reference["rounds"])
    assert comparable(resumed) == comparable(reference)


@needs_fashion_mnist
def test_an_asynchronous_run_killed_and_resumed_gives_the_uninterrupted_results(tmp_path):
    """mode = async: the clients in flight, their replies, the models they trained from and the
    dispatch count are in the checkpoint, so the resumed run delivers the same arrivals in the
    same order, with the same staleness, to the bit (pFLAlign with server-held offsets: the
    server's state holds them too)."""
    systems = {**TINY, "methods": 'pflalign(pflalign-state="server")', "rounds": 5,
               "checkpoint-every": 2, "mode": "async", "device-profiles": "lognormal",
               "concurrency": 4, "buffer-size": 2, "fraction-train": 0.5}
    reference, resumed = _reference_and_resumed(systems, 'pflalign(pflalign-state="server")',
                                                tmp_path)
    assert max(r["staleness-max"] for r in reference["rounds"]) >= 1
    assert comparable(resumed) == comparable(reference)


@needs_fashion_mnist
def test_a_run_with_central_dp_killed_and_resumed_gives_the_uninterrupted_results(tmp_path):
    """dp = central with an adaptive clip under Poisson sampling: the clip and the accountant's
    history are in the checkpoint and the noise is keyed by (seed, round), so the resumed run
    draws the same clients and noise, moves the clip the same way and reports the same epsilon."""
    private = {**TINY, "methods": "fedavg", "rounds": 4, "checkpoint-every": 2, "seed": 4,
               "sampling": "poisson", "dp": "central", "dp-clipping": "adaptive",
               "dp-clip": 0.5, "dp-noise-multiplier": 0.002}
    reference, resumed = _reference_and_resumed(private, "fedavg", tmp_path)
    rows = reference["rounds"]
    assert len({r["dp-clip"] for r in rows}) == 4
    assert rows[-1]["dp-epsilon"] > rows[0]["dp-epsilon"]
    assert comparable(resumed) == comparable(reference)


def test_a_run_written_before_a_key_existed_resumes_at_the_keys_old_behaviour(tmp_path):
    """results.json of a run stopped before eval-at-start existed (the key absent from its
    config): it resumes at eval-at-start = false, the value that computes what it did, and is
    refused at true."""
    settings = build_settings({**TINY, "rounds": 3, "checkpoint-every": 1, "methods": "fedavg",
                               "out-dir": str(tmp_path)})
    with pytest.raises(Interrupted):
        run_methods(settings, SequentialEngine, _StopAt("[fedavg] round   2/3"))
    interrupt.reset()
    path = tmp_path / "results.json"
    old = json.loads(path.read_text())
    del old["config"]["eval-at-start"]
    path.write_text(json.dumps(old))
    with pytest.raises(ConfigError, match=r"\('eval-at-start' is absent there and True here\)"):
        run_methods(settings.replace({"eval-at-start": True}), SequentialEngine,
                    Reporter(quiet=True), resume=True)
    reporter = _StopAt()
    results = run_methods(settings, SequentialEngine, reporter, resume=True)
    assert any("resumed from round 2" in line for line in reporter.lines)
    assert [r["round"] for r in results["methods"]["fedavg"]["rounds"]] == [1, 2, 3]
