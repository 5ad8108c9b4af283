"""Client sampling per round, reproducible from (seed, round) and the same for every method."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

SAMPLING_STREAM = 7
#: the stream of ``eval-fraction``'s draw of the clients evaluated in a round
EVAL_SAMPLING_STREAM = 13
#: the stream of ``eval-clients``'s draw of the clients every evaluation scores
EVAL_POPULATION_STREAM = 17
#: ``eval-clients = 0``: every client is evaluated up to this many, and a sample of this many
#: above it
EVAL_ALL_UP_TO = 10_000


def round_size(fraction: float, clients: int) -> int:
    """The clients a fixed-size round trains: ``max(1, round(fraction * clients))``."""
    return max(1, round(fraction * clients))


def expected_clients(sampling: str, fraction: float, clients: int) -> float:
    """The clients a round trains on average, of ``clients`` that can train: ``fraction`` of them
    under ``sampling = poisson``, else the fixed round size (DP-FedAvg's denominator ``m``)."""
    return fraction * clients if sampling == "poisson" else float(round_size(fraction, clients))


def sorted_ids(pool: Iterable[int]) -> np.ndarray:
    """``pool`` as a sorted int64 array (an array is sorted as it is: no walk of a million
    Python ints)."""
    if isinstance(pool, np.ndarray):
        return np.sort(pool.astype(np.int64, copy=False))
    return np.asarray(sorted(pool), dtype=np.int64)


def sample_clients(pool: Iterable[int], fraction: float, seed: int, server_round: int,
                   stream: int = SAMPLING_STREAM) -> list[int]:
    """``max(1, round(fraction * |pool|))`` distinct clients of ``pool``, sorted.

    The draw depends only on (seed, round, stream) and the sorted pool, so every method of a
    comparison trains (and, with ``eval-fraction``, evaluates) the same clients in the same round.
    """
    ordered = sorted_ids(pool)
    if not len(ordered):
        raise ValueError("Cannot sample from an empty pool of clients.")
    k = round_size(fraction, len(ordered))
    rng = np.random.default_rng([seed, server_round, stream])
    return sorted(int(c) for c in rng.choice(ordered, size=k, replace=False))


def draw_eval_population(clients: Iterable[int], eval_clients: int, seed: int) -> list[int] | None:
    """The clients every evaluation scores under ``eval-clients``, sorted: ``eval_clients`` of
    ``clients`` drawn by (seed, its own stream), or :data:`EVAL_ALL_UP_TO` of them when it is 0
    and there are more; None when every client is evaluated."""
    pool = np.fromiter(clients, dtype=np.int64)
    wanted = eval_clients or EVAL_ALL_UP_TO
    if wanted >= len(pool):
        return None
    pool.sort()
    rng = np.random.default_rng([seed, EVAL_POPULATION_STREAM])
    return sorted(int(c) for c in rng.choice(pool, size=wanted, replace=False))
