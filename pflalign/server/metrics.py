"""Personalization metrics over clients (fractions in [0, 1])."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from pflalign.outputs.stats import t_critical


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


def ratio_interval(totals: Sequence[float], counts: Sequence[float], population: int,
                   level: float = 0.95, bounds: tuple[float, float] | None = (0.0, 1.0),
                   ) -> tuple[float, float]:
    """The ``level`` confidence interval for a population's ``sum(totals) / sum(counts)`` (every
    client's test samples pooled) from a simple random sample of ``len(counts)`` of its
    ``population`` clients: the ratio estimator ``R = sum(y) / sum(x)`` with its linearized
    variance and the finite-population correction (Cochran, *Sampling Techniques*, 3rd ed.
    1977, section 6.4), ``R +- t_{m-1} * sqrt((1 - m/M) / m * s^2) / mean(x)`` with
    ``s^2 = sum((y - R x)^2) / (m - 1)``; clipped to ``bounds``. Fewer than two sampled clients
    give (nan, nan); the whole population gives ``(R, R)``."""
    y = np.asarray(totals, dtype=np.float64)
    x = np.asarray(counts, dtype=np.float64)
    m = len(x)
    if m < 2 or x.sum() <= 0:
        return math.nan, math.nan
    ratio = float(y.sum() / x.sum())
    finite = max(0.0, 1.0 - m / population)
    spread = float(((y - ratio * x) ** 2).sum() / (m - 1))
    half = t_critical(m - 1, level) * math.sqrt(finite * spread / m) / float(x.mean())
    low, high = ratio - half, ratio + half
    if bounds is not None:
        low, high = max(bounds[0], low), min(bounds[1], high)
    return low, high
