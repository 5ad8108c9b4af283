"""task = regression: float targets from a table or an npz file, a model with one output trained
on the mean squared error, and personal-mse, -mae and -r2 reported, per client too.

FedAvg, FedRep (the MLP's body shared, its one-output linear head personal) and pFLAlign run on
the sequential, batched and Flower engines bit for bit, beat the clients' own mean as a
predictor, and each client's scores are scikit-learn's on its saved model's predictions. Bad
targets and configurations that need classes get one sentence and write nothing."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from harness import three_engines
from sklearn.metrics import mean_absolute_error, r2_score

from pflalign.data.node import pooled_node_data
from pflalign.run.cli import main
from pflalign.run.config import build_settings
from pflalign.run.models import load_model
from pflalign.settings.options import ConfigError
from pflalign.training.loops import task_loss
from pflalign.training.objectives import cross_entropy

SITES = ("north", "south", "east", "west")


def prices(n: int = 80) -> pd.DataFrame:
    """Four sites, five features, each site its own linear link (plus an offset and noise)."""
    frames = []
    for c, site in enumerate(SITES):
        rng = np.random.default_rng(c)
        x = rng.normal(0, 1, (n, 5))
        y = x @ (rng.normal(0, 1, 5) + c - 1.5) + c + 0.3 * rng.normal(0, 1, n)
        frames.append(pd.DataFrame({"site": site, **{f"x{j}": x[:, j] for j in range(5)},
                                    "price": y,
                                    "split": np.where(np.arange(n) % 4 == 0, "test", "train")}))
    return pd.concat(frames)


def values(tmp_path) -> dict:
    prices().to_csv(tmp_path / "prices.csv", index=False)
    return {"dataset": f"csv:{tmp_path / 'prices.csv'}", "task": "regression",
            "label-column": "price", "client-column": "site", "num-clients": 4, "rounds": 6,
            "eval-every": 3, "fraction-train": 1.0, "methods": "fedavg,fedrep,pflalign"}


def test_the_losses_are_the_mean_squared_error_for_float_targets():
    outputs = torch.tensor([[1.0], [2.0], [4.0]])
    targets = torch.tensor([0.5, 2.0, 1.0])
    expected = (0.25 + 0.0 + 9.0) / 3
    assert float(task_loss(outputs, targets)) == pytest.approx(expected, abs=1e-7)
    assert float(cross_entropy(outputs, targets, None)) == pytest.approx(expected, abs=1e-7)
    mask = torch.tensor([1.0, 1.0, 0.0])  # a padded sample is left out
    assert float(cross_entropy(outputs, targets, mask)) == pytest.approx(0.125, abs=1e-7)


def test_regression_runs_fedavg_fedrep_and_pflalign_bit_for_bit_on_two_engines(tmp_path):
    """The sequential and batched engines (a regression's client code and checks are the same
    under Flower, whose nodes read the table through the same loader: test_tables' CSV)."""
    config = values(tmp_path)
    results = three_engines(config, tmp_path, compared_at_least=40, flower=False)
    settings = build_settings({**config, "engine": "sequential", "out-dir": str(tmp_path / "s")})
    assert results["config"]["model"] == "mlp" and results["config"]["partition"] == "natural"
    for label, entry in results["methods"].items():
        final, clients = entry["final"], entry["clients"]
        assert "personal-acc" not in final and "personal-acc" not in clients[0]
        weights = [c["num-test"] for c in clients]
        assert math.isclose(final["personal-mse"],
                            np.average([c["personal-mse"] for c in clients], weights=weights),
                            rel_tol=1e-12)
        for record in clients:  # scikit-learn's scores of the saved model's predictions
            model = load_model(tmp_path / "s", label, record["id"])
            data = pooled_node_data(settings, record["id"]).data
            with torch.no_grad():
                predicted = model(data.test_x).squeeze(-1).double().numpy()
            truth = data.test_y.double().numpy()
            assert record["personal-r2"] == pytest.approx(r2_score(truth, predicted), rel=1e-6)
            assert record["personal-mae"] == pytest.approx(
                mean_absolute_error(truth, predicted), rel=1e-6)
            assert record["personal-mse"] == pytest.approx(
                float(np.mean((truth - predicted) ** 2)), rel=1e-5)
    # personalization pays: pFLAlign's clients beat their own test mean (R^2 > 0), and FedAvg's
    # one model for four different links does worse than pFLAlign
    pflalign = results["methods"]["pflalign"]["final"]
    assert pflalign["personal-r2"] > 0.2
    assert pflalign["personal-mse"] < results["methods"]["fedavg"]["final"]["personal-mse"]


def test_an_npz_regression_and_its_float_targets(tmp_path):
    rng = np.random.default_rng(4)
    x = rng.normal(0, 1, (200, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5]) + 0.1 * rng.normal(0, 1, 200)).astype(np.float32)
    np.savez(tmp_path / "r.npz", x=x, y=y)
    settings = build_settings({"dataset": f"npz:{tmp_path / 'r.npz'}", "task": "regression",
                               "num-clients": 4, "partition": "iid"})
    data = pooled_node_data(settings, 0).data
    assert data.train_y.dtype == torch.float32 and data.train_y.dim() == 1
    with pytest.raises(ConfigError, match=r"labels must be integers 0..K-1 \(for float "
                                          "targets, set task = regression\\)"):
        pooled_node_data(build_settings({"dataset": f"npz:{tmp_path / 'r.npz'}",
                                         "num-clients": 4, "model": "mlp"}), 0)


@pytest.mark.parametrize(("changes", "expected"), [
    ({"table": lambda t: t.assign(price=t.price.where(np.arange(len(t)) != 9, np.nan))},
     "the target of row 9 is nan; a regression needs a finite target for every sample"),
    ({"methods": "gpfl"}, "gpfl cannot run task = 'regression': it learns one embedding per"),
    ({"partition": "dirichlet"}, "splits the samples by class, and task = 'regression' has no "
                                 "classes: choose natural, iid, quantity"),
    ({"eval-metrics": "macro-f1"}, "scores a classifier's classes, and task = 'regression'"),
    ({"dataset": "fashion-mnist", "label-column": "", "client-column": ""},
     "task = 'regression' reads float targets from dataset = "
                                   "npz:PATH, csv:PATH or parquet:PATH"),
])
def test_a_bad_regression_gets_one_sentence_and_writes_nothing(tmp_path, capsys, changes,
                                                                expected):
    config = values(tmp_path)
    change = changes.pop("table", None)
    if change is not None:
        change(prices()).to_csv(tmp_path / "prices.csv", index=False)
    config.update(changes)
    out = tmp_path / "out"
    argv = [arg for k, v in config.items() if k != "methods" for arg in ("--set", f"{k}={v}")]
    code = main([*argv, "--methods", config["methods"], "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and expected in err, err
    assert err.strip().count("\n") == 0 and not out.exists()
