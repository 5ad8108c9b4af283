"""Personalization metrics over clients (fractions in [0, 1])."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def accuracy_summary(correct: Sequence[float], count: Sequence[float],
                     prefix: str = "personal-acc") -> dict[str, float]:
    """Sample-weighted and unweighted mean accuracy over clients, its std and the bottom decile.

    ``<prefix>``: sum(correct) / sum(count), i.e. weighted by test-set size;
    ``<prefix>-unweighted``: mean of the per-client accuracies; ``<prefix>-std``: their population
    standard deviation; ``<prefix>-bottom10``: mean over the worst ceil(10%) of clients.
    """
    correct_a = np.asarray(correct, dtype=np.float64)
    count_a = np.asarray(count, dtype=np.float64)
    if len(count_a) == 0 or (count_a <= 0).any():
        raise ValueError("accuracy_summary needs at least one client, each with a test sample.")
    per_client = correct_a / count_a
    worst = np.sort(per_client)[: max(1, math.ceil(0.1 * len(per_client)))]
    return {
        prefix: float(correct_a.sum() / count_a.sum()),
        f"{prefix}-unweighted": float(per_client.mean()),
        f"{prefix}-std": float(per_client.std()),
        f"{prefix}-bottom10": float(worst.mean()),
    }
