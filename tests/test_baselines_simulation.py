"""Every registered method in one real Flower simulation on Ray (one Ray start, 2 rounds each),
and the same config on the sequential engine: the two engines must give identical metrics."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, assert_reported_accuracy_matches_its_clients, needs_fashion_mnist

from pflalign.methods.base import Method
from pflalign.methods.registry import METHODS
from scripts.compare_results import compare

pytestmark = needs_fashion_mnist

#: every registered method but the ablation variants (what ``--methods all`` runs): a method
#: registered later is covered here without any change
NAMES = [name for name, spec in METHODS.items() if spec.variant_of is None]
INVARIANTS = ["fedprox(fedprox-mu=0.0)", "apfl(apfl-alpha=0.0,apfl-adaptive=false)"]
#: entries beyond the registry's names that take other paths through the engines: server-held
#: state, the GGA warm start (a query round), other local optimizers, local batch norm
EXTRAS = ["pflalign(pflalign-state=server)", "fedavg(gga=true)", "fedavg(local-optimizer=adam)",
          "fedprox(local-optimizer=genie)", "pflalign(model=cnn-bn,pflalign-bn=local)"]
COMMON = ["--set", "num-clients=4", "--set", "num-unseen-clients=1", "--set", "max-samples=1000",
          "--set", "rounds=2", "--set", "eval-every=1", "--set", "fraction-train=0.5",
          "--set", "seed=4", "--set", "local-steps=4", "--set", "gga-start=2",
          "--set", "gga-end=2", "--quiet"]
ENTRIES = [*METHODS, *INVARIANTS, *EXTRAS]


def _run(out, engine: str) -> dict:
    result = subprocess.run([sys.executable, str(ROOT / "simulate.py"), *COMMON, "--methods",
                             ",".join(ENTRIES), "--set", f"engine={engine}", "--out", str(out)],
                            capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("flower"), "flower")


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("sequential"), "sequential")


def test_the_sequential_engine_gives_the_flower_engines_metrics_for_every_method(results,
                                                                                sequential):
    engines = (results["config"]["engine"], sequential["config"]["engine"])
    assert engines == ("flower", "sequential")
    assert len(results["methods"]) == len(ENTRIES) == len(METHODS) + 7
    differences, checked = compare(results, sequential)
    assert differences == []
    assert checked > 80 * len(ENTRIES)  # every round's metrics of every entry, bytes included


def test_all_runs_every_registered_method_but_ablation_variants():
    from pflalign.run.config import parse_methods

    assert [c.name for c in parse_methods("all")] == NAMES
    variants = [name for name, spec in METHODS.items() if spec.variant_of is not None]
    assert len(NAMES) >= 18 and "pflalign-gamma0" in variants
    assert not set(variants) & set(NAMES)


@pytest.mark.parametrize("method", NAMES)
def test_each_method_trains_and_reports_personal_and_unseen_accuracy(results, method):
    run = results["methods"][method]
    assert [r["round"] for r in run["rounds"]] == [1, 2]
    final = run["final"]
    assert_reported_accuracy_matches_its_clients(run)
    # the unseen client is scored unless the method scores only the clients it trained (local)
    unseen = int(METHODS[method].method.eval_clients is Method.eval_clients)
    assert [c["unseen"] for c in run["clients"]].count(True) == unseen
    assert ("unseen-acc" in final) == bool(unseen)
    assert ("global-acc" in final) == METHODS[method].has_global_model
    assert (final["bytes-up"] > 0) == METHODS[method].method.uploads_model
    assert final["bytes-down"] > 0
    assert len(run["clients"]) == 4 + unseen and all(r["train-loss"] > 0 for r in run["rounds"])


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


def test_no_honest_reply_is_rejected(results, sequential):
    """The strict reply schema (every metric a method's replies carry, declared with its range)
    accepts every honest reply of every method and path, through the real ClientApp too."""
    for doc in (results, sequential):
        for label, run in doc["methods"].items():
            for row in [*run["rounds"], run["final"]]:
                assert not row.get("rejected") and not row.get("eval-rejected"), (label, row)
                assert not row.get("eval-audit-rejected"), (label, row)
                assert row.get("eval-audited", 0) >= 1, (label, row)  # the audit ran
                assert not row.get("failures") and not row.get("eval-failures"), (label, row)
