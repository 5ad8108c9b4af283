"""The two schedulers' interface, and synchronous rounds (``mode = sync``).

A scheduler runs a round loop's training rounds: :class:`SynchronousRounds` samples the
round's clients, sends them the method's training payloads in one exchange, and aggregates the
replies that pass; FedBuff (:mod:`pflalign.round.fedbuff`) keeps clients in flight and
aggregates buffers of arrivals. Both reach the loop through its public calls only (messages,
exchanges, the features' ``bound`` and ``release``, aggregation); neither writes the other's
state. The round features (:mod:`pflalign.round.feature`) act at the points named in their
hooks.
"""

from __future__ import annotations

from collections.abc import Mapping

from pflalign.round.feature import TrainingRound
from pflalign.wire.messages import Exchange
from pflalign.wire.protocol import TRAIN
from pflalign.wire.state import State


class Scheduler:
    """How a round loop's training rounds run (see the module docstring)."""

    def __init__(self, loop):
        self.loop = loop

    def describe(self) -> str | None:
        """A line for the run's log (None: nothing to say)."""
        return None

    def round(self, server_round: int) -> tuple[dict, int, int]:
        """One training round: its row entries, and the bytes sent down and up in it."""
        raise NotImplementedError

    def before_evaluation(self) -> None:
        """Bring every client up to date before an evaluation or a checkpoint."""

    def busy(self) -> set[int]:
        """Clients an evaluation leaves out (training in flight)."""
        return set()

    def checkpoint_refusal(self, server_round: int) -> str | None:
        """Why no checkpoint may be written now (None: it may)."""
        return None

    def state_dict(self) -> tuple[dict, State]:
        """What a checkpoint keeps: JSON metadata and arrays."""
        return {}, {}

    def load_state_dict(self, meta: Mapping, arrays: Mapping) -> None:
        """Continue from :meth:`state_dict`'s."""


class SynchronousRounds(Scheduler):
    """Synchronous rounds: every sampled client trains from the same model, and the round
    aggregates the replies that pass, in client-id order."""

    def round(self, server_round: int) -> tuple[dict, int, int]:
        training = self.configure(server_round)
        if not training.messages:  # sampling = poisson drew no client
            return self.empty(training), 0, 0
        return self.finish(training, self.loop.messaging.exchange(TRAIN, training.messages))

    def configure(self, server_round: int) -> TrainingRound:
        """The round's first half: its clients (a feature may choose them) and their training
        messages, counted as dispatched; none when the draw is empty."""
        loop = self.loop
        server, method = loop.server, loop.method
        wanted = len(server.sample(server_round))
        selection = next((chosen for f in loop.features
                          if (chosen := f.select(loop, server_round, wanted)) is not None), None)
        if selection is None:
            training = TrainingRound(server_round, [], wanted)
            sampled = server.sample(server_round)
        else:
            training = TrainingRound(server_round, [], selection.wanted,
                                     row=dict(selection.entries))
            sampled = selection.clients
        if not sampled:
            return training
        training.messages = [
            loop.messaging.message(cid, method.train_payload(server, loop.state, cid, server_round),
                         server_round) for cid in server.largest_first(sampled)]
        loop.dispatched(m.client for m in training.messages)
        for feature in loop.features:
            feature.sending(loop, training)
        return training

    def finish(self, training: TrainingRound, exchange: Exchange) -> tuple[dict, int, int]:
        """The round's second half, from the replies to its messages: the features' view of
        them, validation, bounds, rollback or aggregation. Returns the row's entries and the
        bytes sent down and up."""
        loop = self.loop
        features, server_round = loop.features, training.number
        training.exchange = exchange
        for feature in features:
            feature.received(loop, training)
        exchange = training.exchange
        collected = loop.messaging.collect_training(exchange.replies)
        checked = collected
        for feature in features:
            checked = feature.checked(loop, training, checked)
        updates = [loop.messaging.update_of(m, arrays) for m, arrays in checked.good]
        row: dict = {"clients-trained": 0, "failures": collected.failed,
                     "timeouts": collected.timed_out, "rejected": checked.rejected,
                     **training.row}
        updates = loop.bound(server_round, updates, row)
        row["clients-trained"] = len(updates)
        loop.accepted(u.metrics for u in updates)
        loop.messaging.check_kept_state(updates)
        traffic = (exchange.bytes_down + training.bytes_down,
                   exchange.bytes_up + training.bytes_up)
        answered = len(exchange.replies) - collected.failed
        if loop.rollback_due(collected.nonfinite_loss, answered):
            loop.warn(f"round {server_round}: {collected.nonfinite_loss} of {answered} clients "
                      "report a non-finite loss when training from the global model; the last "
                      "aggregation is rolled back and this round's updates are not used.")
            loop.roll_back()
            row.update({"clients-trained": 0, "rolled-back": 1})
            return row, *traffic
        return loop.aggregate(server_round, updates, row), *traffic

    def empty(self, training: TrainingRound) -> dict:
        """A round that drew no client (``sampling = poisson``): nothing is trained or sent;
        under central DP the noise alone is released, as in any round."""
        loop = self.loop
        loop.warn(f"round {training.number}: sampling = poisson drew none of the "
                  f"{len(loop.server.training_clients())} training clients; nothing is "
                  "trained.")
        training.exchange = Exchange([], 0, 0)
        for feature in loop.features:
            feature.received(loop, training)
        row = {"clients-trained": 0, **training.row}
        if any(f.releases_without_updates for f in loop.features):
            return loop.aggregate(training.number, [], row)
        return row
