"""``mode = async``: FedBuff's rounds for one round loop, on the simulated clock or in real time.

A round is one aggregation. The loop keeps ``concurrency`` clients in flight
(:class:`~pflalign.server.buffered.Schedule`): a client is dispatched with the model version
current at that moment (its message is built then, by the method's ``train_payload``), trains
from it, and its reply reaches the server at ``start + download + compute + upload`` simulated
seconds (:mod:`pflalign.server.clock`). Arrivals are taken in order of arrival; each is
validated as a synchronous reply is, and a usable one goes into the buffer; a client that
arrives (or fails) is replaced at once by a client drawn among those reachable and not in
flight and whose update is not waiting in the buffer
(:func:`~pflalign.server.buffered.draw_client`). When the buffer holds ``buffer-size``
updates, each is rebased onto the current model with its staleness weight
(:func:`~pflalign.server.buffered.rebase`), bounded as a synchronous round's updates are, and
aggregated by the method's own rule with ``async-lr``; the arrival that filled the buffer is
replaced after the aggregation, with the new model (a message of the next round; after the
last round, nobody is dispatched).

**Training runs when it is needed, with the result of training at dispatch.** A client's
training depends only on the message it was dispatched with and its own state, and no other
training can touch that state while it is in flight, so the loop trains a dispatched client
only when its reply might be the next to arrive (its lower bound, download and compute, comes
before the first known arrival), every such client in one exchange; before an evaluation and
before a checkpoint it trains every client in flight, so that an evaluation sees each client as
it is after its latest dispatch, and a checkpoint holds replies, never messages. The metrics do
not depend on when the training ran: every engine gives the same, bit for bit, and a resumed
run equals an uninterrupted one.

A row's ``bytes-down`` are the messages dispatched in its round and ``bytes-up`` the replies
that arrived in it (array bytes, as the clock counts them); ``clients-trained`` the updates
aggregated, ``arrivals`` all the replies that arrived (failed and rejected ones included),
``staleness-mean`` and ``staleness-max`` those of the aggregated updates, ``in-flight`` the
clients in flight after the round's dispatches.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pflalign.process.interrupt import check_stop
from pflalign.round.features.clock import SimulatedClock
from pflalign.round.synchronous import Scheduler
from pflalign.server.buffered import (
    Flight,
    Schedule,
    async_sizes,
    draw_client,
    rebase,
    staleness_weight,
)
from pflalign.wire.messages import Outgoing, Reply, Stale, Update
from pflalign.wire.protocol import TRAIN
from pflalign.wire.state import State
from pflalign.wire.traffic import records_bytes, sent_bytes

#: seconds between two polls for replies in real time
POLL_SECONDS = 0.05
#: the separator of the array names of an asynchronous checkpoint's entries
SEP = "|"


def _json_number(value: object) -> object:
    """A reply metric as JSON keeps it (ints stay ints, NumPy scalars become Python ones)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    return value


@dataclass
class Arrivals:
    """A round's arrivals: how many, their bytes, and how many failed, timed out or were
    rejected."""

    count: int = 0
    bytes_up: int = 0
    failed: int = 0
    timed_out: int = 0
    rejected: int = 0


class BufferedRounds(Scheduler):
    """The asynchronous rounds of one :class:`~pflalign.round.loop.RoundLoop` on the simulated
    clock (see the module docstring), which is the clock feature's
    (:class:`~pflalign.round.features.clock.SimulatedClock`)."""

    def __init__(self, loop, clock: SimulatedClock | None):
        super().__init__(loop)
        self.clock = clock
        run = loop.server.settings.run
        pool = loop.server.training_clients()
        self.concurrency, self.buffer_size = async_sizes(len(pool), run.fraction_train,
                                                         min(run.concurrency, len(pool)),
                                                         run.buffer_size)
        self.buffer_size = min(self.buffer_size, self.concurrency)
        self.exponent = run.staleness_exponent
        self.lr = run.async_lr
        self.schedule = Schedule()
        #: untrained flights' messages, and trained flights' replies, by dispatch number
        self.messages: dict[int, Outgoing] = {}
        self.replies: dict[int, Reply] = {}
        #: the exchanged global model of each version a flight trains from
        self.bases: dict[int, State] = {}
        #: aggregations so far (the version of the current model)
        self.version = 0
        #: the round's arrived, usable updates with the version each trained from
        self.buffer: list[tuple[Update, int]] = []

    def describe(self) -> str:
        return (f"asynchronous: {self.concurrency} clients in flight, aggregating every "
                f"{self.buffer_size} arrivals")

    # --- dispatching and training --------------------------------------------------------------
    def fill(self, server_round: int) -> int:
        """Dispatch clients until ``concurrency`` are in flight (or none is left to dispatch),
        at the clock's time, or when the next becomes reachable; returns their message bytes."""
        loop, server = self.loop, self.loop.server
        pool = server.training_clients()
        sent = 0
        while len(self.schedule.flights) < self.concurrency:
            candidates = self.candidates(pool, self.schedule.flying())
            if not candidates:
                break
            clock = self.clock
            start = clock.now
            if clock.availability is not None:
                reachable = clock.availability.available(candidates, start)
                if not reachable:  # the slot stays empty until a client can be reached
                    start = clock.availability.next_opening(candidates, start)
                    reachable = clock.availability.available(candidates, start)
                candidates = reachable
            client = draw_client(candidates, server.seed, self.schedule.seq)
            message, down = self.dispatched(client, server_round)
            samples = clock.charged_samples(server.clients[client])
            earliest = start + clock.seconds(client, down, samples, 0)
            flight = self.schedule.dispatch(client, self.version, start, earliest, down, samples)
            loop.dispatched([client])
            self.messages[flight.seq] = message
            sent += down
        return sent

    def candidates(self, pool: Sequence[int], flying: set[int]) -> list[int]:
        """The clients of ``pool`` that may be dispatched: not in flight, and without an update
        waiting in the buffer (one update per client and aggregation, as in a synchronous
        round)."""
        busy = flying | {update.client for update, _ in self.buffer}
        return [c for c in pool if c not in busy]

    def dispatched(self, client: int, server_round: int) -> tuple[Outgoing, int]:
        """The training message of ``client`` dispatched now (the method's payload from the
        current server state; the current model kept as what it trains from), and its bytes."""
        loop, server = self.loop, self.loop.server
        payload = loop.method.train_payload(server, loop.state, client, server_round)
        if self.version not in self.bases:
            self.bases[self.version] = server.shared_model(loop.state)
        return loop.messaging.message(client, payload, server_round), sent_bytes(payload.arrays)

    def train(self, flights: Sequence[Flight]) -> None:
        """Train ``flights`` in one exchange and set each one's arrival (a client that failed
        or gave no reply "arrives" at its lower bound, to be counted and replaced)."""
        loop = self.loop
        exchange = loop.messaging.exchange(TRAIN, [self.messages.pop(f.seq) for f in flights])
        replies = {r.sender: r for r in exchange.replies if r.sender is not None}
        stray = [r for r in exchange.replies if r.sender is None]
        if stray:  # said once here; their clients' flights fail below
            loop.messaging.validator.collect(stray, {}, {})
        for flight in flights:
            reply = replies.get(flight.client) or Reply(
                flight.client, f"client {flight.client}",
                error="gave no reply the server could attribute to it")
            if reply.error is None:
                flight.arrival = flight.start + self.clock.seconds(
                    flight.client, flight.down, flight.samples,
                    records_bytes(reply.arrays.values()))
                # it trained now, from the state it had: a client known to keep state that
                # had none is warned about, and one that keeps state is asked for it by
                # checkpoints from now on (its update is used later, or never)
                loop.messaging.check_kept_state([Update(flight.client, 0, reply.metrics, None)])
            else:
                flight.arrival = flight.earliest
            self.replies[flight.seq] = reply

    def before_evaluation(self) -> None:
        """Train every client in flight that has not trained yet (before an evaluation or a
        checkpoint)."""
        untrained = sorted(self.schedule.untrained(), key=lambda f: f.seq)
        if untrained:
            self.train(untrained)

    # --- a round -------------------------------------------------------------------------------
    def round(self, server_round: int) -> tuple[dict, int, int]:
        """One aggregation: its row entries, and the bytes sent down and up in it."""
        loop, clock = self.loop, self.clock
        begun = clock.now
        down = self.fill(server_round)  # the first round's clients (later ones: none to add)
        arrivals = Arrivals()
        self.buffer = []
        while len(self.buffer) < self.buffer_size and self.schedule.flights:
            needed = self.schedule.must_train()
            if needed:
                self.train(needed)
                continue
            flight = self.schedule.next_arrival()
            clock.advance_to(flight.arrival)
            reply = self.replies.pop(flight.seq)
            self.arrive(reply, flight.version, arrivals,
                        records_bytes(reply.arrays.values()) if reply.error is None else 0)
            if len(self.buffer) < self.buffer_size:
                down += self.fill(server_round)
        row = self.aggregate(server_round, arrivals)
        if server_round < loop.server.rounds:  # the arrival that filled the buffer is replaced
            down += self.fill(server_round + 1)
        row.update({"sim-seconds": clock.now - begun, "sim-time": clock.now,
                    "in-flight": len(self.schedule.flights)})
        return row, down, arrivals.bytes_up

    def busy(self) -> set[int]:
        """Clients an evaluation leaves out (none: in simulation a client in flight has
        trained, and is evaluated as it is after its training)."""
        return set()

    def arrive(self, reply: Reply, version: int, arrivals: Arrivals, up: int) -> None:
        """Take an arrived reply of a client that trained from ``version``: validated as a
        synchronous reply is, and into the buffer when usable; counted in ``arrivals``."""
        loop = self.loop
        collected = loop.messaging.collect_training([reply])
        arrivals.count += 1
        arrivals.bytes_up += up
        arrivals.failed += collected.failed
        arrivals.timed_out += collected.timed_out
        arrivals.rejected += collected.rejected
        for metrics, arrays in collected.good:
            self.buffer.append((loop.messaging.update_of(metrics, arrays), version))

    def aggregate(self, server_round: int, arrivals: Arrivals) -> dict:
        """Aggregate the buffer (rebased, bounded, the method's rule with ``async-lr``) into the
        next version; returns the row's entries."""
        loop = self.loop
        updates, staleness = self.rebased(self.buffer)
        self.buffer = []
        updates.sort(key=lambda u: u.client)  # the order a synchronous round aggregates in
        row: dict = {"clients-trained": 0, "arrivals": arrivals.count,
                     "failures": arrivals.failed, "timeouts": arrivals.timed_out,
                     "rejected": arrivals.rejected}
        updates = loop.bound(server_round, updates, row)
        row["clients-trained"] = len(updates)
        loop.accepted(u.metrics for u in updates)
        if staleness:
            row.update({"staleness-mean": float(np.mean(staleness)),
                        "staleness-max": int(max(staleness))})
        row = loop.aggregate(server_round, updates, row, self.lr)
        self.version = server_round
        self.forget_bases()
        return row

    def rebased(self, buffer: Sequence[tuple[Update, int]]) -> tuple[list[Update], list[int]]:
        """The buffer's updates rebased onto the current model with their staleness weights,
        and each one's staleness."""
        server = self.loop.server
        current = server.shared_model(self.loop.state)
        updates, staleness = [], []
        for update, version in buffer:
            stale = self.version - version
            staleness.append(stale)
            if update.model is None:
                updates.append(update)
                continue
            weight = staleness_weight(stale, self.exponent)
            base = self.bases[version]
            model = rebase(update.model, base, current, weight, stale > 0)
            updates.append(dataclasses.replace(
                update, model=model,
                stale=Stale(update.model, base, stale, weight) if stale else None))
        return updates, staleness

    def forget_bases(self) -> None:
        """Drop the global models no flight trains from (the current one is kept for the next
        dispatches)."""
        used = {f.version for f in self.schedule.flights.values()}
        self.bases = {v: b for v, b in self.bases.items() if v in used}

    # --- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> tuple[dict, State]:
        """What a checkpoint keeps (call :meth:`before_evaluation` first): JSON metadata (the
        flights, the dispatch count, each trained flight's reply without its arrays) and the arrays
        (the replies' records and the base models), named ``reply|seq|record|key`` and
        ``base|version|key``."""
        if self.messages:
            raise RuntimeError("train every client in flight before saving the schedule")
        arrays: State = {}
        replies = {}
        for seq, reply in self.replies.items():
            replies[str(seq)] = {"sender": reply.sender, "who": reply.who,
                                 "metrics": {k: _json_number(v) for k, v in reply.metrics.items()},
                                 "error": reply.error, "timed-out": reply.timed_out,
                                 "refused": reply.refused,
                                 "records": sorted(reply.arrays)}
            for record, state in reply.arrays.items():
                for key, value in state.items():
                    arrays[SEP.join(("reply", str(seq), record, key))] = np.asarray(value)
        for version, base in self.bases.items():
            for key, value in base.items():
                arrays[SEP.join(("base", str(version), key))] = np.asarray(value)
        meta = {"version": self.version, "seq": self.schedule.seq,
                "flights": [f.to_json() for f in sorted(self.schedule.flights.values())],
                "replies": replies}
        return meta, arrays

    def load_state_dict(self, meta: Mapping, arrays: Mapping[str, np.ndarray]) -> None:
        """Continue from what :meth:`state_dict` gave."""
        self.version = int(meta["version"])
        self.schedule = Schedule()
        self.schedule.seq = int(meta["seq"])
        for row in meta["flights"]:
            flight = Flight.from_json(row)
            self.schedule.flights[flight.seq] = flight
        records: dict[int, dict[str, State]] = {}
        self.bases = {}
        for name, value in arrays.items():
            kind, owner, rest = name.split(SEP, 2)
            if kind == "reply":
                record, key = rest.split(SEP, 1)
                records.setdefault(int(owner), {}).setdefault(record, {})[key] = value
            else:
                self.bases.setdefault(int(owner), {})[rest] = value
        self.messages = {}
        self.replies = {
            int(seq): Reply(entry["sender"], entry["who"], metrics=dict(entry["metrics"]),
                            arrays={r: records.get(int(seq), {}).get(r, {})
                                    for r in entry["records"]},
                            error=entry["error"], timed_out=entry["timed-out"],
                            refused=entry["refused"])
            for seq, entry in meta["replies"].items()}


class RealTimeRounds(BufferedRounds):
    """``mode = async`` in real time, on an engine that can submit messages and poll for their
    replies (the Flower engine, without device profiles): the server pushes a message to each
    client it dispatches (Flower's ``Grid.push_messages``) and takes the replies in the order
    they are pulled (``Grid.pull_messages``), aggregating every ``buffer-size`` usable ones, so
    that a slow or silent client holds up only its own slot (until ``round-timeout``, when it is
    counted as timed out and replaced). Dispatch draws, staleness, rebasing and the method's
    rule are :class:`BufferedRounds`'; the order of arrivals is the network's, so such a run is
    not reproducible. An evaluation leaves out the clients in flight (they are busy training;
    the row's ``eval-busy``), and no checkpoint is written (the replies in flight cannot be
    kept)."""

    def __init__(self, loop):
        super().__init__(loop, None)
        #: the clients in flight, with the version each trains from
        self.flights: dict[int, int] = {}
        self.draws = 0
        #: replies pulled and not yet taken (the buffer filled before them)
        self.pulled: list[tuple[int, Reply, int]] = []

    def busy(self) -> set[int]:
        return set(self.flights)

    def fill(self, server_round: int) -> int:
        """Dispatch clients until ``concurrency`` are in flight, and push their messages."""
        pool = self.loop.server.training_clients()
        messages = []
        while len(self.flights) < self.concurrency:
            candidates = self.candidates(pool, set(self.flights))
            if not candidates:
                break
            client = draw_client(candidates, self.loop.server.seed, self.draws)
            self.draws += 1
            message, _ = self.dispatched(client, server_round)
            self.flights[client] = self.version
            self.loop.dispatched([client])
            messages.append(message)
        if not messages:
            return 0
        return self.loop.engine.submit(TRAIN, self.loop.messaging.prepared(TRAIN, messages))

    def before_evaluation(self) -> None:
        """Nothing: a real client trains when its message reaches it."""

    def checkpoint_refusal(self, server_round: int) -> str | None:
        return ("no checkpoints are written in real-time asynchronous rounds (the replies in "
                "flight cannot be kept); a killed run starts over.")

    def round(self, server_round: int) -> tuple[dict, int, int]:
        loop = self.loop
        down = self.fill(server_round)
        arrivals = Arrivals()
        self.buffer = []
        while len(self.buffer) < self.buffer_size and self.flights:
            check_stop()
            if not self.pulled:
                self.pulled = [entry for entry in loop.engine.poll()
                               if entry[0] in self.flights]
                if not self.pulled:
                    time.sleep(POLL_SECONDS)
                continue
            client, reply, up = self.pulled.pop(0)
            loop.messaging.delivered([reply])
            if reply.error is None:
                loop.messaging.check_kept_state([Update(client, 0, reply.metrics, None)])
            self.arrive(reply, self.flights.pop(client), arrivals, up)
            if len(self.buffer) < self.buffer_size:
                down += self.fill(server_round)
        row = self.aggregate(server_round, arrivals)
        if server_round < loop.server.rounds:
            down += self.fill(server_round + 1)
        row["in-flight"] = len(self.flights)
        return row, down, arrivals.bytes_up

    def forget_bases(self) -> None:
        used = set(self.flights.values())
        self.bases = {v: b for v, b in self.bases.items() if v in used}
