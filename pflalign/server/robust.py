"""Byzantine-robust aggregation rules on flat client vectors, each from its paper.

Every rule takes the round's client vectors (one flat float64 vector per upload, the parts of the
model a method aggregates) and returns one vector. The coordinate rules (median, trimmed mean)
are in :mod:`pflalign.server.aggregation`; here are the rules that look at whole vectors:

- :func:`krum` and :func:`multi_krum`: Blanchard et al., "Machine learning with adversaries:
  Byzantine tolerant gradient descent", NeurIPS 2017;
- :func:`bulyan`: El Mhamdi et al., "The hidden vulnerability of distributed learning in
  Byzantium", ICML 2018;
- :func:`centered_clip`: Karimireddy et al., "Learning from history for Byzantine robust
  optimization", ICML 2021;
- :func:`fltrust`: Cao et al., "FLTrust: Byzantine-robust federated learning via trust
  bootstrapping", NDSS 2021.

Krum's and Bulyan's distances are between models; two models received from one global model
differ exactly as their updates do, so the rules are the same on models and on updates. Centered
clipping and FLTrust work on updates: they take the reference the updates are taken from.
Each function returns the aggregate and what it kept (:class:`Kept`), so a round's row can say
how many uploads a rule used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Kept:
    """Which uploads (their indices) a rule's aggregate is built from, and for the rules that
    weigh or clip them, their weights (FLTrust's trust scores) or how many were clipped."""

    indices: tuple[int, ...]
    weights: tuple[float, ...] = ()
    clipped: int = 0


def _stack(vectors: Sequence[np.ndarray]) -> np.ndarray:
    if len(vectors) == 0:
        raise ValueError("A robust rule needs at least one vector.")
    return np.stack([np.asarray(v, dtype=np.float64) for v in vectors])


def squared_distances(stacked: np.ndarray) -> np.ndarray:
    """The matrix of squared Euclidean distances between the rows of ``stacked`` (float64;
    ``|x|^2 + |y|^2 - 2 x.y``, clamped at 0, with an exact zero diagonal)."""
    norms = np.einsum("ij,ij->i", stacked, stacked)
    dist = norms[:, None] + norms[None, :] - 2.0 * (stacked @ stacked.T)
    np.maximum(dist, 0.0, out=dist)
    np.fill_diagonal(dist, 0.0)
    return dist


def krum_scores(stacked: np.ndarray, f: int) -> np.ndarray:
    """Krum's score of each row: the sum of its squared distances to its ``n - f - 2`` nearest
    other rows (at least one; Blanchard et al. 2017, section 4)."""
    n = len(stacked)
    if n == 1:
        return np.zeros(1)
    dist = squared_distances(stacked)
    nearest = max(1, n - f - 2)
    others = np.where(np.eye(n, dtype=bool), np.inf, dist)
    return np.sort(others, axis=1)[:, :nearest].sum(axis=1)


def multi_krum(vectors: Sequence[np.ndarray], f: int, m: int) -> tuple[np.ndarray, Kept]:
    """Multi-Krum: the unweighted mean of the ``m`` rows with the lowest Krum scores (ties: the
    lower index first). ``m = 1`` is Krum."""
    stacked = _stack(vectors)
    if not 1 <= m <= len(stacked):
        raise ValueError(f"Multi-Krum selects 1 to {len(stacked)} of {len(stacked)} vectors, "
                         f"not {m}.")
    order = np.argsort(krum_scores(stacked, f), kind="stable")[:m]
    chosen = tuple(sorted(int(i) for i in order))
    return stacked[list(chosen)].mean(axis=0), Kept(chosen)


def krum(vectors: Sequence[np.ndarray], f: int) -> tuple[np.ndarray, Kept]:
    """Krum: the one vector with the lowest score (Blanchard et al. 2017)."""
    return multi_krum(vectors, f, 1)


def bulyan(vectors: Sequence[np.ndarray], f: int) -> tuple[np.ndarray, Kept]:
    """Bulyan over Krum (El Mhamdi et al. 2018, section 4): select ``theta = n - 2f`` vectors by
    applying Krum ``theta`` times, each time to those not yet selected; then per coordinate
    average the ``beta = theta - 2f`` selected values closest to their median. Needs
    ``n >= 4f + 3``."""
    stacked = _stack(vectors)
    n = len(stacked)
    if n < 4 * f + 3:
        raise ValueError(f"Bulyan with f = {f} needs at least {4 * f + 3} vectors, got {n}.")
    theta, remaining, selected = n - 2 * f, list(range(n)), []
    for _ in range(theta):
        scores = krum_scores(stacked[remaining], f)
        best = remaining[int(np.argmin(scores))]
        selected.append(best)
        remaining.remove(best)
    chosen = stacked[selected]
    beta = theta - 2 * f
    median = np.median(chosen, axis=0)
    # per coordinate, the beta values nearest the median (ties: the earlier selected)
    order = np.argsort(np.abs(chosen - median), axis=0, kind="stable")[:beta]
    return (np.take_along_axis(chosen, order, axis=0).mean(axis=0),
            Kept(tuple(sorted(selected))))


def centered_clip(vectors: Sequence[np.ndarray], center: np.ndarray, tau: float,
                  iterations: int = 1) -> tuple[np.ndarray, Kept]:
    """Centered clipping (Karimireddy et al. 2021, eq. (2)): from ``v = center``, ``iterations``
    times ``v <- v + 1/n sum_i (x_i - v) min(1, tau / |x_i - v|)``. ``tau <= 0``: each
    iteration's radius is the median of ``|x_i - v|`` (this project's choice where no radius is
    set; the paper fixes tau)."""
    stacked = _stack(vectors)
    v = np.asarray(center, dtype=np.float64).copy()
    clipped = 0
    for _ in range(iterations):
        diffs = stacked - v
        norms = np.linalg.norm(diffs, axis=1)
        radius = float(np.median(norms)) if tau <= 0 else float(tau)
        scale = np.ones_like(norms)
        over = norms > radius
        scale[over] = radius / norms[over]
        clipped = int(over.sum())
        v = v + (diffs * scale[:, None]).mean(axis=0)
    return v, Kept(tuple(range(len(stacked))), clipped=clipped)


def fltrust(vectors: Sequence[np.ndarray], reference: np.ndarray, root: np.ndarray,
            ) -> tuple[np.ndarray, Kept]:
    """FLTrust (Cao et al. 2021, Algorithm 2): with the server's own update ``g0 = root -
    reference`` on its root set and each client's ``g_i = x_i - reference``, trust ``TS_i =
    ReLU(cos(g_i, g0))``, rescale ``g_i`` to ``|g0|``, and step by ``sum_i TS_i g_i' / sum_i
    TS_i`` (no step when every score is 0 or ``g0`` is 0)."""
    stacked = _stack(vectors)
    ref = np.asarray(reference, dtype=np.float64)
    g0 = np.asarray(root, dtype=np.float64) - ref
    updates = stacked - ref
    g0_norm = float(np.linalg.norm(g0))
    norms = np.linalg.norm(updates, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        cos = np.where(norms > 0, updates @ g0 / (norms * g0_norm), 0.0) if g0_norm > 0 else (
            np.zeros(len(updates)))
    trust = np.maximum(cos, 0.0)
    kept = tuple(int(i) for i in np.flatnonzero(trust > 0))
    if trust.sum() <= 0:
        return ref.copy(), Kept((), tuple(float(t) for t in trust))
    scaled = updates[list(kept)] * (g0_norm / norms[list(kept)])[:, None]
    step = (trust[list(kept)][:, None] * scaled).sum(axis=0) / trust.sum()
    return ref + step, Kept(kept, tuple(float(t) for t in trust))
