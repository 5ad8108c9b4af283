"""--ray-address: the clients of a run on an existing Ray cluster (a head started here on
127.0.0.1, as docs/usage.md describes), which the run leaves running."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import ROOT, needs_fashion_mnist
from processes import listening_addresses, session_processes, stop_session

TINY = ["--set", "num-clients=3", "--set", "max-samples=1200", "--set", "rounds=2",
        "--set", "eval-every=1", "--set", "report=false", "--methods", "fedavg", "--quiet"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_address_where_nothing_listens_fails_at_once(tmp_path):
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, str(ROOT / "simulate.py"), *TINY, "--out", str(tmp_path),
         "--ray-address", f"127.0.0.1:{_free_port()}"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2
    assert result.stderr.startswith("error: No Ray cluster answers at '127.0.0.1:")
    assert len(result.stderr.strip().splitlines()) == 1
    assert time.perf_counter() - started < 60


@pytest.mark.slow
@needs_fashion_mnist
def test_clients_run_on_an_existing_ray_cluster(tmp_path):
    ray_tmp = tempfile.mkdtemp(prefix="rh-", dir="/tmp")  # Ray's socket paths must stay short
    port = _free_port()
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    ray = str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen(
        [ray, "start", "--head", "--port", str(port), "--node-ip-address", "127.0.0.1",
         "--ray-client-server-port", str(_free_port()), "--num-cpus", "2",
         "--disable-usage-stats", "--include-dashboard", "false", "--temp-dir", ray_tmp],
        env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    run = None
    try:
        started = head.communicate(timeout=120)[0]
        assert head.returncode == 0, started[-3000:]
        head_addresses = listening_addresses(session_processes(head.pid))
        run = subprocess.Popen(
            [sys.executable, str(ROOT / "simulate.py"), *TINY, "--out", str(tmp_path / "out"),
             "--ray-address", f"127.0.0.1:{port}"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        output = run.communicate(timeout=240)[0]
        assert run.returncode == 0, output[-3000:]
        results = json.loads((tmp_path / "out" / "results.json").read_text())
        assert [r["round"] for r in results["methods"]["fedavg"]["rounds"]] == [1, 2]
        # the run's driver joined the head's cluster (its log is in the head's session) ...
        logs = Path(ray_tmp, "session_latest", "logs")
        assert list(logs.glob(f"python-core-driver-*_{run.pid}.log")), sorted(os.listdir(logs))
        # ... started no Ray of its own, and the cluster is still up after it
        assert session_processes(run.pid) == []
        assert any("gcs_server" in Path(f"/proc/{pid}/cmdline").read_text()
                   for pid in session_processes(head.pid))
        assert head_addresses and head_addresses <= {"127.0.0.1"}, head_addresses
    finally:  # stop the head by its session (never `ray stop`: it would stop every Ray here)
        if run is not None:
            stop_session(run.pid, grace=1.0)
        left = stop_session(head.pid)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not left, f"Ray head processes still alive: {left}"
