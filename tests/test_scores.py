"""eval-metrics: macro-F1, balanced accuracy and AUROC, against hand values and scikit-learn on
planted predictions, and end to end: a run's per-client scores are those of the models it saved,
and its averages are those of its clients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import balanced_accuracy_score, f1_score, roc_auc_score
from test_tables import mail_table

from pflalign.data.federated import federated_dataset
from pflalign.data.node import pooled_node_data
from pflalign.outputs.results import Reporter
from pflalign.outputs.stats import higher_is_better, metric_scale
from pflalign.run.config import build_settings
from pflalign.run.driver import simulate
from pflalign.run.models import load_model
from pflalign.settings.options import ConfigError
from pflalign.training.loops import evaluate
from pflalign.training.scores import SCORES


class Planted(torch.nn.Module):
    """Returns the planted logits of the samples it is given (by their index)."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.logits[index.long()]


def scores_of(labels, logits, batch_size: int = 256) -> dict:
    y = torch.tensor(labels)
    return evaluate(Planted(torch.tensor(logits, dtype=torch.float32)), torch.arange(len(y)), y,
                    lambda x: x, batch_size=batch_size, scores=SCORES).scores


def test_macro_f1_and_balanced_accuracy_equal_the_hand_computed_values():
    # labels 0 0 1 1 2 2, predicted 0 1 1 1 2 0:
    # F1 per class: 0: P 1/2 R 1/2 -> 1/2; 1: P 2/3 R 1 -> 4/5; 2: P 1 R 1/2 -> 2/3
    labels = [0, 0, 1, 1, 2, 2]
    predicted = [0, 1, 1, 1, 2, 0]
    logits = np.eye(3)[predicted] * 4.0
    found = scores_of(labels, logits, batch_size=4)  # the outputs of two batches, joined
    assert found["macro-f1"] == pytest.approx((1 / 2 + 4 / 5 + 2 / 3) / 3, abs=1e-15)
    assert found["balanced-accuracy"] == pytest.approx((1 / 2 + 1 + 1 / 2) / 3, abs=1e-15)


def test_binary_auroc_equals_the_hand_computed_value():
    # positive-class probabilities 0.1 0.4 | 0.35 0.8: of the 4 (negative, positive) pairs, 3
    # are ordered right -> 0.75
    probabilities = np.array([0.1, 0.4, 0.35, 0.8])
    logits = np.stack([np.zeros(4), np.log(probabilities / (1 - probabilities))], axis=1)
    assert scores_of([0, 0, 1, 1], logits)["auroc"] == pytest.approx(0.75, abs=1e-12)


def test_scores_equal_scikit_learns_on_planted_multiclass_outputs():
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 4, 300)
    logits = rng.normal(0, 1, (300, 4)) + 2.0 * np.eye(4)[labels] * (rng.random(300) < 0.6)[:, None]
    found = scores_of(labels, logits, batch_size=64)
    predicted = logits.argmax(axis=1)
    probabilities = torch.softmax(torch.tensor(logits, dtype=torch.float32).double(),
                                  dim=1).numpy()
    assert found["macro-f1"] == f1_score(labels, predicted, average="macro", zero_division=0)
    assert found["balanced-accuracy"] == balanced_accuracy_score(labels, predicted)
    assert found["auroc"] == roc_auc_score(np.eye(4)[labels], probabilities, average="macro")


def test_auroc_is_left_out_where_a_client_has_one_class_and_averages_the_classes_it_has():
    logits = np.array([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [1.0, 0.5, 0.0]])
    assert "auroc" not in scores_of([1, 1, 1], logits)
    # class 2 never occurs: one-vs-rest over classes 0 and 1 only
    labels = [0, 1, 1]
    probabilities = torch.softmax(torch.tensor(logits, dtype=torch.float32).double(),
                                  dim=1).numpy()
    expected = roc_auc_score(np.eye(3)[labels][:, :2], probabilities[:, :2], average="macro")
    assert scores_of(labels, logits)["auroc"] == expected


def test_a_runs_scores_are_its_saved_models_and_its_averages_its_clients(tmp_path):
    mail_table().to_csv(tmp_path / "mail.csv", index=False)
    settings = build_settings({"dataset": f"csv:{tmp_path / 'mail.csv'}", "num-clients": 3,
                               "rounds": 2, "local-steps": 2, "engine": "sequential",
                               "methods": "fedrep,pflalign", "report": False,
                               "eval-metrics": "macro-f1,balanced-accuracy,auroc",
                               "out-dir": str(tmp_path / "out")})
    results = simulate(settings, Reporter(quiet=True))
    for label, entry in results["methods"].items():
        clients = entry["clients"]
        for key in ("personal-macro-f1", "personal-balanced-accuracy", "personal-auroc"):
            weights = [c["num-test"] for c in clients if key in c]
            mean = np.average([c[key] for c in clients if key in c], weights=weights)
            assert math.isclose(entry["final"][key], mean, rel_tol=1e-12), (label, key)
        for record in clients:  # the saved model's predictions give the client's score
            model = load_model(tmp_path / "out", label, record["id"])
            data = pooled_node_data(settings, record["id"]).data
            with torch.no_grad():
                predicted = model(data.test_x).argmax(dim=1).numpy()
            assert record["personal-macro-f1"] == f1_score(
                data.test_y.numpy(), predicted, average="macro", zero_division=0)
    assert federated_dataset(settings).dataset.class_names == ("ham", "spam", "unsure")
    model = load_model(tmp_path / "out", "fedrep", "alice")  # by its name
    assert model.class_names == ("ham", "spam", "unsure") and model.client_name == "alice"
    assert model.feature_names == tuple(f"f{j}" for j in range(6))


def test_scores_declare_their_direction_and_range_and_bad_requests_are_refused(tmp_path):
    for key in ("personal-macro-f1", "personal-balanced-accuracy", "personal-auroc"):
        assert higher_is_better(key) and metric_scale(key) == "fraction"
    with pytest.raises(ConfigError, match="eval-metrics names 'f2'; choose from macro-f1"):
        build_settings({"eval-metrics": "macro-f1,f2"})
    with pytest.raises(ConfigError, match="scores a classifier's classes"):
        build_settings({"dataset": "shakespeare", "model": "char-lstm",
                        "eval-metrics": "macro-f1"})
