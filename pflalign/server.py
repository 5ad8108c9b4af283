"""The federated round loop over any method and any engine: sampling, validation, metrics.

:class:`Federation` runs one method for a run's rounds. Each round it asks the method's server rule
what every sampled client receives, hands those payloads to the engine (an :class:`Engine`:
Flower messages, or a plain in-process loop), validates the replies, lets the server rule
aggregate them, and records the round's metrics. Evaluation rounds do the same with the
evaluation rule. Nothing here knows how a client is reached, and nothing here learns: the
method's rules do that.

Clients are identified by the stable ``partition-id`` they report (never an engine's node ids).
Replies are processed in client-id order, so aggregation is deterministic whatever order an engine
returns them in. A reply that cannot be used is skipped with one warning naming the client.

Given a :class:`~pflalign.checkpoint.Checkpoint`, the federation writes one every
``checkpoint-every`` rounds (asking the clients that keep state for it) and, when one exists at
the start, continues after its round: the server state and rows come from the file, and each
client's state is sent back to it with the next message it gets (a ``restore-state`` record).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from pflalign.aggregation import FlatSpec, State, combine, fedavg, mean_cosine, update_norms
from pflalign.checkpoint import Checkpoint, Snapshot, capture_rng, restore_rng
from pflalign.interrupt import check_stop
from pflalign.method import Method, Payload, Update
from pflalign.metrics import accuracy_summary
from pflalign.options import ConfigError, Value
from pflalign.protocol import (
    CLIENT_SECONDS,
    CLIENT_STATE,
    CORRECT_COUNTS,
    EVAL_REQUIRED,
    EVALUATE,
    GLOBAL_CORRECT,
    HAD_STATE,
    KEPT_STATE,
    LABEL,
    LOSSES,
    METHOD,
    MODEL,
    NEXT_CORRECT,
    NUM_EXAMPLES,
    NUM_TEST,
    PARTITION_ID,
    PERSONAL_CORRECT,
    PERSONAL_LOSS,
    RESTORE,
    ROUND,
    STATE,
    TRAIN,
    TRAIN_LOSS,
)
from pflalign.results import Reporter
from pflalign.sampling import sample_clients
from pflalign.state import Arrays, ServerState

if TYPE_CHECKING:  # the parser imports the method registry, which imports this module
    from pflalign.config import Settings


@dataclass(frozen=True)
class ClientInfo:
    """A client as discovered at start: its stable id, its split sizes, whether it is unseen."""

    id: int
    num_train: int
    num_test: int
    unseen: bool


@dataclass
class Outgoing:
    """One message to one client: its payload and the message config (method, label, round and
    the rule's own entries)."""

    client: int
    payload: Payload
    config: dict[str, Value]


@dataclass
class Reply:
    """One client's answer as an engine delivers it: metrics and array records, or an error.

    ``sender`` is the client the engine knows sent it (None when it cannot tell), ``who`` names
    it in messages, and ``error`` completes the sentence "<who> ..." when the reply is unusable."""

    sender: int | None
    who: str
    metrics: dict[str, object] = field(default_factory=dict)
    arrays: dict[str, State] = field(default_factory=dict)
    error: str | None = None
    #: no reply came before ``round-timeout`` (``error`` says so)
    timed_out: bool = False


@dataclass
class Exchange:
    """The replies to one round of messages, and the array bytes that went each way."""

    replies: list[Reply]
    bytes_down: int
    bytes_up: int


class Engine(Protocol):
    """How a :class:`Federation` reaches its clients."""

    def discover(self) -> dict[int, ClientInfo]:
        """The run's clients by id."""

    def exchange(self, action: str, messages: Sequence[Outgoing]) -> Exchange:
        """Deliver ``messages`` (``action`` is train, evaluate, query or state) and collect
        replies. A :data:`~pflalign.protocol.RESTORE` record is delivered with every shape as it
        is and not counted in the bytes."""


class ClientFailure(Exception):
    """A reply that cannot be used; the message says which client and why. ``nonfinite_loss``:
    it was refused because a loss it reported is NaN or infinite."""

    def __init__(self, text: str, nonfinite_loss: bool = False):
        super().__init__(text)
        self.nonfinite_loss = nonfinite_loss


@dataclass
class Collected:
    """The usable replies of one exchange, sorted by client id, and how many were not usable:
    ``failed`` (the client raised or did not reply in time; ``timed_out`` of them the latter)
    and ``rejected`` (the reply failed validation)."""

    good: list[tuple[dict[str, float], dict[str, State]]]
    failed: int = 0
    timed_out: int = 0
    rejected: int = 0
    nonfinite_loss: int = 0


class ServerRuntime:
    """The server's view of a run for one method: its settings, clients and model layout."""

    def __init__(self, settings: Settings, method: Method, label: str,
                 initial_model: State, trainable: tuple[str, ...],
                 template: Callable[[], object]):
        self.settings = settings
        self.method = method
        self.label = label
        self.seed = settings.run.seed
        self.rounds = settings.run.rounds
        self.eval_every = settings.run.eval_every
        self.fraction_train = settings.run.fraction_train
        self.trainable = trainable
        self._build_template = template
        self._template: object | None = None
        self.clients: dict[int, ClientInfo] = {}
        personal = set(method.personal_keys(self))
        self.shared = tuple(k for k in initial_model if k not in personal)
        #: the exchanged part of the model: what is sent, uploaded, validated and averaged
        self.flat = FlatSpec.of({k: initial_model[k] for k in self.shared})
        #: the trainable entries (control variates, mixing)
        self.trainable_spec = FlatSpec.of({k: initial_model[k] for k in trainable})
        self._samples: dict[int, list[int]] = {}

    def template_model(self) -> object:
        """A model of the run, built once, for looking up its layers (read-only; its weights
        are not the run's)."""
        if self._template is None:
            self._template = self._build_template()
        return self._template

    def shared_model(self, state: ServerState) -> State:
        """The exchanged entries of the global model."""
        return {k: state.model[k] for k in self.shared}

    @staticmethod
    def with_model(state: ServerState, new: State) -> ServerState:
        """``state`` with some model entries replaced."""
        return dataclasses.replace(state, model={**state.model, **new})

    def combine(self, vectors: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
        """Client vectors combined by the run's ``aggregation`` rule (``mean``: weighted by
        ``weights``; ``trimmed-mean`` and ``median``: per coordinate, unweighted)."""
        run = self.settings.run
        return combine(vectors, weights, run.aggregation, run.trim_fraction)

    def average(self, states: Sequence[State], weights: Sequence[float],
                spec: FlatSpec | None = None) -> State:
        """Client states (by default the exchanged model entries) combined by the run's
        ``aggregation`` rule; ``mean`` is FedAvg's sample-weighted average (ALGORITHMS.md 1.6)."""
        spec = spec or self.flat
        if self.settings.run.aggregation == "mean":
            return fedavg(states, weights, spec)
        return spec.unflatten(self.combine([spec.flatten(s, np.float64) for s in states],
                                           weights))

    def training_clients(self) -> list[int]:
        return [cid for cid, info in self.clients.items() if not info.unseen]

    def sample(self, server_round: int) -> list[int]:
        """This round's training clients: reproducible from (seed, round), the same for every
        method."""
        if server_round not in self._samples:
            self._samples[server_round] = sample_clients(
                self.training_clients(), self.fraction_train, self.seed, server_round)
        return self._samples[server_round]

    def largest_first(self, clients: Iterable[int]) -> list[int]:
        """Clients in decreasing order of data size: engines hand messages to free workers in
        order, so the longest jobs go first and workers stay evenly busy (LPT scheduling)."""
        return sorted(clients, key=lambda c: (-self.clients[c].num_train - self.clients[c].num_test,
                                              c))

    def is_eval_round(self, server_round: int) -> bool:
        return server_round % self.eval_every == 0 or server_round == self.rounds


class RoundHook(Protocol):
    """A cross-cutting step before a round's training (GGA's warm start): it may replace the
    server state; its row entries and bytes are recorded in the round's row.

    A hook that keeps state between rounds gives it to checkpoints through ``state_dict()`` (a
    JSON-able dict) and ``load_state_dict(state)``; a federation with a hook without them writes
    no checkpoint."""

    def before_training(self, federation: Federation, server_round: int,
                        ) -> tuple[dict[str, float], int, int]:
        """The row entries, bytes down and bytes up."""


class Federation:
    """Runs one method for the run's rounds over an engine; see the module docstring."""

    def __init__(self, server: ServerRuntime, engine: Engine, reporter: Reporter | None = None,
                 hooks: Sequence[RoundHook] = ()):
        self.server = server
        self.method = server.method
        self.engine = engine
        self.reporter = reporter or Reporter()
        self.hooks = list(hooks)
        self.state: ServerState | None = None
        self.rounds: list[dict] = []
        self.client_results: list[dict] = []
        #: the server state before the latest aggregation (for a rollback), None after one
        self.before_aggregation: ServerState | None = None
        #: clients that reported saving method state (a later reply without it is warned about)
        self.saved_state: set[int] = set()
        #: after a resume, the checkpointed state of each client not heard from since: it goes
        #: with the next train or evaluate message to that client
        self.pending_restore: dict[int, Arrays] = {}
        self._trainable_shared: FlatSpec | None = None
        self._buffers: FlatSpec | None = None

    @property
    def label(self) -> str:
        return self.server.label

    def message(self, client: int, payload: Payload, server_round: int) -> Outgoing:
        return Outgoing(client, payload, {METHOD: self.method.name, LABEL: self.label,
                                          ROUND: server_round, **payload.config})

    def warn(self, text: str) -> None:
        self.reporter.warn(f"[{self.label}] {text}")

    # --- the run -------------------------------------------------------------------------------
    def run(self, initial_model: State, checkpoint: Checkpoint | None = None) -> dict:
        """Run all rounds; return ``{"rounds": [...], "final": {...}, "clients": [...]}``.

        With ``checkpoint``, write it after every round it is due, and when its file exists at
        the start (a run killed after that round), continue from the round after it."""
        server, run = self.server, self.server.settings.run
        self.reporter.info(
            f"[{self.label}] {run.rounds} rounds, {run.num_clients} clients "
            f"(+{run.num_unseen_clients} unseen), fraction-train {run.fraction_train}, "
            f"model {run.model} ({server.flat.size:,} values)")
        server.clients = self.engine.discover()
        self.state = self.method.init_server(server, initial_model)
        last_eval: dict[str, float] = {}
        first = 1
        snapshot = checkpoint.read() if checkpoint is not None else None
        if snapshot is not None:
            last_eval = self.restore(snapshot)
            first = snapshot.round + 1
            self.reporter.info(f"[{self.label}] resumed from round {snapshot.round} (checkpoint "
                               f"{checkpoint.path})")
        for server_round in range(first, server.rounds + 1):
            check_stop()
            started = time.perf_counter()
            row: dict = {"round": server_round}
            down = up = 0
            for hook in self.hooks:
                entries, hook_down, hook_up = hook.before_training(self, server_round)
                row.update(entries)
                down, up = down + hook_down, up + hook_up
            entries, train_down, train_up = self.train_round(server_round)
            row.update(entries)
            down, up = down + train_down, up + train_up
            row["train-seconds"] = time.perf_counter() - started
            row.update(self.method.round_diagnostics(server, self.state))
            if server.is_eval_round(server_round):
                eval_started = time.perf_counter()
                last_eval, eval_down, eval_up = self.evaluate_round(server_round)
                down, up = down + eval_down, up + eval_up
                row.update(last_eval)
                row["eval-seconds"] = time.perf_counter() - eval_started
            row.update({"round-seconds": time.perf_counter() - started,
                        "bytes-up": up, "bytes-down": down})
            self.rounds.append(row)
            self.reporter.round(self.label, row, server.rounds)
            if checkpoint is not None and checkpoint.due(server_round):
                self.write_checkpoint(checkpoint, server_round, last_eval)
        return {"rounds": self.rounds, "final": self.final_metrics(last_eval),
                "clients": self.client_results}

    # --- checkpoints ---------------------------------------------------------------------------
    def write_checkpoint(self, checkpoint: Checkpoint, server_round: int,
                         last_eval: Mapping[str, float]) -> None:
        """Write the run's state after ``server_round`` to ``checkpoint``; when a client's state
        cannot be had (or a round hook keeps state it cannot give), warn and keep the previous
        checkpoint, which is still a consistent earlier point of the run."""
        hooks = []
        for hook in self.hooks:
            if not hasattr(hook, "state_dict"):
                self.warn(f"no checkpoint after round {server_round}: the round hook "
                          f"{type(hook).__name__} cannot save its state.")
                return
            hooks.append(hook.state_dict())
        clients = self.client_states(server_round)
        if clients is None:
            return
        rng_arrays, rng_meta = capture_rng()
        checkpoint.write(Snapshot(
            round=server_round, server=self.state.to_arrays(),
            before_aggregation=(None if self.before_aggregation is None
                                else self.before_aggregation.to_arrays()),
            clients=clients, rounds=self.rounds, client_results=self.client_results,
            saved_state=sorted(self.saved_state), last_eval=dict(last_eval), hooks=hooks,
            rng_arrays=rng_arrays, rng_meta=rng_meta))

    def client_states(self, server_round: int) -> dict[int, Arrays] | None:
        """The method state of every client that keeps one (:attr:`saved_state`): a state still
        to be restored as it is, the others asked of the clients (a
        :data:`~pflalign.protocol.STATE` exchange, which no round's bytes count). None, with a
        warning, when a client does not give it."""
        states = {cid: self.pending_restore[cid] for cid in sorted(self.saved_state)
                  if cid in self.pending_restore}
        ask = [cid for cid in sorted(self.saved_state) if cid not in states]
        if not ask:
            return states
        exchange = self.engine.exchange(STATE, [self.message(cid, Payload(), server_round)
                                                for cid in ask])
        for reply in exchange.replies:
            try:
                self.validate(reply, {}, ())
            except ClientFailure as failure:
                self.warn(f"no checkpoint after round {server_round}: {failure}.")
                return None
            states[reply.sender] = dict(reply.arrays.get(CLIENT_STATE, {}))
        missing = sorted(set(ask) - set(states))
        if missing:
            self.warn(f"no checkpoint after round {server_round}: clients {missing} did not give "
                      "their state.")
            return None
        return {cid: states[cid] for cid in sorted(states)}

    def restore(self, snapshot: Snapshot) -> dict[str, float]:
        """Continue from ``snapshot``: the server state, rows, client results and hooks as they
        were after its round, each client's state pending until that client's next message.
        Returns the latest evaluation's metrics."""
        if len(snapshot.hooks) != len(self.hooks):
            raise ConfigError(f"The checkpoint of '{self.label}' holds the state of "
                              f"{len(snapshot.hooks)} round hooks, this run has "
                              f"{len(self.hooks)}; remove it to run '{self.label}' from round 1.")
        for hook, state in zip(self.hooks, snapshot.hooks, strict=True):
            hook.load_state_dict(state)
        self.state = self.method.ServerState.from_arrays(snapshot.server)
        self.before_aggregation = (None if snapshot.before_aggregation is None else
                                   self.method.ServerState.from_arrays(
                                       snapshot.before_aggregation))
        self.rounds = list(snapshot.rounds)
        self.client_results = list(snapshot.client_results)
        self.saved_state = set(snapshot.saved_state)
        self.pending_restore = {cid: state for cid, state in snapshot.clients.items() if state}
        restore_rng(snapshot.rng_arrays, snapshot.rng_meta)
        return dict(snapshot.last_eval)

    def exchange(self, action: str, messages: Sequence[Outgoing]) -> Exchange:
        """The engine's exchange, with each pending restored state attached to its client's
        train or evaluate message (as the record :data:`~pflalign.protocol.RESTORE`); a client
        that replies (even with a reply that is then rejected) has it, and it is not sent again.
        A client that failed or timed out gets it again with its next message."""
        if not self.pending_restore or action not in (TRAIN, EVALUATE):
            return self.engine.exchange(action, messages)
        messages = [Outgoing(m.client, Payload({**m.payload.arrays,
                                                RESTORE: self.pending_restore[m.client]},
                                               m.payload.config), m.config)
                    if m.client in self.pending_restore else m for m in messages]
        exchange = self.engine.exchange(action, messages)
        for reply in exchange.replies:
            if reply.error is None and reply.sender is not None:
                self.pending_restore.pop(reply.sender, None)
        return exchange

    def train_round(self, server_round: int) -> tuple[dict, int, int]:
        """One training round: the round's metrics, and the bytes sent down and up."""
        server, method = self.server, self.method
        messages = [self.message(cid, method.train_payload(server, self.state, cid, server_round),
                                 server_round)
                    for cid in server.largest_first(server.sample(server_round))]
        exchange = self.exchange(TRAIN, messages)
        reply_arrays = {MODEL: server.flat, **method.reply_arrays(server)} \
            if method.uploads_model else {}
        collected = self.collect(exchange.replies, reply_arrays, (NUM_EXAMPLES,))
        updates = [Update(client=int(m[PARTITION_ID]), num_examples=m[NUM_EXAMPLES], metrics=m,
                          model=arrays.get(MODEL),
                          arrays={k: v for k, v in arrays.items() if k != MODEL})
                   for m, arrays in collected.good]
        updates, too_large = self.bound_updates(updates)
        self.check_kept_state(updates)
        row: dict = {"clients-trained": len(updates), "failures": collected.failed,
                     "timeouts": collected.timed_out,
                     "rejected": collected.rejected + too_large}
        traffic = exchange.bytes_down, exchange.bytes_up
        answered = len(exchange.replies) - collected.failed
        if self.before_aggregation is not None and 2 * collected.nonfinite_loss > answered > 0:
            self.warn(f"round {server_round}: {collected.nonfinite_loss} of {answered} clients "
                      "report a non-finite loss when training from the global model; the last "
                      "aggregation is rolled back and this round's updates are not used.")
            self.state, self.before_aggregation = self.before_aggregation, None
            row.update({"clients-trained": 0, "rolled-back": 1})
            return row, *traffic
        if not updates:
            self.warn(f"round {server_round}: no usable training reply; the global model is kept "
                      "unchanged.")
            return row, *traffic
        previous = self.state
        self.state, diagnostics = method.aggregate(server, self.state, server_round, updates)
        problem = non_finite(self.state)
        if problem:
            self.warn(f"round {server_round}: the aggregate is not finite ({problem}); the server "
                      "state of the previous round is kept.")
            self.state = previous
            row.update({"clients-trained": 0, "rolled-back": 1})
            return row, *traffic
        self.before_aggregation = previous
        if method.uploads_model:
            row["update-cosine"] = self.update_cosine(previous.model, self.state.model, updates)
        for key in method.client_diagnostics:
            values = [u.metrics[key] for u in updates if key in u.metrics]
            if values:
                row[key] = float(np.mean(values))
        row.update(diagnostics)
        row[CLIENT_SECONDS] = float(sum(u.metrics.get(CLIENT_SECONDS, 0.0) for u in updates))
        if all(TRAIN_LOSS in u.metrics for u in updates):
            row[TRAIN_LOSS] = float(np.average([u.metrics[TRAIN_LOSS] for u in updates],
                                               weights=[u.num_examples for u in updates]))
        return row, *traffic

    def bound_updates(self, updates: list[Update]) -> tuple[list[Update], int]:
        """The updates whose every part is at most ``update-norm-bound`` times the round's
        median; the others are warned about by client id and dropped. The parts: the update of
        the trainable exchanged entries (uploaded minus global), that of the other floating-point
        entries (batch-norm statistics), and the norm of every further record (SCAFFOLD's
        control-variate change, FedCP's policy network). Returns the kept updates and how many
        were not."""
        bound = self.server.settings.run.update_norm_bound
        if bound <= 0 or len(updates) < 3:  # a median of fewer than three says nothing
            return updates, 0
        parts: dict[str, list[float]] = {}
        if all(u.model is not None for u in updates):
            global_model = self.state.model
            for part, spec in (("update", self.trainable_spec()), ("buffer update",
                                                                   self.buffer_spec())):
                if spec.size:
                    parts[part] = list(update_norms([u.model for u in updates], global_model,
                                                    spec))
        for name in sorted(set.intersection(*(set(u.arrays) for u in updates))):
            spec = float_spec(updates[0].arrays[name])
            if spec.size:
                parts[f"'{name}' record"] = [float(np.linalg.norm(spec.flatten(
                    u.arrays[name], np.float64))) for u in updates]
        refused: dict[int, str] = {}
        for part, norms in parts.items():
            median = float(np.median(norms))
            if median <= 0:  # most clients left this part unchanged: nothing to compare with
                continue
            for update, norm in zip(updates, norms, strict=True):
                if update.client not in refused and norm > bound * median:
                    refused[update.client] = (
                        f"client {update.client}'s {part} norm {norm:.4g} is "
                        f"{norm / median:.3g}x the round's median {median:.4g} "
                        f"(update-norm-bound = {bound:g}); the reply is skipped.")
        for text in refused.values():
            self.warn(text)
        return [u for u in updates if u.client not in refused], len(refused)

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

    def evaluate_round(self, server_round: int) -> tuple[dict, int, int]:
        """One evaluation round: its metrics, and the bytes sent down and up. When most clients
        report a non-finite loss right after an aggregation, that aggregation is rolled back
        and the round evaluated again."""
        metrics, down, up, collected = self._evaluate(server_round)
        answered = metrics["eval-clients"] - collected.failed
        if self.before_aggregation is not None and 2 * collected.nonfinite_loss > answered > 0:
            self.warn(f"round {server_round}: {collected.nonfinite_loss} of {answered} clients "
                      "report a non-finite loss for the new model; the round's aggregation is "
                      "rolled back and the previous model evaluated.")
            self.state, self.before_aggregation = self.before_aggregation, None
            metrics, again_down, again_up, _ = self._evaluate(server_round)
            metrics["rolled-back"] = 1
            down, up = down + again_down, up + again_up
        return metrics, down, up

    def _evaluate(self, server_round: int) -> tuple[dict, int, int, Collected]:
        server, method = self.server, self.method
        messages = [self.message(cid, method.eval_payload(server, self.state, cid, server_round),
                                 server_round)
                    for cid in server.largest_first(method.eval_clients(server))]
        exchange = self.exchange(EVALUATE, messages)
        collected = self.collect(exchange.replies, {}, EVAL_REQUIRED)
        rows = [m for m, _ in collected.good]
        metrics: dict = {"eval-failures": collected.failed + collected.rejected,
                         "eval-rejected": collected.rejected, "evaluated": len(rows),
                         "eval-clients": len(messages)}
        info = {int(m[PARTITION_ID]): server.clients[int(m[PARTITION_ID])] for m in rows}
        seen = [m for m in rows if not info[int(m[PARTITION_ID])].unseen]
        unseen = [m for m in rows if info[int(m[PARTITION_ID])].unseen]
        if seen:
            metrics.update(accuracy_summary([m[PERSONAL_CORRECT] for m in seen],
                                            [m[NUM_TEST] for m in seen]))
            metrics[PERSONAL_LOSS] = float(np.average(
                [m[PERSONAL_LOSS] for m in seen], weights=[m[NUM_TEST] for m in seen]))
            tested = sum(m[NUM_TEST] for m in seen)
            if method.has_global_model and all(GLOBAL_CORRECT in m for m in seen):
                metrics["global-acc"] = sum(m[GLOBAL_CORRECT] for m in seen) / tested
            if all(NEXT_CORRECT in m for m in seen):
                metrics["personal-acc-next"] = sum(m[NEXT_CORRECT] for m in seen) / tested
        if unseen:
            metrics["unseen-acc"] = (sum(m[PERSONAL_CORRECT] for m in unseen)
                                     / sum(m[NUM_TEST] for m in unseen))
        self.client_results = [
            {"id": cid, "unseen": info[cid].unseen, "num-train": info[cid].num_train,
             "num-test": int(m[NUM_TEST]), "personal-acc": m[PERSONAL_CORRECT] / m[NUM_TEST]}
            for m in rows for cid in [int(m[PARTITION_ID])]]
        return metrics, exchange.bytes_down, exchange.bytes_up, collected

    def buffer_spec(self) -> FlatSpec:
        """The exchanged floating-point entries that are not trained (batch-norm statistics)."""
        if self._buffers is None:
            model, trainable = self.state.model, set(self.server.trainable)
            self._buffers = FlatSpec.of({k: model[k] for k in self.server.shared
                                         if k not in trainable
                                         and np.asarray(model[k]).dtype.kind == "f"})
        return self._buffers

    def trainable_spec(self) -> FlatSpec:
        """The trainable exchanged entries: what an update's norm and cosine are taken over."""
        if self._trainable_shared is None:
            model = self.state.model
            self._trainable_shared = FlatSpec.of({k: model[k] for k in self.server.trainable
                                                  if k in self.server.shared})
        return self._trainable_shared

    def update_cosine(self, previous: State, new: State, updates: Sequence[Update]) -> float:
        """Mean cosine between each client's update and the aggregated update (trainable shared
        entries): how much aggregation agrees with the clients' directions."""
        spec = self.trainable_spec()
        base = spec.flatten(previous, np.float64)
        return mean_cosine([spec.flatten(u.model, np.float64) - base for u in updates
                            if u.model is not None], spec.flatten(new, np.float64) - base)

    def final_metrics(self, last_eval: Mapping[str, float]) -> dict[str, float]:
        seconds = [r["round-seconds"] for r in self.rounds]
        final = dict(last_eval)
        if self.rounds and TRAIN_LOSS in self.rounds[-1]:
            final[TRAIN_LOSS] = self.rounds[-1][TRAIN_LOSS]
        final.update({
            "rounds": len(self.rounds),
            "seconds-per-round": float(np.mean(seconds)) if seconds else 0.0,
            "total-seconds": float(np.sum(seconds)),
            "bytes-up": int(sum(r["bytes-up"] for r in self.rounds)),
            "bytes-down": int(sum(r["bytes-down"] for r in self.rounds)),
        })
        return final

    # --- validation ----------------------------------------------------------------------------
    def validate(self, reply: Reply, arrays: Mapping[str, FlatSpec], required: tuple[str, ...],
                 ) -> tuple[dict[str, float], dict[str, State]]:
        """The reply's metrics and array records, checked against what the client declared at
        discovery; :class:`ClientFailure` otherwise."""
        who = reply.who
        if reply.error is not None:
            raise ClientFailure(f"{who} {reply.error}")
        metrics = reply.metrics
        for key in (PARTITION_ID, *required):
            if key not in metrics:
                raise ClientFailure(f"{who} replied without the metric '{key}'")
        for key, value in metrics.items():
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise ClientFailure(f"{who} reported a non-finite or non-scalar '{key}': {value!r}",
                                    nonfinite_loss=key in LOSSES)
        if reply.sender != int(metrics[PARTITION_ID]):
            raise ClientFailure(f"{who} reported partition-id {metrics[PARTITION_ID]}, which "
                                "is not the id it was discovered with")
        info = self.server.clients.get(reply.sender)
        declared = {NUM_EXAMPLES: info.num_train, NUM_TEST: info.num_test} if info else {}
        for key, value in declared.items():
            if key in metrics and metrics[key] != value:
                raise ClientFailure(f"{who} reported {key} = {metrics[key]:g}, but declared "
                                    f"{value} at discovery")
        for key in required:
            if key.startswith("num-") and metrics[key] <= 0:
                raise ClientFailure(f"{who} reported {key} = {metrics[key]}, expected > 0")
        for key in LOSSES:
            if key in metrics and metrics[key] < 0:
                raise ClientFailure(f"{who} reported {key} = {metrics[key]}, expected >= 0")
        for key in CORRECT_COUNTS:
            if key in metrics and not 0 <= metrics[key] <= metrics.get(NUM_TEST, 0):
                raise ClientFailure(f"{who} reported {key} = {metrics[key]} for "
                                    f"{metrics.get(NUM_TEST)} test samples")
        checked: dict[str, State] = {}
        for name, spec in arrays.items():
            if name not in reply.arrays:
                what = "its model arrays" if name == MODEL else f"the array record '{name}'"
                raise ClientFailure(f"{who} replied without {what}")
            problem = spec.problem_with(reply.arrays[name])
            if problem:
                what = "update" if name == MODEL else f"'{name}' record"
                raise ClientFailure(f"{who}'s {what} was rejected: {problem}")
            checked[name] = reply.arrays[name]
        return metrics, checked  # type: ignore[return-value]

    def collect(self, replies: Iterable[Reply], arrays: Mapping[str, FlatSpec],
                required: tuple[str, ...]) -> Collected:
        """The validated (metrics, array records) pairs sorted by client id, and the counts of
        failed and rejected replies; each unusable reply is warned about by client id."""
        collected = Collected(good=[])
        for reply in replies:
            try:
                collected.good.append(self.validate(reply, arrays, required))
            except ClientFailure as failure:
                self.warn(f"{failure}; the reply is skipped.")
                if reply.error is not None:
                    collected.failed += 1
                    collected.timed_out += reply.timed_out
                else:
                    collected.rejected += 1
                    collected.nonfinite_loss += failure.nonfinite_loss
        collected.good.sort(key=lambda pair: int(pair[0][PARTITION_ID]))
        return collected


def float_spec(state: Mapping[str, np.ndarray]) -> FlatSpec:
    """The floating-point entries of ``state``."""
    return FlatSpec.of({k: v for k, v in state.items() if np.asarray(v).dtype.kind == "f"})


def non_finite(state: ServerState) -> str | None:
    """Where ``state`` holds a NaN or infinite value (None when it holds none)."""
    for key, value in state.to_arrays().items():
        value = np.asarray(value)
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            return f"'{key}' holds NaN or infinite values"
    return None
