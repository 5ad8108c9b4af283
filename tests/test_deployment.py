"""Integration (slow, about 3-4 minutes on 2 cores): real Flower deployments on 127.0.0.1.

``scripts/deploy_local.sh`` starts a SuperLink with TLS and SuperNode authentication and three
SuperNodes, each with its own partition file and state directory; a 2-round pFLAlign run goes
through ``flwr run``; in the middle of it SuperNode 1 is stopped (by its recorded PID) and started
again with the same state directory and key. The node must resume exactly the state it saved
(the state file's SHA-256 at the kill is the one it logs when it loads it), take part in the rest
of the run, and the run must complete with results.json equal, bit for bit, to an in-process run
of the same config in which client 1 only misses the rounds it was down for. Every process is
stopped by its recorded PID, even when the test fails.

The second test deploys a (tiny, randomly initialized) language model with LoRA adapters on
three SuperNodes for one round, each holding only its role's token windows: every node loads the
model's files on its first message only and maps its float32 copy on the other, only adapters
travel, and results.json equals the in-process run's bit for bit.

Deselect with ``pytest -m "not deployment"``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, needs_fashion_mnist

SCRIPT = ROOT / "scripts" / "deploy_local.sh"
ROUNDS = 2
CONFIG = ["--set", "num-clients=3", "--set", "max-samples=3000", "--set", "seed=1"]

pytestmark = [
    pytest.mark.deployment,
    pytest.mark.skipif(not all(shutil.which(t) for t in ("openssl", "ssh-keygen", "setsid")),
                       reason="needs openssl, ssh-keygen and setsid"),
]


def _free_ports(count: int) -> int:
    """A base port such that base .. base + count - 1 are all free on 127.0.0.1."""
    rng = random.Random(os.getpid())
    for _ in range(200):
        base = rng.randrange(40000, 60000)
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free ports")


def _wait_until(condition, timeout: float, what: str, run: subprocess.Popen | None = None,
                log: Path | None = None):
    """Wait for ``condition``; fail when ``run`` ends first or time is up, with ``log``'s tail."""
    deadline = time.monotonic() + timeout
    while not condition():
        tail = "" if log is None else "\n" + log.read_text(errors="ignore")[-4000:]
        if run is not None and run.poll() is not None:
            raise AssertionError(f"the run ended (exit {run.returncode}) before {what}{tail}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{tail}")
        time.sleep(0.5)


def _processes_mentioning(text: str) -> list[str]:
    """Live processes whose command line contains ``text`` (read from /proc; nothing is killed)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="ignore")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found


def _reference_run(run_config: Path, out: Path, missed: set[int]) -> dict:
    """The run of ``run_config`` on the sequential engine, in this process, with client 1's
    training failing in the rounds ``missed`` (as a node that is down does)."""
    import tomllib

    import pflalign.engines.sequential as sequential
    from pflalign.outputs.results import Reporter
    from pflalign.run.config import build_settings
    from pflalign.run.driver import run_methods

    settings = build_settings({**tomllib.loads(run_config.read_text()), "out-dir": str(out),
                         "engine": "sequential"})
    real_handle = sequential.handle

    def handle(action, settings_, cid, config, *rest, **kwargs):
        if cid == 1 and action == "train" and int(config["server-round"]) in missed:
            raise RuntimeError("node 1 is down")
        return real_handle(action, settings_, cid, config, *rest, **kwargs)

    sequential.handle = handle
    try:
        run_methods(settings, sequential.SequentialEngine, Reporter(quiet=True))
    finally:
        sequential.handle = real_handle
    return json.loads((out / "results.json").read_text())


def _compare(before: dict, after: dict) -> tuple[list[str], int]:
    """scripts/compare_results.py's comparison (every metric bit for bit, wall clock aside)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("compare_results",
                                                  ROOT / "scripts" / "compare_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compare(before, after)


def _environment() -> dict[str, str]:
    """This environment, with the interpreter's folder (flwr, flower-superlink) first on PATH."""
    return dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])


def _script(work: Path, env: dict[str, str], *args: str, timeout: float
            ) -> subprocess.CompletedProcess:
    """``deploy_local.sh ARGS --workdir WORK``, which must succeed."""
    result = subprocess.run(["bash", str(SCRIPT), *args, "--workdir", str(work)],
                            capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert result.returncode == 0, (f"deploy_local.sh {' '.join(args)} failed:\n"
                                    f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


@needs_fashion_mnist
def _nodes_kept_their_models(work, method: dict) -> None:
    """save-models on SuperNodes: each node saved its own personal model in its node directory
    (none went to the server), and it scores its client exactly as the run did; the server
    saved the global model."""
    from pflalign.data.node import node_data_from_file
    from pflalign.run.models import entry_settings, load_model
    from pflalign.training.loops import evaluate

    assert method["models"]["on-node"] == 3 and method["models"]["clients"] == 0
    assert method["models"]["global"]
    finals = {c["id"]: c["personal-acc"] for c in method["clients"]}
    for i in range(3):
        model = load_model(work / f"node-{i}" / "state" / f"node-{i}", "pflalign", i)
        node = node_data_from_file(str(work / "partitions" / f"client-{i}.npz"),
                                   entry_settings(model.manifest), i)
        stats = evaluate(model.module, node.data.test_x, node.data.test_y, model.inputs)
        assert stats.correct / stats.count == finals[i]


@pytest.mark.slow
def test_deployment_with_tls_auth_and_a_restarted_node(tmp_path):
    work = tmp_path / "deploy"
    out = tmp_path / "out"
    port = _free_ports(4)  # the SuperLink's, then one per SuperNode
    node_port = port + 1
    env = _environment()

    def script(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return _script(work, env, *args, timeout=timeout)

    node_log = work / "logs" / "node-1.log"
    state_dir = work / "node-1" / "state"
    run = run_log = None
    started = time.monotonic()
    try:
        script("start", "--auth", "--nodes", "3", "--port", str(port), "--node-port",
               str(node_port), *CONFIG)
        pids = {p.stem: int(p.read_text()) for p in (work / "pids").glob("*.pid")}
        assert set(pids) == {"superlink", "node-0", "node-1", "node-2"}
        assert (work / "flwr-home" / "config.toml").read_text().count("root-certificates") == 1
        assert sorted(p.name for p in (work / "partitions").glob("client-*.npz")) == [
            "client-0.npz", "client-1.npz", "client-2.npz"]

        run_log = open(tmp_path / "run.log", "w")  # noqa: SIM115 (closed in finally)
        run = subprocess.Popen(
            ["bash", str(SCRIPT), "run", "--workdir", str(work), "--rounds", str(ROUNDS),
             "--methods", "pflalign", "--set", f"eval-every={ROUNDS}", "--set",
             "fraction-train=1.0", "--out", str(out)],
            stdout=run_log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)

        def trained_and_replied() -> bool:
            # node 1 saved its state after round 1 and has sent that train reply, and the server
            # has every round-1 reply (a node stopped before the ServerApp pulled its reply is
            # reported unavailable in its place): it is idle
            text = node_log.read_text(errors="ignore") if node_log.exists() else ""
            sent = text.find("Sent successfully", text.find("Sending: train message"))
            server = (tmp_path / "run.log").read_text(errors="ignore")
            return ("Sending: train message" in text and sent >= 0 and any(
                state_dir.glob("state-*.npz")) and f"round   1/{ROUNDS}" in server)

        _wait_until(trained_and_replied, 300, "node 1's first training", run,
                    tmp_path / "run.log")
        script("kill-node", "1")
        with pytest.raises(ProcessLookupError):
            os.kill(pids["node-1"], 0)
        state_files = list(state_dir.glob("state-*.npz"))
        assert len(state_files) == 1
        saved = hashlib.sha256(state_files[0].read_bytes()).hexdigest()
        restart_at = node_log.stat().st_size
        script("start-node", "1")
        assert int((work / "pids" / "node-1.pid").read_text()) != pids["node-1"]

        run.wait(timeout=480)
        log = (tmp_path / "run.log").read_text()
        assert run.returncode == 0, log[-5000:]
        results = json.loads((out / "results.json").read_text())
        method = results["methods"]["pflalign"]
        assert [r["round"] for r in method["rounds"]] == list(range(1, ROUNDS + 1))
        assert method["final"]["evaluated"] == 3, method["final"]
        assert sorted(c["id"] for c in method["clients"]) == [0, 1, 2]

        # the restarted node loaded exactly the state it had saved before it was stopped
        after = node_log.read_text(errors="ignore")[restart_at:]
        assert (f"client 1 resumed the state of 'pflalign' from {state_files[0]} (saved after "
                f"round 1, sha256 {saved})") in after, after[-3000:]

        # ... and continued exactly: the run equals, bit for bit, an in-process run of the same
        # config in which client 1 merely misses the rounds it missed while it was down
        missed = {r["round"] for r in method["rounds"] if r.get("failures")}
        assert missed <= set(range(2, ROUNDS + 1)), method["rounds"]  # stopped after round 1
        (run_config,) = (work / "runs").glob("*/run-config.toml")
        reference = _reference_run(run_config, tmp_path / "reference", missed)
        differences, compared = _compare(reference, results)
        assert compared > 50 and not differences, differences
        _nodes_kept_their_models(work, method)
        print(f"deployment test: {time.monotonic() - started:.0f}s; rounds:",
              [(r["round"], r.get("failures"), round(r["round-seconds"], 1))
               for r in method["rounds"]])
    finally:
        if run is not None and run.poll() is None:
            os.killpg(run.pid, signal.SIGTERM)  # the `run` command we started, and its flwr run
            run.wait(timeout=30)
        if run_log is not None:
            run_log.close()
        _stop(work, env)
    _nothing_left(work, port)
    assert not list((work / "pids").glob("*.pid"))


@needs_fashion_mnist
@pytest.mark.slow
def test_bad_nodes_leave_the_run_and_a_killed_run_stops_what_it_started(tmp_path):
    """On a deployment with TLS and SuperNode authentication (three SuperNodes): a fourth node
    claiming client 0's id and a frozen node at discovery, then a run killed after its first
    round. About 2.5 minutes."""
    work = tmp_path / "deploy"
    port = _free_ports(4)
    env = _environment()
    try:
        _script(work, env, "start", "--auth", "--nodes", "3", "--port", str(port),
                "--node-port", str(port + 1), *CONFIG, timeout=180)
        pids = {p.stem: int(p.read_text()) for p in (work / "pids").glob("*.pid")}
        _bad_nodes_leave_the_run(work, env, pids["node-2"], port, tmp_path)
        _a_killed_run_stops_what_it_started(work, env, pids["superlink"], port, tmp_path)
    finally:
        _stop(work, env)
    _nothing_left(work, port)


def _stop(work: Path, env: dict[str, str]) -> None:
    """``deploy_local.sh stop`` for the deployment in ``work``, if one was started."""
    if (work / "pids").exists():
        subprocess.run(["bash", str(SCRIPT), "stop", "--workdir", str(work)],
                       capture_output=True, timeout=120, cwd=ROOT, env=env)


def _nothing_left(work: Path, port: int) -> None:
    """No process of the deployment in ``work`` (or a ServerApp of its SuperLink) still runs."""
    deadline = time.monotonic() + 20
    while (left := _processes_mentioning(str(work))) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left
    assert not _serverapps(port)


def _serverapps(port: int) -> list[str]:
    """The ServerApp processes that talk to the SuperLink on ``port``."""
    return [p for p in _processes_mentioning("flwr-serverapp")
            if f"127.0.0.1:{port} " in p + " "]


def _a_killed_run_stops_what_it_started(work: Path, env: dict[str, str], superlink: int,
                                        port: int, tmp_path: Path) -> None:
    """SIGTERM to `deploy_local.sh run` (the script alone, as a terminal's Ctrl-C or a
    supervisor's stop would reach it) stops its `flwr run` and the run's ServerApp on the
    SuperLink, which stays up for the next run."""
    log_path = tmp_path / "killed-run.log"
    with open(log_path, "w") as log:
        run = subprocess.Popen(
            ["bash", str(SCRIPT), "run", "--workdir", str(work), "--rounds", "50", "--methods",
             "pflalign", "--out", str(tmp_path / "killed-out")],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        try:
            _wait_until(lambda: "round   1/50" in log_path.read_text(errors="ignore")
                        and _serverapps(port), 180, "the killed run's first round", run, log_path)
            os.kill(run.pid, signal.SIGTERM)
            assert run.wait(timeout=60) == 143
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGTERM)
                run.wait(timeout=60)
    text = log_path.read_text(errors="ignore")
    assert "stopped flwr run (PID" in text and "on the SuperLink" in text, text[-3000:]
    assert "no ServerApp runs on the SuperLink" in text, text[-3000:]
    assert not _serverapps(port)
    assert not [p for p in _processes_mentioning("flwr run") if str(work) in p]
    assert not (work / "pids" / "flwr-run.pid").exists()
    os.kill(superlink, 0)  # the SuperLink is still up


def _bad_nodes_leave_the_run(work: Path, env: dict[str, str], node_2: int, port: int,
                             tmp_path: Path) -> None:
    """Real SuperNodes at discovery. A fourth node with a registered key of its own claims
    client 0's partition-id, and node 2 is frozen (SIGSTOP: connected, but it answers nothing).
    With ids self-declared (node-keys empty for that run), both nodes claiming 0 are left out
    and named, so is node 2, and the run finishes with client 1. With each id bound to its
    node's key (the deployment's node-keys), the fourth node's proof fails, it alone is left out,
    and the run has clients 0, 1 and 2."""
    key = work / "keys" / "intruder"
    subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-b", "384", "-N", "", "-f", str(key)],
                   check=True, timeout=30)
    subprocess.run(["flwr", "supernode", "register", f"{key}.pub", "pflalign-local"], check=True,
                   capture_output=True, timeout=60, cwd=ROOT,
                   env={**env, "FLWR_HOME": str(work / "flwr-home")})
    node_log = tmp_path / "intruder.log"
    node_config = (f"partition-id=0 num-partitions=3 auth-key='{key}' "
                   f"data-path='{work / 'partitions' / 'client-0.npz'}'")
    with open(node_log, "w") as log:
        intruder = subprocess.Popen(
            ["flower-supernode", "--root-certificates", str(work / "certs" / "ca.crt"),
             "--superlink", f"127.0.0.1:{port}", "--port", str(_free_ports(1)),
             "--auth-supernode-private-key", str(key), "--node-config", node_config],
            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True,
            env={**env, "FLWR_HOME": str(tmp_path / "intruder-home")})
    quick = ["--rounds", "1", "--methods", "fedavg", "--set", "discovery-timeout=15", "--set",
             "round-timeout=15"]
    try:
        _wait_until(lambda: "SuperNode ID" in node_log.read_text(errors="ignore"), 120,
                    "the fourth node to connect")
        os.kill(node_2, signal.SIGSTOP)
        try:
            unbound = _script(work, env, "run", *quick, "--set", "node-keys=", "--out",
                              str(tmp_path / "unbound"), timeout=300).stdout
        finally:
            os.kill(node_2, signal.SIGCONT)
        # no node is frozen now: the default timeouts (a loaded machine starts a node's
        # flwr-clientapp for discovery in more than 15 s)
        bound = _script(work, env, "run", "--rounds", "1", "--methods", "fedavg", "--out",
                        str(tmp_path / "bound"), timeout=600).stdout
    finally:
        os.killpg(intruder.pid, signal.SIGTERM)
        intruder.wait(timeout=30)
    assert "all report partition-id 0; none of them is used" in unbound, unbound[-3000:]
    assert re.search(r"Node \d+ is not used: it did not answer discovery within 15 s",
                     unbound), unbound[-3000:]
    assert ("No node answered discovery for client ids [0, 2]; the run goes on with the other 1 "
            "of 3 clients.") in unbound, unbound[-3000:]
    method = json.loads((tmp_path / "unbound" / "results.json").read_text())["methods"]["fedavg"]
    assert [c["id"] for c in method["clients"]] == [1]
    assert re.search(r"Node \d+ is not used for partition-id 0: its proof does not verify "
                     r"against the key bound to partition-id 0", bound), bound[-3000:]
    assert "No node answered discovery" not in bound and "all report" not in bound
    method = json.loads((tmp_path / "bound" / "results.json").read_text())["methods"]["fedavg"]
    assert [c["id"] for c in method["clients"]] == [0, 1, 2]



@needs_fashion_mnist
@pytest.mark.slow
def test_asynchronous_rounds_on_supernodes_do_not_wait_for_a_frozen_node(tmp_path):
    """``mode = async`` in real time (no device profiles) on three real SuperNodes: the client
    the server dispatches first has its SuperNode frozen (SIGSTOP on its process group, the
    ClientApp it may have started included) right after discovery, with round-timeout far above
    the run's length. The run pushes its messages (``Grid.push_messages``) and aggregates the
    replies as they are pulled (``pull_messages``), one at a time, so all 6 aggregations happen,
    each of one update, while that node is still frozen, and the run ends without it: the frozen
    client is in flight at the end (left out of the evaluation, ``eval-busy``) or was reported
    lost by the SuperLink (a failure), never aggregated. About 2 minutes."""
    from pflalign.server.buffered import draw_client

    work = tmp_path / "deploy"
    out = tmp_path / "out"
    port = _free_ports(4)
    env = _environment()
    frozen = draw_client([0, 1, 2], seed=1, draw=0)  # CONFIG's seed: the first dispatch
    run = run_log = node = None
    try:
        _script(work, env, "start", "--nodes", "3", "--port", str(port), "--node-port",
                str(port + 1), *CONFIG, timeout=180)
        node = int((work / "pids" / f"node-{frozen}.pid").read_text())
        run_log = open(tmp_path / "run.log", "w")  # noqa: SIM115 (closed in finally)
        started = time.monotonic()
        run = subprocess.Popen(
            ["bash", str(SCRIPT), "run", "--workdir", str(work), "--rounds", "6", "--methods",
             "fedavg", "--set", "mode=async", "--set", "concurrency=2", "--set", "buffer-size=1",
             "--set", "eval-every=6", "--set", "round-timeout=900", "--out", str(out)],
            stdout=run_log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        _wait_until(lambda: "asynchronous: 2 clients in flight" in (
            tmp_path / "run.log").read_text(errors="ignore"), 300, "discovery", run,
            tmp_path / "run.log")
        os.killpg(node, signal.SIGSTOP)
        run.wait(timeout=600)
        seconds = time.monotonic() - started
        log = (tmp_path / "run.log").read_text()
        assert run.returncode == 0, log[-5000:]
        assert (Path("/proc") / str(node) / "stat").read_text().rsplit(")", 1)[1].split()[0] \
            == "T", "the frozen node was not stopped until the end"
        assert seconds < 900
        method = json.loads((out / "results.json").read_text())["methods"]["fedavg"]
        rows = method["rounds"]
        assert [r["round"] for r in rows] == list(range(1, 7))
        assert all(r["clients-trained"] == 1 for r in rows), rows
        lost = sum(r.get("failures", 0) for r in rows)
        assert method["final"].get("eval-busy") == 1 or lost >= 1, (method["final"], rows)
        assert frozen not in {c["id"] for c in method["clients"]}
        print(f"async deployment: {seconds:.0f} s; frozen client {frozen};",
              [(r["round"], r["arrivals"], r.get("failures"), round(r["round-seconds"], 1))
               for r in rows])
    finally:
        if node is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node, signal.SIGCONT)
        if run is not None and run.poll() is None:
            os.killpg(run.pid, signal.SIGTERM)
            run.wait(timeout=30)
        if run_log is not None:
            run_log.close()
        _stop(work, env)
    _nothing_left(work, port)


LM_ROUNDS = 1


@pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                    reason="the [text] extra (transformers, peft) is not installed")
@pytest.mark.slow
def test_a_language_model_deployment_loads_the_base_once_per_node(tmp_path):
    from test_shakespeare import PLAYS
    from tiny_lm import write_tiny_lm

    plays = tmp_path / "plays"
    plays.mkdir()
    for name, text in PLAYS.items():
        (plays / name).write_text(text, encoding="utf-8")
    model = write_tiny_lm(tmp_path / "tiny-lm", PLAYS.values())
    config = tmp_path / "lm.toml"
    config.write_text(
        f'dataset = "shakespeare"\ndata-root = "{plays}"\nmodel = "hf:{model}"\n'
        'partition = "natural"\nsequence-length = 16\nmin-samples-per-client = 20\n'
        'num-clients = 3\nfraction-train = 1.0\nbatch-size = 4\nlocal-steps = 3\nlr = 0.5\n'
        'eval-every = 1\nseed = 2\nlora-rank = 4\n')
    work, out = tmp_path / "deploy", tmp_path / "out"
    port = _free_ports(4)
    env = _environment()

    def script(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return _script(work, env, *args, timeout=timeout)

    try:
        script("start", "--nodes", "3", "--port", str(port), "--node-port", str(port + 1),
               "--config", str(config))
        script("run", "--rounds", str(LM_ROUNDS), "--methods", "pflalign", "--out", str(out))
        results = json.loads((out / "results.json").read_text())
    finally:
        if (work / "pids").exists():
            subprocess.run(["bash", str(SCRIPT), "stop", "--workdir", str(work)],
                           capture_output=True, timeout=120, cwd=ROOT, env=env)
    method = results["methods"]["pflalign"]
    assert [r["round"] for r in method["rounds"]] == list(range(1, LM_ROUNDS + 1))
    assert method["final"]["evaluated"] == 3
    for i in range(3):
        # each message is a new flwr-clientapp process: the first reads the model's files and
        # writes the node's copy, every later one maps that copy
        log = (work / "logs" / f"node-{i}.log").read_text(errors="ignore")
        copy = work / f"node-{i}" / "state" / "models"
        assert log.count(f"pflalign: loaded model hf:{model} from its files and wrote a float32 "
                         f"copy to {copy}") == 1, log[-3000:]
        # the train and evaluate messages of every round, the first of them aside
        assert log.count(f"pflalign: mapped the node's float32 copy of model hf:{model}") == (
            2 * LM_ROUNDS - 1), log[-3000:]
    # only adapters travel: the bytes up per client and round are the adapters' float32 size
    adapters = results["language-model"]["adapter-values"]
    assert adapters == 2 * ((4 * 32 + 32 * 4) + (4 * 32 + 16 * 4))
    assert {r["bytes-up"] // r["clients-trained"] for r in method["rounds"]} <= set(
        range(4 * adapters, 4 * adapters + 4096))
    (run_config,) = (work / "runs").glob("*/run-config.toml")
    reference = _reference_run(run_config, tmp_path / "reference", set())
    differences, compared = _compare(reference, results)
    assert compared > 30 and not differences, differences


@needs_fashion_mnist
@pytest.mark.slow
def test_local_dp_on_supernodes_sends_the_server_only_clipped_noised_updates(tmp_path):
    """``dp = local`` on three real SuperNodes: every training reply that reaches the ServerApp
    (``record-uploads``, written as it arrives, before any check) is the model the server sent
    plus an update of norm at most ``dp-clip`` plus that client's own noise for that round,
    regenerated here from (seed, round, client): the ClientApp privatized it before it left the
    node. About a minute."""
    from test_privacy import assert_uploads_clipped_and_noised

    work = tmp_path / "deploy"
    out = tmp_path / "out"
    port = _free_ports(4)
    env = _environment()
    try:
        _script(work, env, "start", "--nodes", "3", "--port", str(port), "--node-port",
                str(port + 1), *CONFIG, timeout=180)
        result = subprocess.run(
            ["bash", str(SCRIPT), "run", "--workdir", str(work), "--rounds", "2", "--methods",
             "fedavg", "--set", "dp=local", "--set", "dp-clip=0.05", "--set", "fraction-train=1",
             "--set", "dp-noise-multiplier=0.5", "--set", "eval-audit-fraction=0",
             "--set", "record-uploads=true", "--set", "report=false", "--out", str(out)],
            capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        rows = json.loads((out / "results.json").read_text())["methods"]["fedavg"]["rounds"]
        assert [r["clients-trained"] for r in rows] == [3, 3] and rows[-1]["dp-epsilon"] > 0
        assert assert_uploads_clipped_and_noised(out / "uploads", seed=1, clip=0.05,
                                                 z=0.5) == 6
    finally:
        _stop(work, env)
    _nothing_left(work, port)


@needs_fashion_mnist
@pytest.mark.slow
def test_secure_aggregation_on_supernodes_over_tls_survives_a_node_dropping_after_its_keys(
        tmp_path):
    """``secure-aggregation = secagg+`` on four real SuperNodes over TLS with SuperNode
    authentication: in round 2 client 2 shares its keys and then does not answer its training
    (``client-dropout-rate = 0.2`` drops exactly it, from seed 1; a node that answers after
    ``round-timeout`` counts as dropped), and the server unmasks the other three's sum from its
    neighbours' shares of its mask key. The metrics equal, bit for bit, those of the same run on
    the sequential engine, where the same client drops (the masks cancel exactly, and every
    other draw is seeded). It waits round-timeout for the dropped client: 7 minutes on 2 cores
    measured beside a benchmark."""
    work = tmp_path / "deploy"
    out = tmp_path / "out"
    port = _free_ports(5)
    env = _environment()
    try:
        _script(work, env, "start", "--auth", "--nodes", "4", "--port", str(port),
                "--node-port", str(port + 1), "--set", "num-clients=4", "--set",
                "max-samples=3000", "--set", "seed=1", timeout=240)
        result = subprocess.run(
            ["bash", str(SCRIPT), "run", "--workdir", str(work), "--rounds", "2", "--methods",
             "fedavg,fedrep", "--set", "secure-aggregation=secagg+", "--set",
             "secagg-threshold=2", "--set", "fraction-train=1", "--set",
             "client-dropout-rate=0.2", "--set", "round-timeout=40", "--set",
             "report=false", "--out", str(out)],
            capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        doc = json.loads((out / "results.json").read_text())
        rows = doc["methods"]["fedavg"]["rounds"]
        assert [r["clients-trained"] for r in rows] == [4, 3]
        assert [r["secagg-dropped"] for r in rows] == [0, 1]
        assert all(r["secagg-bytes-up"] > 0 for r in rows)
        (run_config,) = (work / "runs").glob("*/run-config.toml")
        reference = _reference_run(run_config, tmp_path / "reference", set())
        differences, compared = _compare(reference, doc)
        assert compared > 30 and not differences, differences
    finally:
        _stop(work, env)
    _nothing_left(work, port)
