"""Differential privacy on the client's side: the primitives both sides use, and ``dp = local``.

:func:`clip`, :func:`gaussian_noise` and the keyed generators (:func:`noise_rng`) are the
building blocks of every release: the server's central one (:mod:`pflalign.server.privacy`) and
the client's own under ``dp = local`` (:func:`local_release`: the client clips and noises its
update before it leaves, so the server never sees it bare). How much noise a run adds, and what
it spends, is the server's accounting (:func:`pflalign.server.privacy.run_noise_multiplier`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

#: the random stream of the noise added to a round's sum of updates (and to its clip count)
NOISE_STREAM = 31
#: the random stream of a client's own noise (``dp = local``), keyed also by the client
LOCAL_NOISE_STREAM = 33


def clip(vector: np.ndarray, bound: float) -> tuple[np.ndarray, float]:
    """``vector`` scaled to an L2 norm of at most ``bound`` (float64), and its norm before. A
    vector already within the bound is returned unscaled."""
    if not bound > 0:
        raise ValueError(f"a clipping bound must be positive, got {bound}")
    vector = np.asarray(vector, dtype=np.float64)
    norm = float(np.linalg.norm(vector))
    if norm <= bound:
        return vector, norm
    return vector * (bound / norm), norm


def noise_rng(seed: int, server_round: int, stream: int = NOISE_STREAM,
              client: int | None = None) -> np.random.Generator:
    """The generator of round ``server_round``'s noise (and ``client``'s own, for local DP)."""
    key = [seed, server_round, stream] + ([] if client is None else [client])
    return np.random.default_rng(key)


def gaussian_noise(size: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """``size`` draws of N(0, std^2) in float64 (zeros when ``std`` is 0)."""
    if std < 0:
        raise ValueError(f"a noise standard deviation cannot be negative, got {std}")
    return rng.normal(0.0, std, size) if std > 0 else np.zeros(size)


def local_release(upload: Mapping[str, np.ndarray], received: Mapping[str, np.ndarray],
                  bound: float, std: float, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``dp = local``: a client's upload as it leaves the client: its floating-point entries'
    update over what it ``received`` (zero for an entry it did not receive) clipped to ``bound``
    as one vector and noised with N(0, std^2) per value. Other entries (integer counters, such
    as a batch norm's count of the batches it saw, which would tell the client's number of steps)
    leave as it received them, or as zeros."""
    keys = [k for k in upload if np.asarray(upload[k]).dtype.kind == "f"]
    if not keys:
        return dict(upload)
    flats = [np.asarray(upload[k], np.float64).reshape(-1) for k in keys]
    bases = [np.asarray(received[k], np.float64).reshape(-1) if k in received
             else np.zeros(f.size) for k, f in zip(keys, flats, strict=True)]
    base = np.concatenate(bases)
    clipped, _ = clip(np.concatenate(flats) - base, bound)
    released = base + clipped + gaussian_noise(base.size, std, rng)
    out = {k: (np.asarray(received[k]).copy() if k in received else np.zeros_like(v))
           for k, v in upload.items() if k not in keys}
    start = 0
    for key, flat in zip(keys, flats, strict=True):
        value = np.asarray(upload[key])
        out[key] = released[start:start + flat.size].astype(value.dtype).reshape(value.shape)
        start += flat.size
    return out
