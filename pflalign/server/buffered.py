"""Asynchronous, buffered aggregation (FedBuff: Nguyen et al., "Federated Learning with Buffered
Asynchronous Aggregation", AISTATS 2022): the pieces that involve no engine.

The server keeps ``concurrency`` clients in flight. A client trains from the model version that
was current when it was dispatched; when its reply arrives it goes into a buffer, and every
``buffer-size`` arrivals the server aggregates the buffer and moves to the next version. An update
that is ``s`` versions stale (dispatched at version ``tau``, aggregated into version ``v + 1``
with ``s = v - tau``) is weighted ``w(s) = (1 + s)^-a`` (``staleness-exponent`` a; FedBuff's
``1 / sqrt(1 + s)`` at a = 0.5), and the model moves by the server learning rate eta_g
(``async-lr``) times the buffer's weighted mean update:

    x_{v+1} = x_v + eta_g * sum_i n_i w(s_i) (y_i - x_{tau_i}) / sum_i n_i

with ``y_i`` the uploaded model and ``n_i`` its sample count (the run's aggregation weights, as a
synchronous round's; FedBuff's paper averages unweighted). The round loop gives a method's own
server rule each update *rebased* onto the current model, ``x_v + w(s_i) (y_i - x_{tau_i})``
(:func:`rebase`), so that its weighted average is exactly the line above before eta_g; an update
that is not stale is passed as it is, bit for bit. The scheduler itself (which client arrives
when) is :class:`Schedule`, on the simulated clock of :mod:`pflalign.server.clock`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from pflalign.server.sampling import round_size
from pflalign.wire.state import State

#: the random stream of the clients drawn to replace those that arrive
DISPATCH_STREAM = 23


def async_sizes(num_clients: int, fraction_train: float, concurrency: int,
                buffer_size: int) -> tuple[int, int]:
    """The run's clients in flight and buffer size: ``concurrency`` (0: as many as a
    synchronous round samples, ``max(1, round(fraction_train * num_clients))``) and
    ``buffer_size`` (0: half of that, rounded up)."""
    flying = concurrency or round_size(fraction_train, num_clients)
    return flying, buffer_size or (flying + 1) // 2


def staleness_weight(staleness: int, exponent: float) -> float:
    """``(1 + staleness)^-exponent``: 1 for a fresh update (and for every update at exponent 0)."""
    if staleness < 0:
        raise ValueError(f"a staleness cannot be negative ({staleness})")
    return 1.0 if staleness == 0 or exponent == 0 else float((1.0 + staleness) ** -exponent)


def rebase(upload: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray],
           current: Mapping[str, np.ndarray], weight: float, stale: bool) -> State:
    """The upload ``upload`` of a client that trained from ``base``, rebased onto ``current``:
    ``current + weight * (upload - base)`` for each floating-point entry, computed in float64
    and stored in the entry's dtype; other entries (counters) as uploaded. A fresh update
    (``stale`` false, so ``base`` is ``current``) at weight 1 is returned as it is."""
    if not stale and weight == 1.0:
        return dict(upload)
    out: State = {}
    for key, value in upload.items():
        value = np.asarray(value)
        if value.dtype.kind != "f":
            out[key] = value
            continue
        moved = np.asarray(current[key], np.float64) + weight * (
            value.astype(np.float64) - np.asarray(base[key], np.float64))
        out[key] = moved.astype(value.dtype)
    return out


def server_step(current: Mapping[str, np.ndarray], aggregate: Mapping[str, np.ndarray],
                lr: float) -> State:
    """``current + lr * (aggregate - current)`` on the floating-point entries of ``aggregate``
    (the aggregate as it is at ``lr`` = 1, and for other entries)."""
    if lr == 1.0:
        return dict(aggregate)
    return rebase(aggregate, current, current, lr, stale=True)


@dataclass(order=True)
class Flight:
    """A client in flight: dispatched at ``start`` (simulated seconds) with model version
    ``version``; ``seq`` orders dispatches. Once trained, ``arrival`` is when its reply reaches
    the server (None until then); ``earliest`` bounds it from below before it is trained (its
    download and compute, without the upload)."""

    seq: int
    client: int = field(compare=False)
    version: int = field(compare=False)
    start: float = field(compare=False)
    earliest: float = field(compare=False)
    #: the array bytes of its message and the samples the server charges its training
    down: int = field(default=0, compare=False)
    samples: int = field(default=0, compare=False)
    arrival: float | None = field(default=None, compare=False)

    def to_json(self) -> list:
        return [self.seq, self.client, self.version, self.start, self.earliest, self.down,
                self.samples, self.arrival]

    @classmethod
    def from_json(cls, row: Sequence) -> Flight:
        seq, client, version, start, earliest, down, samples, arrival = row
        return cls(int(seq), int(client), int(version), float(start), float(earliest),
                   int(down), int(samples), None if arrival is None else float(arrival))


class Schedule:
    """The clients in flight on the simulated clock, in dispatch order.

    :meth:`next_arrival` gives the flight whose reply arrives first, once it is certain: when no
    untrained flight could arrive before it (an untrained flight's arrival is at least its
    ``earliest``). Until then it names the untrained flights that must be trained first
    (:meth:`must_train`), so an engine trains as many together as it can. Ties in arrival time
    go to the earlier dispatch."""

    def __init__(self) -> None:
        self.flights: dict[int, Flight] = {}
        self.seq = 0

    def dispatch(self, client: int, version: int, start: float, earliest: float,
                 down: int = 0, samples: int = 0) -> Flight:
        flight = Flight(self.seq, client, version, start, earliest, down, samples)
        self.flights[flight.seq] = flight
        self.seq += 1
        return flight

    def flying(self) -> set[int]:
        return {f.client for f in self.flights.values()}

    def untrained(self) -> list[Flight]:
        return [f for f in self.flights.values() if f.arrival is None]

    def _first_trained(self) -> Flight | None:
        trained = [(f.arrival, f.seq) for f in self.flights.values() if f.arrival is not None]
        return self.flights[min(trained)[1]] if trained else None

    def must_train(self) -> list[Flight]:
        """The untrained flights that could arrive no later than the first trained one (all of
        them when none is trained), in dispatch order; empty when the next arrival is known."""
        first = self._first_trained()
        return sorted((f for f in self.untrained()
                       if first is None or f.earliest <= first.arrival), key=lambda f: f.seq)

    def next_arrival(self) -> Flight:
        """Remove and return the flight that arrives next (:meth:`must_train` must be empty)."""
        if self.must_train():
            raise RuntimeError("flights that may arrive first are not trained yet")
        first = self._first_trained()
        if first is None:
            raise RuntimeError("no client is in flight")
        return self.flights.pop(first.seq)


def draw_client(pool: Sequence[int], seed: int, draw: int) -> int:
    """One client of ``pool`` (sorted first), drawn from (seed, draw number,
    :data:`DISPATCH_STREAM`): the same on every engine and in a resumed run."""
    ordered = sorted(pool)
    if not ordered:
        raise ValueError("no client to dispatch")
    rng = np.random.default_rng([seed, draw, DISPATCH_STREAM])
    return int(ordered[int(rng.integers(len(ordered)))])

