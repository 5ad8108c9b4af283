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


#: eval-clients: at least this many of each kind of client (seen, unseen) are drawn, where there
#: are that many, so that the smaller kind keeps its metric and interval
EVAL_MIN_PER_KIND = 100


def draw_eval_population(seen: Iterable[int], unseen: Iterable[int], eval_clients: int,
                         seed: int) -> list[int] | None:
    """The clients every evaluation scores under ``eval-clients``, sorted: ``eval_clients`` of
    them (:data:`EVAL_ALL_UP_TO` when it is 0), the seen and the unseen drawn apart by (seed, its
    own stream), each in proportion to its number, the smaller kind at least
    :data:`EVAL_MIN_PER_KIND` (or all of it; at most half the sample); None when every client
    is evaluated."""
    groups = [sorted_ids(group) for group in (seen, unseen)]
    total = sum(len(g) for g in groups)
    wanted = eval_clients or EVAL_ALL_UP_TO
    if wanted >= total:
        return None
    least = min(EVAL_MIN_PER_KIND, wanted // 2)
    take_unseen = min(len(groups[1]), max(round(wanted * len(groups[1]) / total), least))
    take_seen = min(len(groups[0]), wanted - take_unseen)
    take_unseen = min(len(groups[1]), wanted - take_seen)
    drawn: list[int] = []
    for kind, (group, take) in enumerate(zip(groups, (take_seen, take_unseen), strict=True)):
        if take:  # the seen clients' stream is (seed, stream), the unseen's one more entry
            key = [seed, EVAL_POPULATION_STREAM] if kind == 0 else [seed, EVAL_POPULATION_STREAM,
                                                                    kind]
            rng = np.random.default_rng(key)
            drawn += rng.choice(group, size=take, replace=False).tolist()
    return sorted(drawn)
