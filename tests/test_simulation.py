"""Integration: real Flower simulations on Ray (no mocks), through the users' front doors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import ROOT, flwr_run, needs_fashion_mnist

pytestmark = needs_fashion_mnist

SMALL = ["--set", "num-clients=4", "--set", "num-unseen-clients=1", "--set", "max-samples=2000",
         "--set", "rounds=2", "--set", "eval-every=1", "--set", "fraction-train=1.0",
         "--set", "seed=3"]
METHODS = "fedavg,fedavg-ft,local"
ROUND_KEYS = {"round", "train-loss", "personal-acc", "personal-acc-unweighted",
              "personal-acc-std", "personal-acc-bottom10", "round-seconds", "bytes-up",
              "bytes-down"}


def _ray_processes(marker: str = "") -> set[int]:
    """Live Ray processes (zombies awaiting their parent's reaping do not count); with
    ``marker``, only those whose command line or environment holds it (a Ray worker's command
    line is its title, ``ray::...``; its environment is the run's)."""
    out = subprocess.run(["pgrep", "-f", "raylet|gcs_server|ray::"], capture_output=True,
                         text=True).stdout
    live = set()
    for pid in out.split():
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
            seen = b"".join(open(f"/proc/{pid}/{part}", "rb").read()
                            for part in ("cmdline", "environ")).decode(errors="ignore")
        except OSError:
            continue
        if state != "Z" and marker in seen:
            live.add(int(pid))
    return live


def _simulate(out_dir, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, str(ROOT / "simulate.py"), *SMALL, "--methods", METHODS,
         "--out", str(out_dir), *extra],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """The run, with a temporary folder of its own (short: Ray's socket paths must fit), so
    that its Ray processes are told from those of a test running beside it (pytest-xdist's
    other worker): each of them names the folder in its command line."""
    out = tmp_path_factory.mktemp("run1")
    temp = tempfile.mkdtemp(prefix="pt-", dir="/tmp")
    try:
        result = _simulate(out, env={**os.environ, "TMPDIR": temp})
        deadline = time.monotonic() + 15
        while (leftover := _ray_processes(temp)) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return result, json.loads((out / "results.json").read_text()), leftover


def test_results_json_has_the_documented_keys(first_run):
    _, results, _ = first_run
    assert {"config", "versions", "methods", "partition"} <= set(results)
    assert results["config"]["num-clients"] == 4 and results["config"]["rounds"] == 2
    assert {"torch", "flwr", "ray", "numpy", "python"} <= set(results["versions"])
    assert list(results["methods"]) == METHODS.split(",")
    for name, method in results["methods"].items():
        assert [r["round"] for r in method["rounds"]] == [1, 2]
        for row in method["rounds"]:
            assert ROUND_KEYS <= set(row), (name, set(row))
        assert {"personal-acc", "personal-acc-bottom10", "seconds-per-round", "bytes-up",
                "bytes-down", "train-loss"} <= set(method["final"])
        for client in method["clients"]:
            assert {"id", "num-train", "num-test", "personal-acc"} <= set(client)
            assert 0.0 <= client["personal-acc"] <= 1.0
    partition = results["partition"]
    assert len(partition["clients"]) == 5 and partition["num-unseen-clients"] == 1
    assert sum(c["num-train"] + c["num-test"] for c in partition["clients"]) == 2000


def test_method_semantics_hold_in_the_real_simulation(first_run):
    _, results, _ = first_run
    fedavg, ft, local = (results["methods"][m] for m in METHODS.split(","))
    # FedAvg's personal model is the global model; test-size weighting makes the two equal.
    assert fedavg["final"]["personal-acc"] == pytest.approx(fedavg["final"]["global-acc"])
    # fedavg-ft trains exactly like FedAvg (same seeds): same loss and global model.
    assert [r["train-loss"] for r in ft["rounds"]] == [r["train-loss"] for r in fedavg["rounds"]]
    assert ft["final"]["global-acc"] == fedavg["final"]["global-acc"]
    # Local starts from the same model with the same batches: round 1 is identical to FedAvg's.
    assert local["rounds"][0]["train-loss"] == fedavg["rounds"][0]["train-loss"]
    assert local["rounds"][1]["train-loss"] != fedavg["rounds"][1]["train-loss"]
    # Only methods with a global model report global-acc and unseen-acc.
    assert "unseen-acc" in fedavg["final"] and "unseen-acc" in ft["final"]
    assert "global-acc" not in local["final"] and "unseen-acc" not in local["final"]
    assert len(local["clients"]) == 4 and len(fedavg["clients"]) == 5
    # Traffic: FedAvg sends the model both ways; local uploads nothing, downloads once.
    model_bytes = local["rounds"][0]["bytes-down"] / 4
    assert model_bytes > 2_000_000
    assert local["final"]["bytes-up"] == 0 and local["rounds"][1]["bytes-down"] == 0
    assert fedavg["rounds"][0]["bytes-up"] == pytest.approx(4 * model_bytes, rel=0.01)
    assert fedavg["rounds"][0]["bytes-down"] == pytest.approx(9 * model_bytes, rel=0.01)


def test_progress_and_table_are_printed(first_run):
    result, _, _ = first_run
    assert "[fedavg] round   1/2" in result.stdout and "[local] round   2/2" in result.stdout
    assert "method" in result.stdout and "fedavg-ft" in result.stdout.split("method")[-1]


def test_no_ray_process_outlives_the_run(first_run):
    _, _, leftover = first_run
    assert not leftover, f"Ray processes left running: {leftover}"


def test_same_seed_gives_the_same_metrics(first_run, tmp_path):
    """A second run of the same config and seed, through the same command (on the sequential
    engine, which needs no Ray start: every engine gives the same metrics; and without its
    report), repeats the first's partition, rows and per-client results."""
    _, first, _ = first_run
    _simulate(tmp_path, "--set", "engine=sequential", "--set", "report=false")
    second = json.loads((tmp_path / "results.json").read_text())
    # report = false: results.json and results.csv, no report.md or plots
    assert (tmp_path / "results.csv").is_file()
    assert not (tmp_path / "report.md").exists() and not (tmp_path / "plots").exists()
    assert second["partition"] == first["partition"]
    timing = {"round-seconds", "train-seconds", "eval-seconds", "client-seconds",
              "seconds-per-round", "total-seconds"}
    for name in first["methods"]:
        pairs = zip(first["methods"][name]["rounds"], second["methods"][name]["rounds"],
                    strict=True)
        for a, b in pairs:
            assert {k: v for k, v in a.items() if k not in timing} == {
                k: v for k, v in b.items() if k not in timing}
        assert first["methods"][name]["clients"] == second["methods"][name]["clients"]


def test_flwr_run_dot_with_a_run_config_override(tmp_path):
    """`flwr run .` against Flower's managed local SuperLink (stopped afterwards)."""
    out = tmp_path / "out"
    result = flwr_run(ROOT, tmp_path, [
        "--run-config", f"rounds=1 num-clients=3 max-samples=1200 methods='fedavg' out-dir='{out}'",
        "--federation-config", "num-supernodes=3"], port=39191, timeout=240)
    assert "[fedavg] round   1/1" in result.stdout, result.stdout[-3000:] + result.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["rounds"] == 1 and results["config"]["num-clients"] == 3
    assert [r["round"] for r in results["methods"]["fedavg"]["rounds"]] == [1]
