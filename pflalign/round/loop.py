"""The federated round loop over any method and any engine.

:class:`RoundLoop` runs one method entry for a run's rounds. Its scheduler runs each training
round (:class:`~pflalign.round.synchronous.SynchronousRounds`, or FedBuff's
:class:`~pflalign.round.fedbuff.BufferedRounds` under ``mode = async``): the method's server rule
says what each client receives, the engine (an :class:`~pflalign.engines.base.Engine`: Flower
messages, or a plain in-process loop) delivers it, the replies are validated
(:class:`~pflalign.server.validation.ReplyValidator`) and the method's rule aggregates them.
Evaluation rounds do the same with the evaluation rule. Everything else a run adds to its rounds
is a round feature (:mod:`pflalign.round.feature`) that the config turns on: DP, the update
bounds, the audits, the simulated clock, upload recording, telemetry, GGA. The messages and the
replies are the loop's :class:`~pflalign.round.messaging.Messaging` (``loop.messaging``), and an
evaluation round is :mod:`pflalign.round.evaluation`'s. Nothing here knows how a client is
reached, and nothing here learns.

Clients are identified by the stable ``partition-id`` they report (never an engine's node ids).
Replies are processed in client-id order, so aggregation is deterministic whatever order an engine
returns them in. A reply that cannot be used is skipped with one warning naming the client. When
most clients report a non-finite loss right after an aggregation, it is rolled back.

Given a :class:`~pflalign.round.checkpoint.Checkpoint`, the loop writes one every
``checkpoint-every`` rounds (asking the clients that keep state for it) and, when one exists at
the start, continues after its round: the server state, rows, features and scheduler come from
the file, and each client's state is sent back to it with the next message it gets (a
``restore-state`` record).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

import pflalign.round.features  # noqa: F401  (registers the features)
from pflalign.engines.base import Engine
from pflalign.engines.collusion import CHANNEL, CHANNEL_ATTACKS, run_key
from pflalign.methods.base import Method
from pflalign.outputs.results import Reporter
from pflalign.process.interrupt import check_stop
from pflalign.round.checkpoint import Checkpoint, restore, write_checkpoint
from pflalign.round.evaluation import evaluate_at_start, evaluate_round
from pflalign.round.feature import RoundFeature, compose
from pflalign.round.features.clock import SimulatedClock
from pflalign.round.fedbuff import BufferedRounds, RealTimeRounds
from pflalign.round.messaging import Messaging
from pflalign.round.synchronous import Scheduler, SynchronousRounds
from pflalign.server.aggregation import mean_cosine
from pflalign.server.buffered import server_step
from pflalign.server.runtime import ServerRuntime
from pflalign.server.validation import ReplyValidator, non_finite
from pflalign.wire.messages import Update
from pflalign.wire.protocol import CLIENT_SECONDS, TRAIN_LOSS
from pflalign.wire.state import ServerState, State


@dataclass
class Round:
    """A round in progress: its number, its row so far, when it began, its bytes so far."""

    number: int
    row: dict
    started: float
    down: int = 0
    up: int = 0
    #: when its evaluation began (its training ended)
    evaluated_from: float = 0.0


class RoundLoop:
    """Runs one method for the run's rounds over an engine; see the module docstring.
    ``features``: round features beyond those the config turns on, run after them."""

    def __init__(self, server: ServerRuntime, method: Method, engine: Engine,
                 reporter: Reporter | None = None, features: Sequence[RoundFeature] = ()):
        self.server, self.method, self.engine = server, method, engine
        server.keep_personal(method.personal_keys(server))
        self.reporter = reporter or Reporter()
        self.state: ServerState | None = None
        self.rounds: list[dict] = []
        self.client_results: list[dict] = []
        #: the server state before the latest aggregation (for a rollback), None after one
        self.before_aggregation: ServerState | None = None
        #: per training client: how many trainings it was sent, and how many of its updates were
        #: aggregated (the result's ``usage``: who a deadline or staleness leaves out)
        self.usage: dict[int, list[int]] = {}
        #: the messages and the replies, with the checks every reply meets (their warnings go to
        #: the reporter, not through this loop, which would make a reference cycle that keeps the
        #: engine and its files alive)
        label, reporter = server.label, self.reporter
        warn = lambda text: reporter.warn(f"[{label}] {text}")  # noqa: E731
        self.messaging = Messaging(server, method, engine, ReplyValidator(server, warn), warn)
        self.features: list[RoundFeature] = [*compose(self), *features]
        #: synchronous rounds; ``mode = async``'s FedBuff once the clients are known (run())
        self.scheduler: Scheduler = SynchronousRounds(self)

    @property
    def label(self) -> str:
        return self.server.label

    def warn(self, text: str) -> None:
        self.reporter.warn(f"[{self.label}] {text}")

    # --- the run -------------------------------------------------------------------------------
    def run(self, initial_model: State, checkpoint: Checkpoint | None = None) -> dict:
        """Run all rounds; return ``{"rounds": [...], "final": {...}, "clients": [...],
        "usage": [...]}`` and the features' entries (``processes``, ``audit-secret``).

        With ``checkpoint``, write it after every round it is due, and when its file exists at
        the start (a run killed after that round), continue from the round after it."""
        server, run = self.server, self.server.settings.run
        self.open(initial_model)
        last_eval: dict[str, float] = {}
        first = 1
        snapshot = checkpoint.read() if checkpoint is not None else None
        if snapshot is not None:
            last_eval = restore(self, snapshot)
            first = snapshot.round + 1
            self.reporter.info(f"[{self.label}] resumed from round {snapshot.round} (checkpoint "
                               f"{checkpoint.path})")
        if first == 1 and run.attack in CHANNEL_ATTACKS:  # the attackers' records start afresh
            CHANNEL.clear(run_key(server.settings, self.label))
        if first == 1 and run.eval_at_start:  # the initial model, before any training
            last_eval = evaluate_at_start(self)
        for server_round in range(first, server.rounds + 1):
            check_stop()
            current = self.begin_round(server_round)
            self.trained(current, *self.train_round(server_round))
            if server.is_eval_round(server_round):
                self.scheduler.before_evaluation()  # each client after its latest dispatch
                last_eval = self.evaluated(current, *evaluate_round(self, server_round))
            self.end_round(current)
            if checkpoint is not None and checkpoint.due(server_round):
                write_checkpoint(self, checkpoint, server_round, last_eval)
        return self.result(last_eval)

    def open(self, initial_model: State) -> None:
        """Before round 1: discover the clients, the method's initial server state from
        ``initial_model``, the scheduler, and the features' start."""
        server, run = self.server, self.server.settings.run
        self.reporter.info(
            f"[{self.label}] {run.rounds} rounds, {run.num_clients} clients "
            f"(+{run.num_unseen_clients} unseen), fraction-train {run.fraction_train}, "
            f"model {run.model} ({server.flat.size:,} values)")
        server.clients = self.engine.discover()
        self.state = self.method.init_server(server, initial_model)
        if run.mode == "async":  # on the simulated clock, or in real time without profiles
            clock = next((f for f in self.features if isinstance(f, SimulatedClock)), None)
            self.scheduler = (BufferedRounds(self, clock) if clock is not None
                              else RealTimeRounds(self))
        if self.scheduler.describe():
            self.reporter.info(f"[{self.label}] {self.scheduler.describe()}")
        for feature in self.features:
            feature.start(self)

    def result(self, last_eval: Mapping[str, float]) -> dict:
        """The run's result after its last round (``last_eval``: its latest evaluation)."""
        server = self.server
        result = {"rounds": self.rounds, "final": self.final_metrics(last_eval),
                  "clients": self.client_results,
                  "usage": [{"id": cid, "dispatched": sent, "used": used}
                            for cid, (sent, used) in sorted(self.usage.items())],
                  "model": {"name": server.settings.run.model,
                            "parameters": server.trainable_spec.size},
                  "hyperparameters": self.method.hyperparameters(server.settings)}
        for feature in self.features:
            result.update(feature.result(self))
        return result

    # --- a round's phases (the Flower strategies call them between their exchanges) -----------
    def begin_round(self, server_round: int) -> Round:
        """A round begins: the features' steps before training (GGA's warm start)."""
        current = Round(server_round, {"round": server_round}, time.perf_counter())
        for feature in self.features:
            entries, down, up = feature.before_training(self, server_round)
            current.row.update(entries)
            current.down, current.up = current.down + down, current.up + up
        return current

    def trained(self, current: Round, entries: dict, down: int, up: int) -> None:
        """The round's training is done (its row ``entries`` and bytes): the features' entries
        (epsilon), its seconds and the method's diagnostics."""
        current.row.update(entries)
        for feature in self.features:
            feature.trained(self, current.number, current.row)
        current.down, current.up = current.down + down, current.up + up
        current.row["train-seconds"] = time.perf_counter() - current.started
        current.row.update(self.method.round_diagnostics(self.server, self.state))
        current.evaluated_from = time.perf_counter()

    def evaluated(self, current: Round, metrics: dict, down: int, up: int) -> dict:
        """The round's evaluation is done; returns its metrics."""
        current.row.update(metrics)
        current.down, current.up = current.down + down, current.up + up
        current.row["eval-seconds"] = time.perf_counter() - current.evaluated_from
        return metrics

    def end_round(self, current: Round) -> dict:
        """The round's row is complete: recorded and reported."""
        current.row.update({"round-seconds": time.perf_counter() - current.started,
                            "bytes-up": current.up, "bytes-down": current.down})
        self.rounds.append(current.row)
        self.reporter.round(self.label, current.row, self.server.rounds)
        return current.row

    def train_round(self, server_round: int) -> tuple[dict, int, int]:
        """One training round of the scheduler: its row entries, bytes down and bytes up."""
        return self.scheduler.round(server_round)

    # --- what schedulers and features call -----------------------------------------------------
    def dispatched(self, clients: Iterable[int]) -> None:
        """Count a training sent to each of ``clients`` (:attr:`usage`)."""
        for cid in clients:
            self.usage.setdefault(cid, [0, 0])[0] += 1

    def accepted(self, metrics: Iterable[Mapping[str, float]]) -> None:
        """The metrics of replies a round used, for the features that keep them."""
        metrics = list(metrics)
        for feature in self.features:
            feature.accepted(self, metrics)

    def bound(self, server_round: int, updates: list[Update], row: dict) -> list[Update]:
        """A round's updates after the features' bounds (dropped or scaled)."""
        for feature in self.features:
            updates = feature.bound(self, server_round, updates, row)
        return updates

    def rollback_due(self, nonfinite: int, answered: int) -> bool:
        """Whether the latest aggregation is rolled back: most of the ``answered`` clients report
        a non-finite loss from it (never under a feature that forbids it, central DP)."""
        return (self.before_aggregation is not None and 2 * nonfinite > answered > 0
                and not any(f.forbids_rollback for f in self.features))

    def roll_back(self) -> None:
        self.state, self.before_aggregation = self.before_aggregation, None

    def aggregate(self, server_round: int, updates: Sequence[Update], row: dict,
                  lr: float = 1.0) -> dict:
        """Aggregate a round's validated, bounded ``updates`` into the server state with the
        method's rule, on what the features release of them (``lr`` != 1: the model then moves
        that factor of the way, ``async-lr``), keeping the previous state when none is usable or
        the aggregate is not finite; returns ``row`` with the aggregation's diagnostics."""
        server, method = self.server, self.method
        released: Sequence[Update] = updates
        if method.uploads_model:
            for feature in self.features:
                released = feature.release(self, server_round, released, row)
        if not released:
            self.warn(f"round {server_round}: no usable training reply; the global model is kept "
                      "unchanged.")
            return row
        previous = self.state
        self.state, diagnostics = method.aggregate(server, self.state, server_round, released)
        if lr != 1.0 and method.uploads_model:
            self.state = server.with_model(self.state, server_step(
                server.shared_model(previous), server.shared_model(self.state), lr))
        for text in server.take_notices():
            self.warn(f"round {server_round}: {text}")
        problem = non_finite(self.state)
        if problem:
            self.warn(f"round {server_round}: the aggregate is not finite ({problem}); the server "
                      "state of the previous round is kept.")
            self.state = previous
            row.update({"clients-trained": 0, "rolled-back": 1})
            return row
        self.before_aggregation = previous
        for update in updates:
            self.usage.setdefault(update.client, [0, 0])[1] += 1
        if method.uploads_model and updates:
            spec = server.trainable_shared  # how far aggregation agrees with the clients
            base = spec.flatten(previous.model, np.float64)
            row["update-cosine"] = mean_cosine(
                [spec.flatten(u.model, np.float64) - base for u in updates if u.model is not None],
                spec.flatten(self.state.model, np.float64) - base)
        for key in method.client_diagnostics:
            values = [u.metrics[key] for u in updates if key in u.metrics]
            if values:
                row[key] = float(np.mean(values))
                row[f"{key}-median"] = float(np.median(values))  # one client cannot drag it
        row.update(diagnostics)
        row[CLIENT_SECONDS] = float(sum(u.metrics.get(CLIENT_SECONDS, 0.0) for u in updates))
        if updates and all(TRAIN_LOSS in u.metrics for u in updates):
            losses = [u.metrics[TRAIN_LOSS] for u in updates]
            row[TRAIN_LOSS] = float(np.average(losses, weights=[u.num_examples for u in updates]))
            row[f"{TRAIN_LOSS}-median"] = float(np.median(losses))
        return row

    def final_metrics(self, last_eval: Mapping[str, float]) -> dict:
        seconds = [r["round-seconds"] for r in self.rounds]
        final = dict(last_eval)
        for key in (TRAIN_LOSS, "dp-epsilon", "dp-epsilon-server"):
            if self.rounds and key in self.rounds[-1]:
                final[key] = self.rounds[-1][key]
        final.update({
            "rounds": len(self.rounds),
            "seconds-per-round": float(np.mean(seconds)) if seconds else 0.0,
            "total-seconds": float(np.sum(seconds)),
            "bytes-up": int(sum(r["bytes-up"] for r in self.rounds)),
            "bytes-down": int(sum(r["bytes-down"] for r in self.rounds)),
        })
        for feature in self.features:
            feature.final(self, final)
        return final
