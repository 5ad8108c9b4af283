"""Classification scores beyond accuracy, per client, computed by scikit-learn.

``eval-metrics`` names which a run reports (each as ``personal-<name>``): every evaluated client
computes them on its test split from the model's outputs, its reply carries them, and the server
averages them over the clients weighted by their test samples, as PFLlib averages its per-client
AUC (the per-client values go to results.json beside ``personal-acc``).

- ``macro-f1``: ``sklearn.metrics.f1_score(y, argmax, average="macro", zero_division=0)``, over
  the classes in the client's labels or predictions;
- ``balanced-accuracy``: ``sklearn.metrics.balanced_accuracy_score(y, argmax)``, the mean recall
  over the classes in the client's labels;
- ``auroc``: ``sklearn.metrics.roc_auc_score`` of the softmax probabilities: of the positive
  class for two classes, one-vs-rest and macro-averaged for more, over the classes that have both
  positive and negative test samples at this client; a client whose test labels are all one
  class has none and is left out of the average (its reply carries no ``personal-auroc``).

Each lies in [0, 1], higher is better (:data:`SCORES`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pflalign.wire.protocol import SCORES  # each a fraction, higher is better

__all__ = ["SCORES", "classification_scores", "require_sklearn"]


def require_sklearn() -> None:
    """scikit-learn is there, or one sentence saying how to install it."""
    try:
        import sklearn  # noqa: F401
    except ImportError:
        from pflalign.settings.options import ConfigError

        raise ConfigError("eval-metrics needs scikit-learn: pip install \"pflalign[metrics]\" "
                          "(or scikit-learn>=1.5).") from None


def regression_scores(targets: torch.Tensor, predictions: torch.Tensor) -> dict[str, float]:
    """A regression's scores beside its mean squared error (``personal-loss``): the mean absolute
    error and R^2 (``sklearn.metrics.mean_absolute_error`` and ``r2_score``; R^2 left out for a
    client whose test targets are all one value, where it is not defined)."""
    from sklearn.metrics import mean_absolute_error, r2_score

    y = targets.detach().cpu().double().numpy()
    predicted = predictions.detach().cpu().double().numpy()
    scores = {"mae": float(mean_absolute_error(y, predicted))}
    if len(y) >= 2 and np.ptp(y) > 0:
        scores["r2"] = float(r2_score(y, predicted))
    return scores


def classification_scores(labels: torch.Tensor, logits: torch.Tensor,
                          wanted: Sequence[str]) -> dict[str, float]:
    """The scores ``wanted`` (of :data:`SCORES`) of the outputs ``logits`` (N x K) for the test
    labels ``labels`` (N); a score that is not defined at this client (AUROC with one class) is
    left out."""
    from sklearn.metrics import balanced_accuracy_score, f1_score, roc_auc_score

    y = labels.detach().cpu().numpy()
    out = logits.detach().cpu().double()
    predicted = out.argmax(dim=1).numpy()
    scores: dict[str, float] = {}
    if "macro-f1" in wanted:
        scores["macro-f1"] = float(f1_score(y, predicted, average="macro", zero_division=0))
    if "balanced-accuracy" in wanted:
        # sklearn warns when a predicted class is not among the labels; the score is defined
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            scores["balanced-accuracy"] = float(balanced_accuracy_score(y, predicted))
    if "auroc" in wanted:
        probabilities = torch.softmax(out, dim=1).numpy()
        classes = probabilities.shape[1]
        if classes == 2:
            if len(np.unique(y)) == 2:
                scores["auroc"] = float(roc_auc_score(y, probabilities[:, 1]))
        else:
            onehot = np.eye(classes, dtype=np.int64)[y]
            both = [k for k in range(classes) if 0 < onehot[:, k].sum() < len(y)]
            if both:
                scores["auroc"] = float(roc_auc_score(onehot[:, both], probabilities[:, both],
                                                      average="macro"))
    return scores
