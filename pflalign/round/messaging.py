"""The round loop's side of the wire: the messages it sends and what it makes of the replies.

:class:`Messaging` belongs to one :class:`~pflalign.round.loop.RoundLoop` (``loop.messaging``).
It addresses each message to a client (the method, the run's label and the round go in its config),
gives each the limits its reply must keep to, attaches the state a resumed run restores to a
client to that client's next train or evaluate message, hands them to the engine, checks the
training replies against the arrays and metrics the method expects, and turns each one that
passes into the :class:`~pflalign.wire.messages.Update` the method aggregates. It also remembers
which clients said they keep method state, so that one that comes back without it is warned
about.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import replace

from pflalign.engines.base import Engine
from pflalign.methods.base import Method
from pflalign.server.runtime import ServerRuntime
from pflalign.server.validation import Collected, ReplyValidator, state_limit
from pflalign.wire.messages import Exchange, Outgoing, Payload, Reply, Update
from pflalign.wire.protocol import (
    ARRAY_HEADER,
    CLIENT_STATE,
    EVALUATE,
    HAD_STATE,
    KEPT_STATE,
    LABEL,
    METHOD,
    MODEL,
    NUM_EXAMPLES,
    PARTITION_ID,
    RESTORE,
    ROUND,
    STATE,
    TRAIN,
)
from pflalign.wire.state import State


class Messaging:
    """A round loop's messages and replies; see the module docstring. ``warn`` reports a line
    (the loop's, which names the run)."""

    def __init__(self, server: ServerRuntime, method: Method, engine: Engine,
                 validator: ReplyValidator, warn: Callable[[str], None]):
        self.server, self.method, self.engine = server, method, engine
        #: the checks every reply meets
        self.validator = validator
        self.warn = warn
        #: clients that reported saving method state (a later reply without it is warned about)
        self.saved_state: set[int] = set()
        #: after a resume, the checkpointed state of each client not heard from since: it goes
        #: with the next train or evaluate message to that client
        self.pending_restore: MutableMapping[int, State] = {}

    def message(self, client: int, payload: Payload, server_round: int) -> Outgoing:
        """``payload`` addressed to ``client`` in round ``server_round``."""
        return Outgoing(client, payload, {METHOD: self.method.name, LABEL: self.server.label,
                                          ROUND: server_round, **payload.config})

    # --- exchanges -----------------------------------------------------------------------------
    def reply_limits(self, action: str) -> dict[str, int] | None:
        """The array records a reply to ``action`` may carry, with the most bytes each may hold:
        a training reply's, their specs' bytes; an evaluation reply, none; a state query's, the
        bound on a saved state. None for other actions."""
        if action == TRAIN:
            return {name: spec.nbytes + ARRAY_HEADER * len(spec.keys)
                    for name, spec in self.reply_specs().items()}
        if action == EVALUATE:
            return {}
        if action == STATE:
            return {CLIENT_STATE: state_limit(self.server.initial)}
        return None

    def exchange(self, action: str, messages: Sequence[Outgoing]) -> Exchange:
        """The engine's exchange of the :meth:`prepared` messages; each client that replies (even
        with a reply that is then rejected) has its pending restored state, which is not sent
        again. A client that failed or timed out gets it again with its next message."""
        exchange = self.engine.exchange(action, self.prepared(action, messages))
        self.delivered(exchange.replies)
        return exchange

    def prepared(self, action: str, messages: Sequence[Outgoing]) -> list[Outgoing]:
        """``messages``, each carrying the :meth:`reply_limits` of its action, and each pending
        restored state attached to its client's train or evaluate message (as the record
        :data:`~pflalign.wire.protocol.RESTORE`)."""
        limits = self.reply_limits(action)
        if limits is not None:  # with the records a feature allowed a message (save-models)
            messages = [replace(m, limits={**limits, **(m.limits or {})}) for m in messages]
        if not self.pending_restore or action not in (TRAIN, EVALUATE):
            return list(messages)
        return [Outgoing(m.client, Payload({**m.payload.arrays,
                                            RESTORE: self.pending_restore[m.client]},
                                           m.payload.config), m.config, m.limits)
                if m.client in self.pending_restore else m for m in messages]

    def delivered(self, replies: Iterable[Reply]) -> None:
        """Forget the pending restored state of each client that replied."""
        if self.pending_restore:
            for reply in replies:
                if reply.error is None and reply.sender is not None:
                    self.pending_restore.pop(reply.sender, None)

    # --- training replies ----------------------------------------------------------------------
    def reply_specs(self) -> dict:
        """The array records a training reply carries (the model, and the method's own) and
        each one's spec; none when the method uploads no model."""
        if not self.method.uploads_model:
            return {}
        return {MODEL: self.server.flat, **self.method.reply_arrays(self.server)}

    def collect_training(self, replies: Sequence[Reply]) -> Collected:
        """Training replies validated against :meth:`reply_specs` and the method's metrics."""
        return self.validator.collect(replies, self.reply_specs(), self.method.reply_metrics(TRAIN))

    @staticmethod
    def update_of(metrics: Mapping, arrays: Mapping[str, State]) -> Update:
        """A validated training reply as the :class:`~pflalign.wire.messages.Update` the method
        aggregates."""
        return Update(client=int(metrics[PARTITION_ID]), num_examples=metrics[NUM_EXAMPLES],
                      metrics=metrics, model=arrays.get(MODEL),
                      arrays={k: v for k, v in arrays.items() if k != MODEL})

    def check_kept_state(self, updates: Sequence[Update]) -> None:
        """Warn when a client that saved method state in an earlier round comes back without it
        (a restarted node without a ``state-dir``): its personalization starts over."""
        for update in updates:
            if update.client in self.saved_state and not update.metrics.get(HAD_STATE, 1):
                self.warn(f"client {update.client} saved its {self.method.name} state in an "
                          "earlier round but came back without it (a restarted node without a "
                          "state-dir?); it continues from an empty state.")
            if update.metrics.get(KEPT_STATE):
                self.saved_state.add(update.client)
