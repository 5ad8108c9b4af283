"""Server-side math on model states: flattening, validation and sample-weighted averaging.

A model state is a ``dict[str, np.ndarray]`` (a PyTorch ``state_dict`` as NumPy arrays). For
arithmetic it is packed into one contiguous vector (:class:`FlatSpec`), so an aggregation is a
handful of vector operations per client rather than a Python loop over parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pflalign.wire.state import State


@dataclass(frozen=True)
class FlatSpec:
    """Keys, shapes and dtypes of a model state, and where each lives in the flat vector."""

    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    offsets: tuple[int, ...]

    @classmethod
    def of(cls, state: Mapping[str, np.ndarray]) -> FlatSpec:
        keys = tuple(state)
        shapes = tuple(tuple(np.shape(state[k])) for k in keys)
        sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        return cls(keys=keys, shapes=shapes, dtypes=tuple(np.asarray(state[k]).dtype for k in keys),
                   offsets=tuple(np.concatenate([[0], np.cumsum(sizes)]).tolist()))

    @property
    def size(self) -> int:
        return self.offsets[-1]

    @property
    def nbytes(self) -> int:
        """The bytes of a state of this spec's arrays (their data, without headers)."""
        return sum((stop - start) * np.dtype(dtype).itemsize for dtype, start, stop in
                   zip(self.dtypes, self.offsets[:-1], self.offsets[1:], strict=True))

    def flatten(self, state: Mapping[str, np.ndarray], dtype: type = np.float32) -> np.ndarray:
        """Pack a state (in this spec's key order) into one vector of ``dtype``."""
        out = np.empty(self.size, dtype=dtype)
        for key, start, stop in zip(self.keys, self.offsets[:-1], self.offsets[1:], strict=True):
            out[start:stop] = np.asarray(state[key]).reshape(-1)
        return out

    def unflatten(self, vector: np.ndarray) -> State:
        """Unpack a vector into a state with the original dtypes (integer entries are rounded)."""
        state: State = {}
        for key, shape, dtype, start, stop in zip(self.keys, self.shapes, self.dtypes,
                                                  self.offsets[:-1], self.offsets[1:], strict=True):
            part = vector[start:stop]
            if np.issubdtype(dtype, np.integer) or dtype == np.bool_:
                part = np.rint(part)
            state[key] = part.astype(dtype).reshape(shape)
        return state

    def problem_with(self, state: Mapping[str, np.ndarray]) -> str | None:
        """Why ``state`` cannot be aggregated with states of this spec (None when it can)."""
        missing = [k for k in self.keys if k not in state]
        extra = [k for k in state if k not in self.keys]
        if missing or extra:
            return (f"its arrays do not match the model: missing {missing[:3]}, "
                    f"unexpected {extra[:3]}")
        for key, shape, dtype in zip(self.keys, self.shapes, self.dtypes, strict=True):
            value = np.asarray(state[key])
            if tuple(value.shape) != shape:
                return f"array '{key}' has shape {tuple(value.shape)}, expected {shape}"
            if value.dtype != dtype:  # a float64 1e300 would overflow to inf in float32
                return f"array '{key}' has dtype {value.dtype}, expected {dtype}"
            if value.dtype.kind == "f" and not np.isfinite(value).all():
                return f"array '{key}' contains NaN or infinite values"
        return None


def weighted_average(vectors: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """``sum_i w_i v_i / sum_i w_i`` accumulated in float64 (FedAvg, docs/algorithms.md 1.6)."""
    if len(vectors) == 0:
        raise ValueError("weighted_average needs at least one vector.")
    if len(vectors) != len(weights):
        raise ValueError(f"{len(vectors)} vectors but {len(weights)} weights.")
    w = np.asarray(weights, dtype=np.float64)
    if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"Aggregation weights must be finite, >= 0 and not all 0; got {w}.")
    w = w / w.sum()
    acc = np.zeros(vectors[0].shape, dtype=np.float64)
    for vector, weight in zip(vectors, w, strict=True):
        if weight:
            acc += weight * vector
    return acc


def trimmed_mean(vectors: Sequence[np.ndarray], fraction: float) -> np.ndarray:
    """Per coordinate, the mean of the values left after dropping ``floor(fraction * n)`` of the
    smallest and as many of the largest (unweighted; Yin et al. 2018, "Byzantine-robust
    distributed learning: towards optimal statistical rates"). ``fraction = 0`` is the plain
    mean."""
    if len(vectors) == 0:
        raise ValueError("trimmed_mean needs at least one vector.")
    if not 0 <= fraction < 0.5:
        raise ValueError(f"The trimmed fraction must be in [0, 0.5), got {fraction}.")
    stacked = np.stack([np.asarray(v, dtype=np.float64) for v in vectors])
    cut = int(np.floor(fraction * len(vectors)))
    if cut:
        stacked = np.sort(stacked, axis=0)[cut:len(vectors) - cut]
    return stacked.mean(axis=0)


def coordinate_median(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """Per coordinate, the median of the clients' values (unweighted; the mean of the two middle
    values for an even count; Yin et al. 2018)."""
    if len(vectors) == 0:
        raise ValueError("coordinate_median needs at least one vector.")
    return np.median(np.stack([np.asarray(v, dtype=np.float64) for v in vectors]), axis=0)


def combine(vectors: Sequence[np.ndarray], weights: Sequence[float], rule: str = "mean",
            trim: float = 0.0) -> np.ndarray:
    """Combine client vectors by ``rule``: ``mean`` (weighted by ``weights``), ``trimmed-mean``
    or ``median`` (both unweighted)."""
    if rule == "mean":
        return weighted_average(vectors, weights)
    if rule == "trimmed-mean":
        return trimmed_mean(vectors, trim)
    if rule == "median":
        return coordinate_median(vectors)
    raise ValueError(f"Unknown aggregation rule {rule!r}.")


def update_norms(states: Sequence[Mapping[str, np.ndarray]], reference: Mapping[str, np.ndarray],
                 spec: FlatSpec) -> np.ndarray:
    """The norm of each state minus ``reference`` over ``spec``'s entries (float64)."""
    base = spec.flatten(reference, np.float64)
    return np.array([float(np.linalg.norm(spec.flatten(s, np.float64) - base)) for s in states])


def fedavg(states: Sequence[Mapping[str, np.ndarray]], num_examples: Sequence[float],
           spec: FlatSpec | None = None) -> State:
    """Sample-weighted average of model states, returned with the states' dtypes."""
    spec = spec or FlatSpec.of(states[0])
    return spec.unflatten(weighted_average([spec.flatten(s) for s in states], num_examples))


def mean_cosine(vectors: Sequence[np.ndarray], reference: np.ndarray) -> float:
    """Mean over ``vectors`` of their cosine with ``reference`` (0 for zero-length vectors)."""
    ref_norm = float(np.linalg.norm(reference))
    cosines = []
    for vector in vectors:
        norm = float(np.linalg.norm(vector)) * ref_norm
        cosines.append(float(vector @ reference) / norm if norm > 0 else 0.0)
    return float(np.mean(cosines)) if cosines else float("nan")


def l2_norm(state: Mapping[str, np.ndarray]) -> float:
    """Euclidean norm of a state viewed as one vector."""
    return float(np.sqrt(sum(float(np.vdot(v, v)) for v in state.values())))
