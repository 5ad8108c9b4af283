"""GENIE, GGA's warm start and the rotated partition in one run of ``simulate.py`` (on the
sequential engine: test_baselines_simulation runs GGA's warm start and GENIE as a local optimizer
under Flower on Ray and compares them with this engine bit for bit)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, assert_reported_accuracy_matches_its_clients, needs_fashion_mnist

pytestmark = needs_fashion_mnist

METHODS = "fedavg,fedavg(gga=true),fedavg(local-optimizer=genie),pflalign-genie"
COMMON = ["--set", "num-clients=4", "--set", "num-unseen-clients=2", "--set", "max-samples=2000",
          "--set", "partition=rotated", "--set", "rounds=3", "--set", "eval-every=3",
          "--set", "fraction-train=0.5", "--set", "gga-start=2", "--set", "gga-end=3",
          "--set", "local-steps=10", "--set", "seed=5", "--set", "engine=sequential",
          "--quiet"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("gga")
    result = subprocess.run([sys.executable, str(ROOT / "simulate.py"), *COMMON, "--methods",
                             METHODS, "--out", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


def test_warm_start_runs_in_its_window_and_reports_its_bytes(runs):
    plain, gga = runs["methods"]["fedavg"], runs["methods"]["fedavg(gga=true)"]
    assert [("gga-bytes-up" in r) for r in gga["rounds"]] == [False, True, True]
    for row, base in zip(gga["rounds"][1:], plain["rounds"][1:], strict=True):
        assert row["gga-bytes-up"] > 0 and row["gga-bytes-down"] > 0
        assert row["bytes-up"] == base["bytes-up"] + row["gga-bytes-up"]
        assert row["bytes-down"] == base["bytes-down"] + row["gga-bytes-down"]
        assert 0 <= row["gga-candidate"] <= 8
        assert row["gga-cosine-after"] >= row["gga-cosine-before"]
        assert row["gga-seconds"] > 0
    assert gga["rounds"][0]["train-loss"] == plain["rounds"][0]["train-loss"]  # before the window


def test_rotated_partition_holds_out_a_domain(runs):
    clients = runs["partition"]["clients"]
    assert {c["rotation"] for c in clients if c["unseen"]} == {90.0}
    assert 90.0 not in {c["rotation"] for c in clients if not c["unseen"]}
    for name in runs["methods"]:
        assert "unseen-acc" in runs["methods"][name]["final"]


def test_genie_runs_as_local_optimizer_and_as_pflalign_update(runs):
    plain = runs["methods"]["fedavg"]
    genie = runs["methods"]['fedavg(local-optimizer="genie")']
    pflalign_genie = runs["methods"]["pflalign-genie"]
    for result in (genie, pflalign_genie):
        assert_reported_accuracy_matches_its_clients(result)
    # the same batches and starting model as FedAvg, another update rule: round 1's loss (the
    # mean over the round's steps) is not SGD's
    assert genie["rounds"][0]["train-loss"] != plain["rounds"][0]["train-loss"]
    # pflalign-genie steps by GENIE's rule: no PFLAlign preconditioner or gamma is reported,
    # while the offsets of pFLAlign's federation are
    assert all("mean-P" not in r and "mean-gamma" not in r for r in pflalign_genie["rounds"])
    assert all(r["delta-norm"] > 0 for r in pflalign_genie["rounds"])
