"""pFLAlign through ``simulate.py``: invariants, diagnostics, client vs server state (on the
sequential engine: test_baselines_simulation runs pflalign with either state under Flower on Ray
and compares them with this engine bit for bit)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, needs_fashion_mnist

pytestmark = needs_fashion_mnist

COMMON = ["--set", "num-clients=4", "--set", "num-unseen-clients=1", "--set", "max-samples=2000",
          "--set", "rounds=3", "--set", "eval-every=1", "--set", "fraction-train=0.5",
          "--set", "seed=2", "--set", "engine=sequential", "--quiet"]
TIMING = {"round-seconds", "train-seconds", "eval-seconds", "client-seconds",
          "seconds-per-round", "total-seconds"}
TRAFFIC = {"bytes-up", "bytes-down"}


def _run(out_dir, methods: str, *extra: str) -> dict:
    result = subprocess.run(
        [sys.executable, str(ROOT / "simulate.py"), *COMMON, "--methods", methods,
         "--out", str(out_dir), *extra], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out_dir / "results.json").read_text())["methods"]


SERVER_STATE = 'pflalign(pflalign-state="server")'  # the entry's label


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One simulation (one Ray start) of every entry the tests below compare."""
    return _run(tmp_path_factory.mktemp("runs"), f"fedavg,pflalign-sgd,pflalign,{SERVER_STATE}")


@pytest.fixture(scope="module")
def client_mode(runs):
    return runs


@pytest.fixture(scope="module")
def server_mode(runs):
    return {"pflalign": runs[SERVER_STATE]}


def test_p_one_and_delta_zero_is_fedavg_with_plain_sgd(client_mode):
    fedavg, sgd = client_mode["fedavg"], client_mode["pflalign-sgd"]
    assert [r["train-loss"] for r in sgd["rounds"]] == [r["train-loss"] for r in fedavg["rounds"]]
    assert [r["global-acc"] for r in sgd["rounds"]] == [r["global-acc"] for r in fedavg["rounds"]]
    assert sgd["final"]["unseen-acc"] == fedavg["final"]["unseen-acc"]


def test_diagnostics_are_recorded_every_round(client_mode):
    rounds = client_mode["pflalign"]["rounds"]
    for row in rounds:
        assert {"mean-P", "mean-gamma", "delta-norm", "update-cosine", "personal-acc",
                "personal-acc-next", "global-acc", "unseen-acc"} <= set(row)
        assert 0 < row["mean-P"] < 1
        assert 0 <= row["mean-gamma"] <= 1 and -1 <= row["update-cosine"] <= 1
        assert row["delta-norm"] > 0
    assert rounds[0]["mean-gamma"] == 0.5  # first participation: Delta = 0, gamma = 1/2
    assert any(row["mean-gamma"] != 0.5 for row in rounds[1:])  # offsets in play later
    assert len(client_mode["pflalign"]["clients"]) == 5


def test_client_and_server_state_give_identical_metrics(client_mode, server_mode):
    a, b = client_mode["pflalign"], server_mode["pflalign"]
    for ra, rb in zip(a["rounds"], b["rounds"], strict=True):
        skip = TIMING | TRAFFIC
        assert {k: v for k, v in ra.items() if k not in skip} == {
            k: v for k, v in rb.items() if k not in skip}
    assert a["clients"] == b["clients"]
    # the server sends personalized initializations and offsets once clients have them
    assert b["final"]["bytes-down"] > a["final"]["bytes-down"]
    assert b["final"]["bytes-up"] == a["final"]["bytes-up"]
