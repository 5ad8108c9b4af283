"""save-models: the models a run gives back load and score every client exactly as the run did.

For every registered method (variants included), each client's saved personal model, loaded with
``pflalign.load_model`` and scored on its test split, gives the run's own final per-client
accuracy and loss to the bit; the same holds on the sequential and Flower engines; saving changes
no metric (bytes included); a client that sends a malformed model loses only that model; and a
models folder written by another config is refused in one sentence.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from pflalign.methods.registry import METHODS
from pflalign.outputs.results import Reporter
from pflalign.run.config import build_settings
from pflalign.run.driver import simulate
from pflalign.run.models import load_model
from pflalign.settings.options import ConfigError

BASE = {"num-clients": 3, "num-unseen-clients": 1, "rounds": 2, "max-samples": 600,
        "report": False, "local-steps": 2, "eval-every": 1, "engine": "batched",
        "fraction-train": 1.0}


def run(tmp_path, name: str, **changes) -> tuple[dict, object]:
    out = tmp_path / name
    results = simulate(build_settings({**BASE, "out-dir": str(out), **changes}),
                       Reporter(quiet=True))
    return results, out


def client_scores(out, label: str) -> dict[int, tuple[float, float, int]]:
    """Each saved client model of ``label`` loaded and scored on its client's test split."""
    from pflalign.data.node import pooled_node_data
    from pflalign.outputs.models import find_entry
    from pflalign.run.models import entry_settings
    from pflalign.training.loops import evaluate

    _, manifest = find_entry(out, label)
    settings = entry_settings(manifest)
    scores = {}
    for record in manifest["clients"]:
        model = load_model(out, label, record["id"])
        data = pooled_node_data(settings, record["id"]).data
        stats = evaluate(model.module, data.test_x, data.test_y, model.inputs)
        scores[record["id"]] = (stats.correct / stats.count, stats.loss_sum / stats.count,
                                stats.count)
        assert record["personal-loss"] == stats.loss_sum / stats.count
    return scores


def assert_saved_models_score_as_run(results: dict, out) -> None:
    for label, entry in results["methods"].items():
        finals = {c["id"]: c["personal-acc"] for c in entry["clients"]}
        # every evaluated client: 3 + 1 unseen (local evaluates no unseen client)
        assert entry["models"]["clients"] == len(finals) == (3 if label == "local" else 4), label
        scores = client_scores(out, label)
        assert {cid: acc for cid, (acc, _, _) in scores.items()} == finals, label


def test_every_method_saves_models_that_score_exactly_as_in_the_run(tmp_path):
    results, out = run(tmp_path, "all", methods=",".join(METHODS))
    assert len(results["methods"]) == len(METHODS)
    assert_saved_models_score_as_run(results, out)
    # the global model: the server's, loaded into the run's model
    fedavg = load_model(out, "fedavg")
    manifest = json.loads((out / "models" / "fedavg" / "manifest.json").read_text())
    assert manifest["fingerprint"] == results["methods"]["fedavg"]["models"]["fingerprint"]
    assert fedavg.client is None and fedavg.class_names == tuple(manifest["class-names"])
    # FedAvg's personal model is the global model: every client's file holds the same values
    one = load_model(out, "fedavg", 0).module.state_dict()
    assert all(torch.equal(one[k], v) for k, v in fedavg.module.state_dict().items())
    with pytest.raises(ConfigError, match="no global model"):
        load_model(out, "fedrep")
    with pytest.raises(ConfigError, match="no saved model of client 7"):
        load_model(out, "fedrep", 7)


@pytest.mark.parametrize("engine", ["sequential", "flower"])
def test_saved_models_score_as_in_the_run_on_every_engine(tmp_path, engine):
    methods = "fedavg-ft,fedrep,ditto,pflalign,gpfl,feddbe"
    results, out = run(tmp_path, engine, methods=methods, engine=engine)
    assert_saved_models_score_as_run(results, out)


def test_saving_changes_no_metric_and_none_saves_nothing(tmp_path):
    from scripts.compare_results import compare

    saved, _ = run(tmp_path, "saved", methods="pflalign,fedper")
    plain, out = run(tmp_path, "plain", methods="pflalign,fedper", **{"save-models": "none"})
    differences, compared = compare(saved, plain)
    assert differences == [] and compared > 50
    for a, b in zip(saved["methods"].values(), plain["methods"].values(), strict=True):
        assert [r["bytes-up"] for r in a["rounds"]] == [r["bytes-up"] for r in b["rounds"]]
        assert "models" in a and "models" not in b
    assert not (out / "models").exists()


def test_evaluate_command_recomputes_the_runs_scores_and_scores_new_data(tmp_path, capsys):
    from pflalign.run.evaluate import main

    results, out = run(tmp_path, "cmd", methods="fedrep,local")
    assert main([str(out)]) == 0
    printed = capsys.readouterr().out
    assert "4 of 4 clients score exactly as in the run" in printed
    scores = json.loads((out / "evaluation.json").read_text())
    for label, entry in results["methods"].items():
        finals = {c["id"]: c["personal-acc"] for c in entry["clients"]}
        assert {r["id"]: r["personal-acc"] for r in scores["methods"][label]["clients"]} == finals
    # data given later: another draw of the samples, scored by the same saved models
    assert main([str(out), "--method", "fedrep", "--set", "max-samples=900",
                 "--out", str(tmp_path / "later.json")]) == 0
    later = json.loads((tmp_path / "later.json").read_text())["methods"]["fedrep"]["clients"]
    assert [r["id"] for r in later] == [0, 1, 2, 3] and all("same-as-run" not in r for r in later)
    assert sum(r["num-test"] for r in later) > sum(c["num-test"]
                                                   for c in results["methods"]["fedrep"]["clients"])
    assert main([str(out), "--method", "nope"]) == 2
    assert "holds no saved models of nope" in capsys.readouterr().err


def test_a_models_folder_from_another_config_is_refused(tmp_path):
    _, first = run(tmp_path, "first", methods="fedavg")
    _, second = run(tmp_path, "second", methods="fedavg", seed=1)
    shutil.rmtree(second / "models")
    shutil.copytree(first / "models", second / "models")
    with pytest.raises(ConfigError, match="was written by another config") as caught:
        load_model(second, "fedavg", 0)
    assert str(caught.value).count(". ") == 0  # one sentence
    from pflalign.run.evaluate import main
    assert main([str(second)]) == 2


def test_a_client_that_sends_a_malformed_model_loses_only_its_model(tmp_path, monkeypatch):
    """Through the engine's client path: client 1's reply carries a scored model of another
    shape; its metrics stand, its model is not saved, and the others are."""
    import pflalign.engines.host as host

    honest = host.scored_arrays

    def tampered(method, client):
        arrays = honest(method, client)
        if client.client_id == 1 and arrays is not None:
            key = next(iter(arrays))
            arrays[key] = torch.zeros(3)
        return arrays

    monkeypatch.setattr(host, "scored_arrays", tampered)
    warnings: list[str] = []
    reporter = Reporter(quiet=True)
    reporter.warn = warnings.append  # type: ignore[method-assign]
    out = tmp_path / "tampered"
    results = simulate(build_settings({**BASE, "out-dir": str(out), "methods": "fedavg",
                                       "engine": "sequential"}), reporter)
    entry = results["methods"]["fedavg"]
    assert entry["final"]["evaluated"] == 4 and entry["models"]["clients"] == 3
    assert any("personal models of 1 clients are not saved: client 1" in w for w in warnings)
    with pytest.raises(ConfigError, match="no saved model of client 1"):
        load_model(out, "fedavg", 1)
    assert np.isfinite(load_model(out, "fedavg", 2).module.state_dict()[
        next(iter(load_model(out, "fedavg", 2).module.state_dict()))].numpy()).all()


def test_save_models_best_keeps_the_round_with_the_best_validation_score(tmp_path):
    from pflalign.run.evaluate import evaluate_saved

    results, out = run(tmp_path, "best", methods="fedavg,fedrep,pflalign", rounds=4,
                       **{"save-models": "best", "evaluate-on": "validation"})
    for label, entry in results["methods"].items():
        manifest = json.loads((out / "models" / label / "manifest.json").read_text())
        scores = [(r["round"], r["personal-acc"]) for r in entry["rounds"]]
        best = max(scores, key=lambda pair: (pair[1], -pair[0]))[0]  # the first best round
        assert manifest["round"] == best and {c["round"] for c in manifest["clients"]} == {best}
        chosen = [c for c in manifest["clients"] if not c["unseen"]]
        pooled = (sum(c["personal-acc"] * c["num-test"] for c in chosen)
                  / sum(c["num-test"] for c in chosen))
        assert pooled == pytest.approx(dict(scores)[best], abs=1e-12)
    # the models score their clients' validation splits as they did in that round
    checked = evaluate_saved(out)
    assert all(r["same-as-run"] for m in checked["methods"].values() for r in m["clients"])
    with pytest.raises(ConfigError, match="evaluate-on = 'validation'"):
        build_settings({"save-models": "best"})
    with pytest.raises(ConfigError, match="set eval-fraction = 1"):
        build_settings({"save-models": "best", "evaluate-on": "validation",
                        "eval-fraction": 0.5})
