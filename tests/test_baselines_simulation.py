"""Every pFL baseline in one real Flower simulation on Ray (one Ray start, 2 rounds each)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, needs_fashion_mnist

from pflalign.methods import METHODS

pytestmark = needs_fashion_mnist

BASELINES = ["fedprox", "scaffold", "ditto", "fedper", "fedrep", "fedbn", "apfl", "perfedavg",
             "pfedme", "fedala"]
INVARIANTS = ["fedprox(fedprox-mu=0.0)", "apfl(apfl-alpha=0.0,apfl-adaptive=false)"]
COMMON = ["--set", "num-clients=4", "--set", "num-unseen-clients=1", "--set", "max-samples=2000",
          "--set", "rounds=2", "--set", "eval-every=1", "--set", "fraction-train=0.5",
          "--set", "seed=4", "--set", "local-steps=20", "--quiet"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("baselines")
    methods = ",".join(["fedavg", *BASELINES, *INVARIANTS])
    result = subprocess.run([sys.executable, str(ROOT / "simulate.py"), *COMMON, "--methods",
                             methods, "--out", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


def test_all_runs_every_registered_method_but_ablation_variants():
    from pflalign.config import parse_methods

    names = [c.name for c in parse_methods("all")]
    assert set(BASELINES) | {"fedavg", "fedavg-ft", "local", "pflalign"} == set(names)
    assert all(METHODS[n].variant_of is None for n in names)


@pytest.mark.parametrize("method", BASELINES)
def test_each_baseline_trains_and_reports_personal_and_unseen_accuracy(results, method):
    run = results["methods"][method]
    assert [r["round"] for r in run["rounds"]] == [1, 2]
    final = run["final"]
    assert 0 < final["personal-acc"] <= 1 and 0 <= final["unseen-acc"] <= 1
    assert ("global-acc" in final) == METHODS[method].has_global_model
    assert final["bytes-up"] > 0 and final["bytes-down"] > 0
    assert len(run["clients"]) == 5 and all(r["train-loss"] > 0 for r in run["rounds"])


def test_invariants_hold_in_the_real_simulation(results):
    runs = results["methods"]
    fedavg = runs["fedavg"]
    for label in INVARIANTS:
        same = runs[label]
        assert [r["global-acc"] for r in same["rounds"]] == [r["global-acc"]
                                                             for r in fedavg["rounds"]]
        assert same["final"]["personal-acc"] == fedavg["final"]["personal-acc"]
        assert same["final"]["unseen-acc"] == fedavg["final"]["unseen-acc"]
    # SCAFFOLD's first round has zero control variates: the same local training as FedAvg
    assert runs["scaffold"]["rounds"][0]["train-loss"] == fedavg["rounds"][0]["train-loss"]


def test_traffic_reflects_what_each_method_exchanges(results):
    runs = results["methods"]
    up = {name: runs[name]["final"]["bytes-up"] for name in runs}
    assert up["scaffold"] == 2 * up["fedavg"]  # model + control-variate change (same size)
    for partial in ("fedper", "fedrep"):  # the head stays home
        assert up[partial] < up["fedavg"]
    # fedbn runs on cnn-bn: its upload is the cnn weights without the batch-norm entries
    assert results["methods"]["fedbn"]["overrides"]["model"] == "cnn-bn"
    assert up["fedbn"] == up["fedavg"]
