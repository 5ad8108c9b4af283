"""The simulated clock (``device-profiles``): deadlines, over-selection and availability.

With device profiles (:mod:`pflalign.server.clock`), a synchronous round samples among the
clients reachable when it starts (``availability``; the clock waits for the next when none is),
asks ``over-selection`` times the clients it wants, and uses the replies in order of their
simulated arrival, dropping those after ``round-deadline``; the round lasts until its last used
reply. The clock is this feature's: FedBuff (:mod:`pflalign.round.fedbuff`) moves it through
:meth:`SimulatedClock.advance_to`, and a checkpoint keeps it. A run with a time budget
(``time-budget``) reports the method's last evaluation by then.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from pflalign.methods.base import Method
from pflalign.round.feature import RoundFeature, Selection, TrainingRound, register
from pflalign.server.clock import (
    NONE,
    availability_of,
    close_round,
    profiles_of,
    sample_available,
)
from pflalign.settings.options import ConfigError
from pflalign.settings.schema import Settings
from pflalign.training.loops import num_local_steps
from pflalign.wire.messages import ClientInfo, Exchange, Outgoing
from pflalign.wire.protocol import KEPT_STATE
from pflalign.wire.traffic import records_bytes, sent_bytes


@register
class SimulatedClock(RoundFeature):
    """Each client's device profile and availability, and the run's simulated time."""

    name = "clock"

    @classmethod
    def wanted(cls, settings: Settings, method: Method) -> bool:
        return settings.run.device_profiles != NONE

    def __init__(self, loop):
        self.server = loop.server
        run = self.server.settings.run
        self.run = run
        clients = run.num_clients + run.num_unseen_clients
        self.profiles = profiles_of(run, clients)
        self.availability = availability_of(run, clients)
        #: the simulated seconds of the training rounds so far
        self.now = 0.0

    def advance_to(self, time: float) -> None:
        """Move the clock on to ``time`` (never back)."""
        self.now = max(self.now, float(time))

    def seconds(self, client: int, down: int, samples: int, up: int) -> float:
        """``client``'s simulated time to download ``down`` bytes, train ``samples`` and upload
        ``up`` bytes."""
        return self.profiles.seconds(client, down, samples, up)

    def charged_samples(self, info: ClientInfo) -> int:
        """The samples the clock charges a client's training: its training samples times
        ``local-epochs``, or ``local-steps`` times ``batch-size`` when the steps are capped (known
        to the server; never the client's own claim)."""
        training = self.server.settings.training
        steps = num_local_steps(info.num_train, training.batch_size, training.local_epochs,
                                training.local_steps)
        full = math.ceil(info.num_train / training.batch_size) * training.local_epochs
        return info.num_train * training.local_epochs if steps == full \
            else steps * training.batch_size

    # --- hooks ---------------------------------------------------------------------------------
    def start(self, loop) -> None:
        """Refuse, before any training, a ``round-deadline`` that no training client can meet
        even without uploading anything: the download of the global model and its compute
        already take longer."""
        deadline = self.run.round_deadline
        if deadline <= 0:
            return
        down = records_bytes([self.server.shared_model(loop.state)])
        fastest = min((self.seconds(cid, down, self.charged_samples(info), 0), cid)
                      for cid, info in self.server.clients.items() if not info.unseen)
        if fastest[0] > deadline:
            raise ConfigError(f"round-deadline = {deadline:g} simulated s is shorter than any "
                              f"client's round: the fastest, client {fastest[1]}, needs "
                              f"{fastest[0]:.4g} s to download the model and train, before its "
                              "upload; raise round-deadline.")

    def select(self, loop, server_round: int, wanted: int) -> Selection:
        """The round's clients: among those reachable when it starts (the clock waits for the
        next to become reachable when none is), ``over-selection`` times those it wants; the
        row's entries ``available`` and ``waited`` (simulated seconds the clock moved on)."""
        server, over = self.server, self.run.over_selection
        if self.availability is None:
            return Selection(server.sample(server_round, over) if over > 1
                             else server.sample(server_round), wanted)
        pool = server.training_ids()  # arrays: no Python int per client of a million
        reachable = self.availability.available_ids(pool, self.now)
        entries: dict = {}
        if not len(reachable):
            opening = self.availability.next_opening(pool, self.now)
            entries["waited"] = opening - self.now
            self.now = opening
            reachable = self.availability.available_ids(pool, self.now)
            loop.warn(f"round {server_round}: no client is reachable; the clock waits "
                      f"{entries['waited']:.0f} simulated s for the next.")
        entries["available"] = len(reachable)
        if len(reachable) < wanted:
            loop.warn(f"round {server_round}: {len(reachable)} of the {wanted} clients this "
                      "round wants are reachable; it trains those.")
        count = min(len(pool), max(1, round(wanted * over))) if over > 1 else wanted
        sampled = sample_available(reachable, count, server.seed, server_round)
        return Selection(sampled, min(wanted, len(sampled)), entries)

    def received(self, loop, training: TrainingRound) -> None:
        """Keep the replies the round uses, by their simulated arrival: each client's download
        of its message, its training samples at its compute speed and its upload of its reply; a
        failed or silent client never arrives. Adds ``sim-seconds``, ``sim-time``, and how many
        were ``late`` or ``unneeded``, to the row."""
        if not training.messages:  # sampling = poisson drew nobody: no time passes
            training.row.update({"sim-seconds": 0.0, "sim-time": self.now})
            return
        exchange = training.exchange
        arrivals = self.arrivals(training.messages, exchange)
        closed = close_round(arrivals, training.wanted, self.run.round_deadline)
        kept = set(closed.used)
        replies = [r for i, r in enumerate(exchange.replies)
                   if arrivals[i] is None or i in kept]  # failures stay, to be counted
        for i, reply in enumerate(exchange.replies):
            # a dropped client trained and keeps what it trained, on its device: its state is
            # one a checkpoint must ask for, as a used client's is
            if arrivals[i] is not None and i not in kept and reply.metrics.get(KEPT_STATE):
                loop.messaging.saved_state.add(reply.sender)
        self.now += closed.seconds
        training.exchange = Exchange(replies, exchange.bytes_down, exchange.bytes_up)
        training.row.update({"sim-seconds": closed.seconds, "sim-time": self.now})
        if self.run.round_deadline > 0:
            training.row["late"] = closed.late
        if self.run.over_selection > 1:
            training.row["unneeded"] = closed.unneeded
        if closed.late:
            loop.warn(f"round {training.number}: {closed.late} client(s) would reply after "
                      f"round-deadline = {self.run.round_deadline:g} simulated s; their "
                      "updates are not used.")

    def arrivals(self, messages: Sequence[Outgoing], exchange: Exchange) -> list[float | None]:
        """Each reply's simulated arrival (None: it never arrives)."""
        sent = {m.client: sent_bytes(m.payload.arrays) for m in messages}
        arrivals: list[float | None] = []
        for reply in exchange.replies:
            info = self.server.clients.get(reply.sender) if reply.sender is not None else None
            if reply.error is not None or reply.timed_out or info is None \
                    or reply.sender not in sent:
                arrivals.append(None)
                continue
            arrivals.append(self.seconds(reply.sender, sent[reply.sender],
                                         self.charged_samples(info),
                                         records_bytes(reply.arrays.values())))
        return arrivals

    def final(self, loop, final: dict) -> None:
        """With ``time-budget``: the method's last evaluation in a round that ended by then (the
        round, its clock and accuracies), or only the budget when none did."""
        budget = self.run.time_budget
        if budget <= 0:
            return
        within = [r for r in loop.rounds if "personal-acc" in r and r["sim-time"] <= budget]
        out: dict = {"budget": budget}
        if within:
            row = within[-1]
            out.update({"round": row["round"], "sim-time": row["sim-time"],
                        **{k: row[k] for k in ("personal-acc", "global-acc", "unseen-acc")
                           if k in row}})
        final["at-time-budget"] = out

    def state_dict(self) -> dict:
        return {"sim-time": self.now}

    def load_state_dict(self, state: Mapping) -> None:
        self.now = float(state["sim-time"])
