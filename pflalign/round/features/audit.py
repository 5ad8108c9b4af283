"""Verifiable evaluation and training: the server recomputes a seeded sample of clients' replies.

A client's evaluation reply is a claim (its correct counts and losses on its test split). Every
evaluation round, :class:`EvaluationAudit` draws ``eval-audit-fraction`` of the clients that
replied (at least one; drawn by (round, a secret key the server holds), so that no client can
predict it; the key is in the results, which repeat it exactly), and every
client in the last round, whose scores are the run's final metrics. For each, it asks the client
for the method state it holds (a :data:`~pflalign.wire.protocol.STATE` exchange, as checkpoints do),
checks that state as a checkpoint would, and runs the method's own evaluation rule here
(:func:`pflalign.engines.host.handle`, which injects no fault) on what the client was sent, that
state, and the client's test split from the server's copy of the partition. The rule is seeded by
(seed, round, client), so an honest reply is reproduced exactly: counts must be equal and losses
equal to ``LOSS_TOLERANCE`` (relative; the last bits of a GPU's kernels may differ). A reply that
disagrees, or a client that cannot give its state, is rejected and named, and the round's row
counts it (``eval-audited``, ``eval-audit-rejected``).

Training replies can be audited the same way (``train-audit-fraction``, default 0: it repeats
the sampled clients' local training on the server): the sampled clients' states are asked for
before the round's training messages go out, and each sampled reply's metrics and arrays must
equal the server's recomputation (arrays to ``ARRAY_TOLERANCE`` of their norm; its
``client-seconds`` aside). It catches what no bound can, such as an update reversed within the
norm bound.

The recomputation runs in the server's process with the server's data: in simulation, and in a
deployment whose ServerApp reads the same partition as its nodes (the nodes' partition files are
exported from it, :mod:`pflalign.run.export_partitions`). So a reply's process metrics
(:data:`~pflalign.wire.protocol.PROCESS_METRICS`: which process computed it, and that process's
peak memory) are never compared. With ``eval-audit-fraction = 0`` nothing is recomputed and the
report says the accuracies are self-reported.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pflalign.engines.host import handle_aside, to_torch
from pflalign.methods.base import Method
from pflalign.round.feature import RoundFeature, TrainingRound, register
from pflalign.server.runtime import ServerRuntime
from pflalign.server.validation import ClientFailure, Collected, ReplyValidator, state_problem
from pflalign.settings.schema import Settings
from pflalign.wire.messages import Exchange, Outgoing, Payload
from pflalign.wire.protocol import (
    CLIENT_SECONDS,
    CLIENT_STATE,
    EVALUATE,
    ID,
    PARTITION_ID,
    PROCESS_METRICS,
    SAVED_ON_NODE,
    STATE,
    STATE_CHUNK,
    TRAIN,
)
from pflalign.wire.state import State

#: the seed stream of the audit's draw (apart from sampling's and the clients')
AUDIT_STREAM = 9101
#: ... and that of the training audit's
TRAIN_AUDIT_STREAM = 9102
#: how far a recomputed mean loss may lie from the claimed one, relative to it
LOSS_TOLERANCE = 1e-5
#: how far an uploaded array record may lie from the recomputed one (the norm of the
#: difference, relative to the recomputed record's norm): float32 rounding carried through a
#: client's steps, where its kernels differ from the server's (the vmap backend's, on an AVX2
#: CPU, put Per-FedAvg's scored model 1.09e-5 from the recomputation); a tampered record (a
#: reversed or replaced update) lies at the order of 1
ARRAY_TOLERANCE = 1e-4


@dataclass
class AuditOutcome:
    """What one evaluation round's audit found: the replies that stand, how many were
    recomputed, how many disagreed (or could not be checked), and the bytes of the state
    exchange."""

    good: list[tuple[dict[str, float], dict[str, State]]]
    audited: int = 0
    rejected: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    _index: tuple[list, dict[int, list[int]]] | None = field(default=None, repr=False,
                                                              compare=False)

    def positions(self) -> dict[int, list[int]]:
        """Where each client's replies are in :attr:`good` (rebuilt when ``good`` is replaced;
        an audit in chunks looks its clients up here instead of scanning every reply)."""
        if self._index is None or self._index[0] is not self.good:
            index: dict[int, list[int]] = {}
            for i, (metrics, _) in enumerate(self.good):
                index.setdefault(int(metrics[PARTITION_ID]), []).append(i)
            self._index = (self.good, index)
        return self._index[1]


def audit_sample(clients: Sequence[int], fraction: float, secret: int, server_round: int,
                 everyone: bool = False, stream: int = AUDIT_STREAM) -> list[int]:
    """The clients audited among ``clients``: ``ceil(fraction * n)`` of them (at least one when
    ``fraction > 0``), drawn by (secret, round, stream): the server's secret key, which no
    client knows; all of them with ``everyone``; none at 0."""
    ordered = sorted(clients)
    if fraction <= 0 or not ordered:
        return []
    if everyone:
        return ordered
    k = min(len(ordered), max(1, math.ceil(fraction * len(ordered))))
    rng = np.random.default_rng([secret, server_round, stream])
    return sorted(int(c) for c in rng.choice(ordered, size=k, replace=False))


def disagreement(claimed: Mapping[str, float], recomputed: Mapping[str, float],
                 integer: Callable[[str], bool], skip: Sequence[str] = ()) -> str | None:
    """Where claimed metrics differ from the recomputed ones (None when they do not):
    ``integer(key)`` says which metrics are counts, compared exactly; ``skip``: keys not
    compared (wall-clock seconds, process metrics)."""
    for key in sorted((set(claimed) | set(recomputed)) - set(skip)):
        if key not in claimed or key not in recomputed:
            return f"{key} is {'missing from' if key not in claimed else 'extra in'} the reply"
        mine, theirs = float(recomputed[key]), float(claimed[key])
        same = mine == theirs if integer(key) else math.isclose(
            mine, theirs, rel_tol=LOSS_TOLERANCE, abs_tol=1e-12)
        if not same:
            return f"{key} = {theirs:.6g} claimed, {mine:.6g} recomputed"
    return None


def array_disagreement(claimed: Mapping[str, State], recomputed: Mapping[str, object],
                       ) -> str | None:
    """Where uploaded array records differ from the recomputed ones (None when they do not):
    the same records and keys, integer arrays equal, floating-point ones to
    :data:`ARRAY_TOLERANCE` of their norm."""
    if sorted(claimed) != sorted(recomputed):
        return f"it uploaded the records {sorted(claimed)}, the recomputation {sorted(recomputed)}"
    for name in sorted(recomputed):
        theirs = claimed[name]
        mine = {k: np.asarray(v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v)
                for k, v in dict(recomputed[name]).items()}  # type: ignore[call-overload]
        if sorted(theirs) != sorted(mine):
            return f"its '{name}' record has other entries than the recomputation's"
        floats = [k for k in mine if mine[k].dtype.kind == "f"]
        for key in mine:
            if key not in floats and not np.array_equal(np.asarray(theirs[key]), mine[key]):
                return f"'{name}' entry {key!r} differs from the recomputation"
        if floats:
            a = np.concatenate([np.asarray(theirs[k], np.float64).ravel() for k in floats])
            b = np.concatenate([mine[k].astype(np.float64).ravel() for k in floats])
            gap, size = float(np.linalg.norm(a - b)), float(np.linalg.norm(b))
            if not gap <= ARRAY_TOLERANCE * size + 1e-12:
                return (f"its '{name}' record lies {gap:.4g} from the recomputation's (norm "
                        f"{size:.4g})")
    return None


class Audit:
    """The evaluation and training audits of one method entry's run; see the module
    docstring. ``validator`` checks the state replies, and ``warn`` names each rejected client.

    Each round the round loop hands in its own ``exchange`` (which reaches the clients) and
    ``message(client)`` (an empty message to one, in this round); the audit keeps neither."""

    def __init__(self, server: ServerRuntime, method: Method, validator: ReplyValidator,
                 warn: Callable[[str], None]):
        self.server = server
        self.method = method
        self.validator = validator
        self.warn = warn
        #: the key of the draws: the config's audit-secret, or one from the operating system
        #: (a resumed run takes its checkpoint's)
        self.secret = server.settings.run.audit_secret or secrets.randbits(62) + 1
        self.eval_fraction = server.settings.run.eval_audit_fraction
        self.train_fraction = server.settings.run.train_audit_fraction
        evaluation, training = method.reply_metrics(EVALUATE), method.reply_metrics(TRAIN)
        self.eval_integer = lambda key: key in evaluation and evaluation[key].integer
        self.train_integer = lambda key: key in training and training[key].integer

    # --- evaluation ----------------------------------------------------------------------------
    def check_evaluation(self, server_round: int, messages: Sequence[Outgoing],
                         collected: Collected,
                         exchange: Callable[[str, Sequence[Outgoing]], Exchange],
                         message: Callable[[int], Outgoing]) -> AuditOutcome:
        """Recompute the sampled evaluation replies of ``collected`` (answers to
        ``messages``)."""
        replied = [int(m[PARTITION_ID]) for m, _ in collected.good]
        chosen = audit_sample(replied, self.eval_fraction, self.secret, server_round,
                              everyone=server_round == self.server.rounds)
        outcome = AuditOutcome(good=list(collected.good))
        if not chosen:
            return outcome
        # a chunk of clients at a time: their states asked for, their replies recomputed, the
        # states dropped (at 10,000 clients all of them at once would be gigabytes); the
        # messages indexed once, not per chunk (which grew with the square of the clients)
        sent = {m.client: m for m in messages}
        for start in range(0, len(chosen), STATE_CHUNK):
            part = chosen[start:start + STATE_CHUNK]
            states = self.states(exchange(STATE, [message(cid) for cid in part]), part, outcome)
            outcome = self._compare(server_round, EVALUATE, sent, states, outcome)
        return outcome

    # --- training ------------------------------------------------------------------------------
    def training_states(self, server_round: int, clients: Sequence[int],
                        pending: Mapping[int, State],
                        exchange: Callable[[str, Sequence[Outgoing]], Exchange],
                        message: Callable[[int], Outgoing]) -> tuple[dict, AuditOutcome]:
        """Before a round's training: the sampled clients' states (``pending``: those a resume
        is about to restore, which the clients do not hold yet)."""
        chosen = audit_sample(clients, self.train_fraction, self.secret, server_round,
                              stream=TRAIN_AUDIT_STREAM)
        outcome = AuditOutcome(good=[])
        ask = [cid for cid in chosen if cid not in pending]
        states: dict[int, State | None | str] = {cid: dict(pending[cid]) or None
                                                 for cid in chosen if cid in pending}
        if ask:
            states.update(self.states(exchange(STATE, [message(cid) for cid in ask]), ask,
                                      outcome))
        return states, outcome

    def check_training(self, server_round: int, messages: Sequence[Outgoing],
                       collected: Collected, states: Mapping[int, State | None | str],
                       outcome: AuditOutcome) -> AuditOutcome:
        """Recompute the sampled training replies of ``collected`` from ``states``
        (:meth:`training_states`)."""
        outcome.good = list(collected.good)
        if not states:
            return outcome
        return self._compare(server_round, TRAIN, {m.client: m for m in messages}, states,
                             outcome)

    # --- both ----------------------------------------------------------------------------------
    def _compare(self, server_round: int, action: str, sent: Mapping[int, Outgoing],
                 states: Mapping[int, State | None | str], outcome: AuditOutcome,
                 ) -> AuditOutcome:
        """Recompute the replies of the clients in ``states`` to their messages (``sent``, by
        client) and reject those that disagree."""
        bad: dict[int, str] = {}
        # the replies of the clients in ``states``, in the order they came (found through an
        # index of the replies kept for the round: a chunk's look-up does not scan them all)
        positions = outcome.positions()
        at = sorted(i for cid in states for i in positions.get(cid, ()))
        for metrics, arrays in (outcome.good[i] for i in at):
            cid = int(metrics[PARTITION_ID])
            outcome.audited += 1
            state = states[cid]
            if isinstance(state, str):
                bad[cid] = state
                continue
            recomputed, reply = self.recompute(action, sent[cid], state)
            # the process metrics name the process that computed a reply, and this one is
            # the server's: never compared (nor the wall-clock seconds of a training reply)
            if action == EVALUATE:
                # a saved model is compared where the client sent one (a SuperNode keeps its
                # own: saved-on-node), which then must be the model that scored it
                problem = disagreement(metrics, recomputed, self.eval_integer,
                                       skip=(SAVED_ON_NODE, *PROCESS_METRICS)
                                       ) or array_disagreement(
                    arrays, {k: v for k, v in reply.items() if k in arrays})
            else:
                problem = disagreement(metrics, recomputed, self.train_integer,
                                       skip=(CLIENT_SECONDS, *PROCESS_METRICS)
                                       ) or array_disagreement(arrays, reply)
            if problem:
                bad[cid] = f"it does not match the server's recomputation ({problem})"
        what = "evaluation" if action == EVALUATE else "training"
        for cid, why in sorted(bad.items()):
            self.warn(f"round {server_round}: client {cid}'s {what} reply is rejected by the "
                      f"audit: {why}.")
        if bad:
            outcome.good = [(m, a) for m, a in outcome.good if int(m[PARTITION_ID]) not in bad]
        outcome.rejected += len(bad)
        return outcome

    def states(self, exchange: Exchange, clients: Sequence[int],
               outcome: AuditOutcome) -> dict[int, State | None | str]:
        """The saved state of each of ``clients`` from their replies in ``exchange`` (None: it
        holds none), or why it cannot be had."""
        outcome.bytes_down += exchange.bytes_down
        outcome.bytes_up += exchange.bytes_up
        states: dict[int, State | None | str] = {
            cid: "it did not give the state it holds" for cid in clients}
        for reply in exchange.replies:
            if reply.sender not in states:
                continue
            try:
                self.validator.validate(reply, {}, {PARTITION_ID: ID}, (CLIENT_STATE,))
            except ClientFailure as failure:
                states[reply.sender] = f"its state could not be had ({failure})"
                continue
            state = dict(reply.arrays.get(CLIENT_STATE, {}))
            problem = state_problem(self.method.ClientState, state, self.server.initial)
            states[reply.sender] = (f"the state it gave was rejected ({problem})" if problem
                                    else state or None)
        return states

    def recompute(self, action: str, message: Outgoing, state: State | None,
                  ) -> tuple[dict[str, float], dict]:
        """The metrics and array records an honest client replies to ``message`` holding
        ``state``, computed here on the server's copy of its data; the process's torch threads
        and random state are left as they were."""
        arrays = to_torch({name: {k: np.ascontiguousarray(v) for k, v in record.items()}
                           for name, record in message.payload.arrays.items()})
        metrics, reply, _ = handle_aside(action, self.server.settings, message.client,
                                         message.config, arrays, state)
        return metrics, reply


@register
class Audits(RoundFeature):
    """The evaluation and training audits as a round feature. Every run has it: its rows count
    what was audited (zero at fraction 0), and its result names the key of the draws."""

    name = "audit"

    @classmethod
    def wanted(cls, settings: Settings, method: Method) -> bool:
        return True

    def __init__(self, loop):
        self.audit = Audit(loop.server, loop.method, loop.messaging.validator, loop.warn)
        #: the sampled clients' states asked for before this round's training was sent
        self.pending: tuple[dict, AuditOutcome] = ({}, AuditOutcome(good=[]))

    def sending(self, loop, training: TrainingRound) -> None:
        messaging = loop.messaging
        self.pending = self.audit.training_states(
            training.number, [m.client for m in training.messages], messaging.pending_restore,
            messaging.exchange, lambda cid: messaging.message(cid, Payload(), training.number))

    def checked(self, loop, training: TrainingRound, collected: Collected) -> Collected:
        states, outcome = self.pending
        self.pending = ({}, AuditOutcome(good=[]))
        outcome = self.audit.check_training(training.number, training.messages, collected,
                                            states, outcome)
        training.row.update({"train-audited": outcome.audited,
                             "train-audit-rejected": outcome.rejected})
        return replace(collected, good=outcome.good, rejected=collected.rejected
                       + outcome.rejected)

    def evaluated(self, loop, server_round: int, messages: Sequence[Outgoing],
                  collected: Collected, metrics: dict) -> Collected:
        outcome = self.audit.check_evaluation(
            server_round, messages, collected, loop.messaging.exchange,
            lambda cid: loop.messaging.message(cid, Payload(), server_round))
        metrics.update({"eval-audited": outcome.audited, "eval-audit-rejected": outcome.rejected})
        return replace(collected, good=outcome.good, rejected=collected.rejected
                       + outcome.rejected)

    def result(self, loop) -> dict:
        return {"audit-secret": self.audit.secret}

    def state_dict(self) -> dict:
        return {"secret": self.audit.secret}

    def load_state_dict(self, state: Mapping) -> None:
        if state.get("secret"):
            self.audit.secret = int(state["secret"])
