"""engine = batched on a two-node Ray cluster whose nodes have different addresses: the head in
one network namespace (10.213.0.1), the second node in another (10.213.0.2), joined by a veth
pair; the driver runs in the head's namespace and places one worker on each node. The metrics
must equal the sequential engine's bit for bit, and the workers' traffic crosses the veth. A run
whose data-root only the head's node holds (a bind mount in the head's mount namespace, which the
second node does not see) stops with one sentence naming the node without the data. The test
creates its namespaces and removes them, with every process in them, even when it fails; without
root, or where namespaces cannot be made, it skips and says why."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, needs_fashion_mnist
from test_multihost import _counter, _in, _ip, _namespaces_or_skip, _stop_namespace

from pflalign.data.datasets import DEBIAN_FASHION_MNIST
from pflalign.engines.sequential import SequentialEngine
from pflalign.outputs.results import Reporter
from pflalign.run.config import build_settings
from pflalign.run.driver import run_methods
from scripts.compare_results import compare

pytestmark = [needs_fashion_mnist, pytest.mark.slow]

HEAD, WORKER = "10.213.0.1", "10.213.0.2"
PORT = 39460
SMALL = {"num-clients": 4, "num-unseen-clients": 1, "max-samples": 2000, "rounds": 2,
         "eval-every": 1, "fraction-train": 1.0, "local-steps": 5, "seed": 6,
         "methods": "fedavg,pflalign"}


def _with_private_data(private: Path, *command: str) -> list[str]:
    """``command`` in a mount namespace of its own in which ``private`` holds Fashion-MNIST (a
    bind mount that no process outside that namespace sees: there ``private`` is empty)."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", str(DEBIAN_FASHION_MNIST),
            str(private), *command]


def _ray(namespace: str, temp: Path, env: dict, *args: str, private: Path | None = None
         ) -> None:
    command = [str(Path(sys.executable).parent / "ray"), "start", *args, "--num-cpus=1",
               "--disable-usage-stats", f"--temp-dir={temp}"]
    if private is not None:
        command = _with_private_data(private, *command)
    run = subprocess.run(_in(namespace, *command),
                         capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def test_batched_workers_on_a_two_node_ray_cluster_equal_one_process(tmp_path):
    prefix = f"pr{os.getpid() % 100000}"
    _namespaces_or_skip(prefix)
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot create a mount namespace here (unshare --mount)")
    private = tmp_path / "head-only-data"  # empty outside the head's mount namespace
    private.mkdir()
    head, worker = f"{prefix}H", f"{prefix}W"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    created: list[str] = []
    try:
        for namespace in (head, worker):
            _ip("netns", "add", namespace)
            created.append(namespace)
            _ip("-n", namespace, "link", "set", "lo", "up")
        _ip("link", "add", f"{prefix}h", "type", "veth", "peer", "name", f"{prefix}w")
        _ip("link", "set", f"{prefix}h", "netns", head)
        _ip("link", "set", f"{prefix}w", "netns", worker)
        for namespace, interface, address in ((head, f"{prefix}h", HEAD),
                                              (worker, f"{prefix}w", WORKER)):
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
            _ip("-n", namespace, "link", "set", interface, "up")
        _ray(head, Path("/tmp") / f"{prefix}-h", env, "--head", f"--node-ip-address={HEAD}",
             f"--port={PORT}", "--include-dashboard=false", private=private)
        _ray(worker, Path("/tmp") / f"{prefix}-w", env, f"--address={HEAD}:{PORT}",
             f"--node-ip-address={WORKER}")
        before = _counter(worker, f"{prefix}w", "tx_bytes")

        out = tmp_path / "cluster"
        args = [f"--set={k}={v}" for k, v in SMALL.items()]
        run = subprocess.run(_in(head, sys.executable, str(ROOT / "simulate.py"), *args,
                                 "--set=engine=batched", "--set=batched-workers=2",
                                 "--ray-address", f"{HEAD}:{PORT}", "--out", str(out)),
                             capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert f"engine = batched on 2 Ray workers (on {HEAD}, {WORKER})" in run.stdout
        sent = _counter(worker, f"{prefix}w", "tx_bytes") - before
        assert sent > 2_000_000  # the second node's uploads crossed the veth

        on_cluster = json.loads((out / "results.json").read_text())
        reference = run_methods(build_settings({**SMALL, "engine": "sequential",
                                                "out-dir": str(tmp_path / "sequential")}),
                                SequentialEngine, Reporter(quiet=True))
        differences, checked = compare(reference, on_cluster)
        assert differences == [] and checked > 100

        # a cluster without the data: only the head's node (and the driver) hold this data-root
        bare = tmp_path / "bare"
        run = subprocess.run(_in(head, *_with_private_data(
            private, sys.executable, str(ROOT / "simulate.py"), *args, "--set=engine=batched",
            "--set=batched-workers=2", f"--set=data-root={private}", "--ray-address",
            f"{HEAD}:{PORT}", "--out", str(bare))),
            capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
        assert run.returncode == 2, run.stdout[-3000:] + run.stderr[-3000:]
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1, run.stderr[-3000:]
        line = lines[0]
        assert re.fullmatch(rf"error: worker [01] on node {re.escape(WORKER)} cannot load the "
                            rf"run's data \(fashion-mnist was not found in .*\); every node of the "
                            rf"Ray cluster needs the dataset under the same data-root "
                            rf"\('{re.escape(str(private))}'\)\.", line), line
        assert not (bare / "results.json").exists()
        assert json.loads((out / "results.json").read_text()) == on_cluster  # nothing lost
    finally:
        for namespace in reversed(created):
            _stop_namespace(namespace)
        for name in ("h", "w"):
            subprocess.run(["rm", "-rf", f"/tmp/{prefix}-{name}"], timeout=60)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert head not in listed and worker not in listed
