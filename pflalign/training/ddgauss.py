"""The distributed discrete Gaussian mechanism, a client's and the server's arithmetic (``dp =
distributed``; Kairouz, Liu and Steinke, "The Distributed Discrete Gaussian Mechanism for
Federated Learning with Secure Aggregation", ICML 2021, Algorithm 1).

A client turns its real update ``x`` (``d`` values) into integers that secure aggregation can
sum modulo ``m = 2^32``, with its share of the noise already in them:

1. clip and scale: ``x' = min(1, c / ||x||_2) x / gamma`` (``c``: the L2 clip, ``gamma``: the
   granularity of the integer grid);
2. flatten: ``x'' = H D x'``, zero-padded to ``d'``, the next power of two, with ``D`` a diagonal
   of random signs that every client and the server share for the round and ``H`` the
   orthonormal Walsh-Hadamard matrix (:func:`hadamard`), so that no coordinate carries much more
   than ``||x'|| / sqrt(d')``;
3. conditional randomized rounding: each coordinate rounded up with probability its fractional
   part, repeated until ``||x~||_2 <= Delta_2`` (the paper's Theorem 1 bound,
   :func:`pflalign.server.distributed_dp.rounded_l2_bound`; it holds with probability at least
   ``1 - beta`` on each try);
4. perturb: ``y = x~ + N_Z(0, sigma^2)^{d'}``, the discrete Gaussian (:func:`discrete_gaussian`);
5. reduce modulo ``m``.

The server unmasks the sum modulo ``m``, maps it back to ``[-m/2, m/2)``, undoes the rotation
and the scaling (:func:`decode`): the sum of the clipped updates plus the sum of the clients'
noise, in real units.

The discrete Gaussian is sampled as Canonne, Kamath and Steinke ("The Discrete Gaussian for
Differential Privacy", NeurIPS 2020, Algorithm 3) do: a discrete Laplace proposal of scale
``t = floor(sigma) + 1``, accepted with probability ``exp(-(|y| - sigma^2/t)^2 / (2 sigma^2))``;
here in floating point and over whole vectors at once (the paper's exact sampler works in
rational arithmetic, one value at a time).
"""

from __future__ import annotations

import math

import numpy as np

#: SecAgg+'s modulus: sums are taken modulo 2^32
MODULUS = 1 << 32
#: how many roundings a client tries before it gives up (each succeeds with probability at least
#: 1 - beta; 0.39 at the default beta = exp(-0.5))
MAX_ROUNDINGS = 1000


def padded_size(dim: int) -> int:
    """The next power of two at or above ``dim`` (the Walsh-Hadamard transform's size)."""
    if dim < 1:
        raise ValueError(f"a vector needs at least one value, got {dim}")
    return 1 << (dim - 1).bit_length()


def hadamard(vector: np.ndarray) -> np.ndarray:
    """The orthonormal Walsh-Hadamard transform ``H v`` of a vector of a power-of-two length
    (Sylvester's order; ``H`` is symmetric and its own inverse), in ``log2(len)`` vectorized
    butterfly stages."""
    values = np.array(vector, dtype=np.float64)
    size = values.size
    if size & (size - 1):
        raise ValueError(f"the Walsh-Hadamard transform needs a power-of-two length, got {size}")
    half = 1
    while half < size:  # each stage in place: (a, b) -> (a + b, a - b)
        blocks = values.reshape(-1, 2, half)
        first = blocks[:, 0].copy()
        blocks[:, 0] += blocks[:, 1]
        np.subtract(first, blocks[:, 1], out=blocks[:, 1])
        half *= 2
    return values / math.sqrt(size)


def rotation_signs(size: int, rng: np.random.Generator) -> np.ndarray:
    """The diagonal ``D``: ``size`` independent signs, +1 or -1 with probability 1/2."""
    return rng.integers(0, 2, size=size).astype(np.float64) * 2 - 1


def rotate(vector: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """``H D v``, ``v`` zero-padded to the length of ``signs``."""
    padded = np.zeros(signs.size)
    padded[:vector.size] = vector
    return hadamard(signs * padded)


def unrotate(vector: np.ndarray, signs: np.ndarray, dim: int) -> np.ndarray:
    """``D H v`` (the inverse of :func:`rotate`), its first ``dim`` values."""
    return (signs * hadamard(vector))[:dim]


def discrete_gaussian(size: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """``size`` independent draws of the discrete Gaussian ``N_Z(0, sigma^2)``
    (``P(y) ~ exp(-y^2 / (2 sigma^2))`` on the integers), as int64; zeros when ``sigma`` is 0."""
    if sigma < 0:
        raise ValueError(f"a noise scale cannot be negative, got {sigma}")
    out = np.zeros(size, dtype=np.int64)
    if sigma == 0 or size == 0:
        return out
    t = math.floor(sigma) + 1
    missing = np.arange(size)
    while missing.size:
        # a discrete Laplace of scale t, as the difference of two geometric variables of ratio
        # exp(-1/t), each the floor of t times a standard exponential
        draws = rng.standard_exponential((2, missing.size))
        proposal = (np.floor(t * draws[0]) - np.floor(t * draws[1])).astype(np.int64)
        accept = rng.random(missing.size) < np.exp(
            -(np.abs(proposal) - sigma ** 2 / t) ** 2 / (2 * sigma ** 2))
        out[missing[accept]] = proposal[accept]
        missing = missing[~accept]
    return out


def conditional_round(vector: np.ndarray, bound: float, rng: np.random.Generator) -> np.ndarray:
    """Each value rounded to the integer below or above it, up with probability its fractional
    part (unbiased), repeated until the result's L2 norm is at most ``bound`` (int64)."""
    low = np.floor(vector)
    fraction = vector - low
    for _ in range(MAX_ROUNDINGS):
        rounded = low + (rng.random(vector.shape) < fraction)
        if float(np.linalg.norm(rounded)) <= bound:
            return rounded.astype(np.int64)
    raise ValueError(f"no randomized rounding of the update fell within the L2 bound {bound:.6g} "
                     f"in {MAX_ROUNDINGS} tries: the bound is below what a rounding of a "
                     "vector of this norm reaches (the vector was not clipped to the bound's "
                     "clip)")


def encode(update: np.ndarray, clip: float, gamma: float, signs: np.ndarray, bound: float,
           sigma: float, rounding: np.random.Generator, noise: np.random.Generator,
           modulus: int = MODULUS) -> np.ndarray:
    """A client's update as it enters secure aggregation (steps 1-5 of the module docstring):
    ``len(signs)`` integers in ``[0, modulus)`` (uint64). ``rounding`` draws the rounding;
    ``noise`` draws the noise (the client's own generator)."""
    update = np.asarray(update, dtype=np.float64)
    norm = float(np.linalg.norm(update))
    scaled = update * (min(1.0, clip / norm) if norm > 0 else 1.0) / gamma
    rounded = conditional_round(rotate(scaled, signs), bound, rounding)
    noised = rounded + discrete_gaussian(signs.size, sigma, noise)
    return (noised % modulus).astype(np.uint64)


def signed(total: np.ndarray, modulus: int = MODULUS) -> np.ndarray:
    """A sum modulo ``modulus`` as the integer it stands for in ``[-modulus/2, modulus/2)``."""
    values = (np.asarray(total, dtype=np.uint64) % modulus).astype(np.int64)
    return np.where(values >= modulus // 2, values - modulus, values)


def decode(total: np.ndarray, gamma: float, signs: np.ndarray, dim: int,
           modulus: int = MODULUS) -> np.ndarray:
    """The server's side: the unmasked sum modulo ``modulus`` of the clients' encodings back in
    real units (float64, ``dim`` values): the sum of their clipped updates plus their noise."""
    return unrotate(signed(total, modulus).astype(np.float64), signs, dim) * gamma
