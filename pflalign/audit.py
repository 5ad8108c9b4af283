"""Verifiable evaluation: the server recomputes a seeded sample of clients' evaluation replies.

A client's evaluation reply is a claim (its correct counts and losses on its test split). Every
evaluation round, :class:`EvaluationAudit` draws ``eval-audit-fraction`` of the clients that
replied (at least one; a draw seeded by (seed, round), the same for every method), and every
client in the last round, whose scores are the run's final metrics. For each, it asks the client
for the method state it holds (a :data:`~pflalign.protocol.STATE` exchange, as checkpoints do),
checks that state as a checkpoint would, and runs the method's own evaluation rule here
(:func:`pflalign.engines.host.handle` without fault injection) on what the client was sent, that
state, and the client's test split from the server's copy of the partition. The rule is seeded by
(seed, round, client), so an honest reply is reproduced exactly: counts must be equal and losses
equal to ``LOSS_TOLERANCE`` (relative; the last bits of a GPU's kernels may differ). A reply that
disagrees, or a client that cannot give its state, is rejected and named, and the round's row
counts it (``eval-audited``, ``eval-audit-rejected``).

The recomputation runs in the server's process with the server's data: in simulation, and in a
deployment whose ServerApp reads the same partition as its nodes (the nodes' partition files are
exported from it, :mod:`pflalign.export_partitions`). With ``eval-audit-fraction = 0`` nothing is
recomputed and the report says the accuracies are self-reported.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pflalign.messages import Exchange, Outgoing
from pflalign.method import Method
from pflalign.protocol import CLIENT_STATE, EVALUATE, ID, PARTITION_ID, STATE
from pflalign.server import ServerRuntime
from pflalign.state import State
from pflalign.validation import ClientFailure, Collected, ReplyValidator, state_problem

#: the seed stream of the audit's draw (apart from sampling's and the clients')
AUDIT_STREAM = 9101
#: how far a recomputed mean loss may lie from the claimed one, relative to it
LOSS_TOLERANCE = 1e-5


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
    caught: list[int] = field(default_factory=list)


def audit_sample(clients: Sequence[int], fraction: float, seed: int, server_round: int,
                 everyone: bool = False) -> list[int]:
    """The clients audited among ``clients``: ``ceil(fraction * n)`` of them (at least one when
    ``fraction > 0``), drawn by (seed, round); all of them with ``everyone``; none at 0."""
    ordered = sorted(clients)
    if fraction <= 0 or not ordered:
        return []
    if everyone:
        return ordered
    k = min(len(ordered), max(1, math.ceil(fraction * len(ordered))))
    rng = np.random.default_rng([seed, server_round, AUDIT_STREAM])
    return sorted(int(c) for c in rng.choice(ordered, size=k, replace=False))


def disagreement(claimed: Mapping[str, float], recomputed: Mapping[str, float],
                 integer: Callable[[str], bool]) -> str | None:
    """Where a claimed evaluation differs from the recomputed one (None when it does not):
    ``integer(key)`` says which metrics are counts, compared exactly."""
    for key in sorted(set(claimed) | set(recomputed)):
        if key not in claimed or key not in recomputed:
            return f"{key} is {'missing from' if key not in claimed else 'extra in'} the reply"
        mine, theirs = float(recomputed[key]), float(claimed[key])
        same = mine == theirs if integer(key) else math.isclose(
            mine, theirs, rel_tol=LOSS_TOLERANCE, abs_tol=1e-12)
        if not same:
            return f"{key} = {theirs:.6g} claimed, {mine:.6g} recomputed"
    return None


class EvaluationAudit:
    """The evaluation audit of one method entry's run; see the module docstring.
    ``validator`` checks the state replies, and ``warn`` names each rejected client."""

    def __init__(self, server: ServerRuntime, method: Method, validator: ReplyValidator,
                 warn: Callable[[str], None]):
        self.server = server
        self.method = method
        self.validator = validator
        self.warn = warn
        self.fraction = server.settings.run.eval_audit_fraction
        schema = method.reply_metrics(EVALUATE)
        self.integer = lambda key: key in schema and schema[key].integer

    def check(self, server_round: int, messages: Sequence[Outgoing], collected: Collected,
              exchange: Callable[[str, Sequence[Outgoing]], Exchange],
              message: Callable[[int], Outgoing]) -> AuditOutcome:
        """Recompute the sampled replies of ``collected`` (answers to ``messages``);
        ``exchange`` reaches the clients (the round loop's) and ``message(client)`` is an empty
        message to one in this round."""
        good = list(collected.good)
        replied = [int(m[PARTITION_ID]) for m, _ in good]
        chosen = audit_sample(replied, self.fraction, self.server.seed, server_round,
                              everyone=server_round == self.server.rounds)
        outcome = AuditOutcome(good=good)
        if not chosen:
            return outcome
        states = self.states(exchange(STATE, [message(cid) for cid in chosen]), chosen, outcome)
        sent = {m.client: m for m in messages}
        bad: dict[int, str] = {}
        for metrics, _ in good:
            cid = int(metrics[PARTITION_ID])
            if cid not in chosen:
                continue
            outcome.audited += 1
            if isinstance(states.get(cid), str):
                bad[cid] = str(states[cid])
                continue
            recomputed = self.recompute(sent[cid], states.get(cid))
            problem = disagreement(metrics, recomputed, self.integer)
            if problem:
                bad[cid] = f"its evaluation does not match the server's recomputation ({problem})"
        for cid, why in sorted(bad.items()):
            self.warn(f"round {server_round}: client {cid}'s evaluation reply is rejected by the "
                      f"audit: {why}.")
        outcome.good = [(m, a) for m, a in good if int(m[PARTITION_ID]) not in bad]
        outcome.rejected, outcome.caught = len(bad), sorted(bad)
        return outcome

    def states(self, exchange: Exchange, clients: Sequence[int],
               outcome: AuditOutcome) -> dict[int, State | None | str]:
        """The saved state of each of ``clients`` from their replies in ``exchange`` (None: it
        holds none), or why it cannot be had."""
        outcome.bytes_down += exchange.bytes_down
        outcome.bytes_up += exchange.bytes_up
        states: dict[int, State | None | str] = {
            cid: "it did not give the state it evaluated with" for cid in clients}
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

    def recompute(self, message: Outgoing, state: State | None) -> dict[str, float]:
        """The evaluation metrics an honest client replies to ``message`` holding ``state``,
        computed here on the server's copy of its data; the process's torch threads and random
        state are left as they were."""
        from pflalign.engines.host import handle, to_torch  # the engines import this module

        arrays = to_torch({name: {k: np.ascontiguousarray(v) for k, v in record.items()}
                           for name, record in message.payload.arrays.items()})
        threads = torch.get_num_threads()
        try:
            with torch.random.fork_rng(devices=[]):
                metrics, _, _ = handle(EVALUATE, self.server.settings, message.client,
                                       message.config, arrays, state, inject=False)
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        return metrics
