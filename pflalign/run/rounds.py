"""The federated round loop over any method and any engine: sampling, validation, metrics.

:class:`RoundLoop` runs one method for a run's rounds. Each round it asks the method's server
rule what every sampled client receives, hands those payloads to the engine (an :class:`Engine`:
Flower messages, or a plain in-process loop), validates the replies (a
:class:`~pflalign.server.validation.ReplyValidator`), lets the server rule aggregate them, and
records the round's metrics. Evaluation rounds do the same with the evaluation rule. Nothing
here knows how a client is reached, and nothing here learns: the method's rules do that.

Clients are identified by the stable ``partition-id`` they report (never an engine's node ids).
Replies are processed in client-id order, so aggregation is deterministic whatever order an engine
returns them in. A reply that cannot be used is skipped with one warning naming the client.

Given a :class:`~pflalign.run.checkpoint.Checkpoint`, the loop writes one every
``checkpoint-every`` rounds (asking the clients that keep state for it) and, when one exists at
the start, continues after its round: the server state and rows come from the file, and each
client's state is sent back to it with the next message it gets (a ``restore-state`` record).

The run's result also lists its processes (``processes``): this one (the server's), and each
client process that sent an accepted training or evaluation reply, by the process metrics it
reported (:data:`~pflalign.wire.protocol.PROCESS_METRICS`), with its largest reported peak
memory. A diagnostic only: no row or metric uses it. A resumed run lists the processes of its
own rounds (the checkpoint does not keep them).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import numpy as np

from pflalign.engines.base import Engine
from pflalign.engines.sequential import records_bytes, sent_bytes
from pflalign.methods.base import Method
from pflalign.models.language import is_language_model
from pflalign.outputs.results import Reporter, slug
from pflalign.process.interrupt import check_stop
from pflalign.process.memory import host_id, peak_rss_mb
from pflalign.run.asynchronous import BufferedRounds, RealTimeRounds
from pflalign.run.audit import Audit
from pflalign.run.checkpoint import Checkpoint, Snapshot, capture_rng, nonempty, restore_rng
from pflalign.server.aggregation import FlatSpec, mean_cosine
from pflalign.server.buffered import server_step
from pflalign.server.clock import availability_of, close_round, profiles_of, sample_available
from pflalign.server.metrics import accuracy_summary
from pflalign.server.privacy import (
    CentralPrivacy,
    epsilon_of,
    local_multiplier,
    privacy_warnings,
    run_noise_multiplier,
)
from pflalign.server.runtime import ServerRuntime
from pflalign.server.sampling import expected_clients
from pflalign.server.validation import (
    ClientFailure,
    Collected,
    ReplyValidator,
    non_finite,
    state_limit,
    state_problem,
)
from pflalign.settings.options import ConfigError
from pflalign.training.loops import num_local_steps
from pflalign.wire.messages import ClientInfo, Exchange, Outgoing, Payload, Reply, Update
from pflalign.wire.protocol import (
    ARRAY_HEADER,
    CLIENT_SECONDS,
    CLIENT_STATE,
    EVALUATE,
    GLOBAL_CORRECT,
    GLOBAL_LOSS,
    HAD_STATE,
    ID,
    KEPT_STATE,
    LABEL,
    METHOD,
    MODEL,
    NEXT_CORRECT,
    NUM_EXAMPLES,
    NUM_TEST,
    PARTITION_ID,
    PERSONAL_CORRECT,
    PERSONAL_LOSS,
    PROCESS_HOST,
    PROCESS_ID,
    PROCESS_METRICS,
    PROCESS_PEAK_RSS_MB,
    RESTORE,
    ROUND,
    STATE,
    STATE_CHUNK,
    TRAIN,
    TRAIN_LOSS,
)
from pflalign.wire.state import ServerState, State


class _NoCheckpoint(Exception):
    """A client's state cannot be had: no checkpoint is written this time (the message says
    why)."""


class RoundHook(Protocol):
    """A cross-cutting step before a round's training (GGA's warm start): it may replace the
    server state; its row entries and bytes are recorded in the round's row.

    A hook that keeps state between rounds gives it to checkpoints through ``state_dict()`` (a
    JSON-able dict) and ``load_state_dict(state)``; a loop with a hook without them writes
    no checkpoint."""

    def before_training(self, loop: RoundLoop, server_round: int,
                        ) -> tuple[dict[str, float], int, int]:
        """The row entries, bytes down and bytes up."""


class RoundLoop:
    """Runs one method for the run's rounds over an engine; see the module docstring."""

    def __init__(self, server: ServerRuntime, method: Method, engine: Engine,
                 reporter: Reporter | None = None, hooks: Sequence[RoundHook] = ()):
        self.server = server
        self.method = method
        server.keep_personal(method.personal_keys(server))
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
        self.pending_restore: MutableMapping[int, State] = {}
        #: the checks every reply meets (its warnings go to the reporter, not through this loop,
        #: which would make a reference cycle that keeps the engine and its files alive)
        label, reporter = server.label, self.reporter
        self.validator = ReplyValidator(server, lambda text: reporter.warn(f"[{label}] {text}"))
        #: the evaluation and training audits (given this loop's exchange each round, not kept)
        self.audit = Audit(server, method, self.validator,
                           lambda text: reporter.warn(f"[{label}] {text}"))
        #: each client's device profile (None: device-profiles = none, no simulated clock),
        #: and the clock: the simulated seconds of the training rounds so far
        run = server.settings.run
        self.profiles = profiles_of(run, run.num_clients + run.num_unseen_clients)
        self.availability = availability_of(run, run.num_clients + run.num_unseen_clients)
        self.sim_time = 0.0
        #: ``mode = async``'s rounds (None: synchronous rounds)
        self.buffered: BufferedRounds | None = None
        #: per client process (host id, pid) that sent an accepted reply in this run: the
        #: largest peak memory it reported (MiB) and how many such replies it sent
        self.client_processes: dict[tuple[int, int], tuple[float, int]] = {}
        #: per training client: how many trainings it was sent, and how many of its updates were
        #: aggregated (the result's ``usage``: who a deadline or staleness leaves out)
        self.usage: dict[int, list[int]] = {}
        #: ``dp = central``: the clip, noise and accountant (None: no differential privacy)
        self.privacy: CentralPrivacy | None = None

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
        """Run all rounds; return ``{"rounds": [...], "final": {...}, "clients": [...],
        "processes": [...]}`` (:meth:`processes`).

        With ``checkpoint``, write it after every round it is due, and when its file exists at
        the start (a run killed after that round), continue from the round after it."""
        server, run = self.server, self.server.settings.run
        self.reporter.info(
            f"[{self.label}] {run.rounds} rounds, {run.num_clients} clients "
            f"(+{run.num_unseen_clients} unseen), fraction-train {run.fraction_train}, "
            f"model {run.model} ({server.flat.size:,} values)")
        server.clients = self.engine.discover()
        self.state = self.method.init_server(server, initial_model)
        if run.mode == "async":  # on the simulated clock, or in real time without profiles
            self.buffered = (BufferedRounds(self) if self.profiles is not None
                             else RealTimeRounds(self))
            self.reporter.info(f"[{self.label}] asynchronous: {self.buffered.concurrency} clients "
                               f"in flight, aggregating every {self.buffered.buffer_size} "
                               "arrivals")
        self.check_deadline()
        if run.dp == "central" and self.method.uploads_model:
            self.privacy = self.central_privacy()
        elif run.dp == "local":
            self.reporter.info(
                f"[{self.label}] dp = local: each client clips its update to {run.dp_clip:g} "
                f"and adds noise of multiplier {run_noise_multiplier(run):.4g} before it leaves")
        if self.method.uploads_model:
            for text in privacy_warnings(run, len(self.server.training_clients())):
                self.warn(text)
        last_eval: dict[str, float] = {}
        first = 1
        snapshot = checkpoint.read() if checkpoint is not None else None
        if snapshot is not None:
            last_eval = self.restore(snapshot)
            self.sim_time = float(self.rounds[-1].get("sim-time", 0.0)) if self.rounds else 0.0
            first = snapshot.round + 1
            self.reporter.info(f"[{self.label}] resumed from round {snapshot.round} (checkpoint "
                               f"{checkpoint.path})")
        if first == 1 and run.eval_at_start:  # the initial model, before any training
            started = time.perf_counter()
            last_eval, down, up = self.evaluate_round(0)
            row = {"round": 0, **last_eval, "eval-seconds": time.perf_counter() - started,
                   "round-seconds": time.perf_counter() - started, "bytes-up": up,
                   "bytes-down": down}
            self.rounds.append(row)
            self.reporter.round(self.label, row, server.rounds)
        for server_round in range(first, server.rounds + 1):
            check_stop()
            started = time.perf_counter()
            row: dict = {"round": server_round}
            down = up = 0
            for hook in self.hooks:
                entries, hook_down, hook_up = hook.before_training(self, server_round)
                row.update(entries)
                down, up = down + hook_down, up + hook_up
            entries, train_down, train_up = (self.train_round(server_round)
                                             if self.buffered is None
                                             else self.buffered.round(server_round))
            row.update(entries)
            if self.privacy is not None:
                row.update(self.privacy.account())
            elif run.dp != "off":
                row.update(self.local_epsilon())
            down, up = down + train_down, up + train_up
            row["train-seconds"] = time.perf_counter() - started
            row.update(self.method.round_diagnostics(server, self.state))
            if server.is_eval_round(server_round):
                eval_started = time.perf_counter()
                if self.buffered is not None:  # each client as it is after its latest dispatch
                    self.buffered.train_all()
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
                "clients": self.client_results, "processes": self.processes(),
                "usage": [{"id": cid, "dispatched": sent, "used": used}
                          for cid, (sent, used) in sorted(self.usage.items())],
                "audit-secret": self.audit.secret}

    def central_privacy(self) -> CentralPrivacy:
        """``dp = central``'s clip, noise and accountant for this run: the released entries are
        the exchanged floating-point arrays, the denominator the expected clients a round."""
        server, run = self.server, self.server.settings.run
        shared = server.shared_model(self.state)
        spec = FlatSpec.of({k: v for k, v in shared.items() if np.asarray(v).dtype.kind == "f"})
        expected = expected_clients(run.sampling, run.fraction_train,
                                    len(server.training_clients()))
        privacy = CentralPrivacy(run, server.private_key, spec, expected)
        self.reporter.info(
            f"[{self.label}] dp = central: each update clipped to "
            f"{run.dp_clip:g}{' (adaptive)' if privacy.adaptive else ''}, noise multiplier "
            f"{privacy.noise_multiplier:.4g}{' (from dp-epsilon)' if run.dp_epsilon else ''}, "
            f"sum over {expected:g} expected clients, sample rate "
            f"{privacy.accountant.sample_rate:g}; the clip replaces the update-norm bound")
        return privacy

    def local_epsilon(self) -> dict[str, float]:
        """The row's epsilon under ``dp = local`` (or for a method that uploads nothing, 0): what
        the client that trained most often so far has spent, each of its uploads a Gaussian
        release at :func:`~pflalign.server.privacy.local_multiplier` (no amplification: a
        client knows when it takes part); without noise, none (there is no guarantee)."""
        run = self.server.settings.run
        if not self.method.uploads_model:
            return {"dp-epsilon": 0.0}
        multiplier = run_noise_multiplier(run)
        if multiplier == 0:
            return {}
        trainings = max((sent for sent, _ in self.usage.values()), default=0)
        return {"dp-epsilon": epsilon_of([(local_multiplier(multiplier), 1.0, trainings)],
                                         run.dp_delta)}

    def dispatched(self, clients: Iterable[int]) -> None:
        """Count a training sent to each of ``clients`` (:attr:`usage`)."""
        for cid in clients:
            self.usage.setdefault(cid, [0, 0])[0] += 1

    def check_deadline(self) -> None:
        """Refuse, before any training, a ``round-deadline`` that no training client can meet
        even without uploading anything: the download of the global model and its compute
        already take longer."""
        deadline = self.server.settings.run.round_deadline
        if self.profiles is None or deadline <= 0:
            return
        down = records_bytes([self.server.shared_model(self.state)])
        fastest = min((self.profiles.seconds(cid, down, self.charged_samples(info), 0), cid)
                      for cid, info in self.server.clients.items() if not info.unseen)
        if fastest[0] > deadline:
            raise ConfigError(f"round-deadline = {deadline:g} simulated s is shorter than any "
                              f"client's round: the fastest, client {fastest[1]}, needs "
                              f"{fastest[0]:.4g} s to download the model and train, before its "
                              "upload; raise round-deadline.")

    # --- processes -----------------------------------------------------------------------------
    def note_processes(self, replies: Iterable[Mapping[str, float]]) -> None:
        """Keep, from the metrics of accepted ``replies``, each reporting process's largest
        peak memory and its count of replies (a reply without the process metrics is passed
        over)."""
        for metrics in replies:
            if not all(key in metrics for key in PROCESS_METRICS):
                continue
            key = (int(metrics[PROCESS_HOST]), int(metrics[PROCESS_ID]))
            peak, replies_so_far = self.client_processes.get(key, (0.0, 0))
            self.client_processes[key] = (max(peak, float(metrics[PROCESS_PEAK_RSS_MB])),
                                          replies_so_far + 1)

    def processes(self) -> list[dict]:
        """The run's processes for its result: first this one, the server's (its host id, pid
        and peak memory so far, in MiB), then each client process that sent an accepted reply,
        by pid, with the largest peak it reported and its number of accepted replies. Under the
        in-process engines the clients run here: the server's pid is then a client's too."""
        server = {"role": "server", "host": host_id(), "pid": os.getpid(),
                  "peak-rss-mb": peak_rss_mb()}
        clients = [{"role": "clients", "host": host, "pid": pid, "peak-rss-mb": peak,
                    "replies": count}
                   for (host, pid), (peak, count) in sorted(
                       self.client_processes.items(), key=lambda item: item[0][::-1])]
        return [server, *clients]

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
        buffered: tuple[dict, State] = ({}, {})
        run = self.server.settings.run
        if run.dp == "local" and run.engine == "flower" and self.saved_state:
            if server_round == checkpoint.every:
                self.warn("no checkpoints are written under dp = 'local' on the Flower engine: "
                          "they would ask the clients for their saved state, which must not "
                          "leave them; a killed run starts over.")
            return
        if isinstance(self.buffered, RealTimeRounds):
            if server_round == checkpoint.every:
                self.warn("no checkpoints are written in real-time asynchronous rounds (the "
                          "replies in flight cannot be kept); a killed run starts over.")
            return
        if self.buffered is not None:  # replies in flight are kept, never messages
            self.buffered.train_all()
            buffered = self.buffered.state_dict()
        rng_arrays, rng_meta = capture_rng()
        snapshot = Snapshot(
            round=server_round, server=self.state.to_arrays(),
            before_aggregation=(None if self.before_aggregation is None
                                else self.before_aggregation.to_arrays()),
            clients={}, rounds=self.rounds, client_results=self.client_results,
            saved_state=sorted(self.saved_state), last_eval=dict(last_eval), hooks=hooks,
            usage={str(cid): counts for cid, counts in self.usage.items()},
            rng_arrays=rng_arrays, rng_meta=rng_meta,
            norms={part: [list(kept) for kept in rounds]
                   for part, rounds in self.validator.norm_history.items()},
            buffered=buffered[0], buffered_arrays=buffered[1],
            privacy={} if self.privacy is None else self.privacy.state_dict(),
            audit_secret=self.audit.secret)
        try:
            checkpoint.write(snapshot, self.client_states(server_round))
        except _NoCheckpoint as reason:
            self.warn(f"no checkpoint after round {server_round}: {reason}.")

    def client_states(self, server_round: int) -> Iterator[tuple[int, State]]:
        """The method state of every client that keeps one (:attr:`saved_state`), in client
        order, as ``(id, state)`` pairs: a state still to be restored as it is, the others asked
        of the clients :data:`STATE_CHUNK` at a time (a :data:`~pflalign.wire.protocol.STATE`
        exchange, which no round's bytes count), so that a checkpoint never holds every
        client's state at once. :class:`_NoCheckpoint` when a client does not give it."""
        order = sorted(self.saved_state)
        for start in range(0, len(order), STATE_CHUNK):
            chunk = order[start:start + STATE_CHUNK]
            ask = [cid for cid in chunk if cid not in self.pending_restore]
            states: dict[int, State] = {}
            if ask:
                exchange = self.exchange(STATE, [self.message(cid, Payload(), server_round)
                                                 for cid in ask])
                for reply in exchange.replies:
                    try:
                        self.validator.validate(reply, {}, {PARTITION_ID: ID}, (CLIENT_STATE,))
                    except ClientFailure as failure:
                        raise _NoCheckpoint(str(failure)) from None
                    state = dict(reply.arrays.get(CLIENT_STATE, {}))
                    problem = state_problem(self.method.ClientState, state, self.server.initial)
                    if problem:
                        raise _NoCheckpoint(f"{reply.who}'s saved state was rejected: {problem}")
                    states[reply.sender] = state
                missing = sorted(set(ask) - set(states))
                if missing:
                    raise _NoCheckpoint(f"clients {missing} did not give their state")
            for cid in chunk:
                yield cid, (self.pending_restore[cid] if cid in self.pending_restore
                            else states.pop(cid))

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
        self.usage = {int(cid): list(counts) for cid, counts in snapshot.usage.items()}
        self.pending_restore = nonempty(snapshot.clients)  # each read when it is sent
        self.validator.norm_history = {part: [[float(n) for n in kept] for kept in rounds]
                                       for part, rounds in snapshot.norms.items()}
        restore_rng(snapshot.rng_arrays, snapshot.rng_meta)
        if self.buffered is not None:
            self.buffered.load_state_dict(snapshot.buffered, snapshot.buffered_arrays)
        if self.privacy is not None:
            self.privacy.load_state_dict(snapshot.privacy)
            if self.privacy.seed != self.server.private_key:  # dp-secure's key, as it was
                self.server.private_key = self.privacy.seed
                self.server.forget_samples()
        if snapshot.audit_secret:
            self.audit.secret = snapshot.audit_secret
        return dict(snapshot.last_eval)

    def reply_limits(self, action: str) -> dict[str, int] | None:
        """The array records a reply to ``action`` may carry, with the most bytes each may hold:
        a training reply's, their specs' bytes (:meth:`~pflalign.methods.base.Method.reply_arrays`);
        an evaluation reply, none; a state query's, the bound on a saved state. None for other
        actions."""
        if action == TRAIN:
            if not self.method.uploads_model:
                return {}
            specs = {MODEL: self.server.flat, **self.method.reply_arrays(self.server)}
            return {name: spec.nbytes + ARRAY_HEADER * len(spec.keys)
                    for name, spec in specs.items()}
        if action == EVALUATE:
            return {}
        if action == STATE:
            return {CLIENT_STATE: state_limit(self.server.initial)}
        return None

    def exchange(self, action: str, messages: Sequence[Outgoing]) -> Exchange:
        """The engine's exchange of the :meth:`prepared` messages; each client that replies (even
        with a reply that is then rejected) has its pending restored state, which is not sent
        again (:meth:`delivered`). A client that failed or timed out gets it again with its next
        message."""
        exchange = self.engine.exchange(action, self.prepared(action, messages))
        self.delivered(exchange.replies)
        return exchange

    def prepared(self, action: str, messages: Sequence[Outgoing]) -> list[Outgoing]:
        """``messages``, each carrying the :meth:`reply_limits` of its action, and each pending
        restored state attached to its client's train or evaluate message (as the record
        :data:`~pflalign.wire.protocol.RESTORE`)."""
        limits = self.reply_limits(action)
        if limits is not None:
            messages = [replace(m, limits=limits) for m in messages]
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

    def train_round(self, server_round: int) -> tuple[dict, int, int]:
        """One training round: the round's metrics, and the bytes sent down and up."""
        server, method = self.server, self.method
        over = server.settings.run.over_selection if self.profiles is not None else 1.0
        wanted = len(server.sample(server_round))
        clock: dict = {}
        if self.availability is not None:
            sampled, wanted, clock = self.available_sample(server_round, wanted, over)
        else:
            sampled = (server.sample(server_round, over) if over > 1
                       else server.sample(server_round))
        if not sampled:  # sampling = poisson drew no client
            return self.empty_round(server_round, clock), 0, 0
        messages = [self.message(cid, method.train_payload(server, self.state, cid, server_round),
                                 server_round)
                    for cid in server.largest_first(sampled)]
        self.dispatched(m.client for m in messages)
        states, audit = self.audit.training_states(
            server_round, [m.client for m in messages], self.pending_restore, self.exchange,
            lambda cid: self.message(cid, Payload(), server_round))
        exchange = self.exchange(TRAIN, messages)
        if server.settings.run.record_uploads:
            self.record_uploads(server_round, messages, exchange)
        if self.profiles is not None:
            exchange, closed = self.close_round(server_round, messages, exchange, wanted)
            clock.update(closed)
        reply_arrays = {MODEL: server.flat, **method.reply_arrays(server)} \
            if method.uploads_model else {}
        collected = self.validator.collect(exchange.replies, reply_arrays,
                                           method.reply_metrics(TRAIN))
        audit = self.audit.check_training(server_round, messages, collected, states, audit)
        updates = [Update(client=int(m[PARTITION_ID]), num_examples=m[NUM_EXAMPLES], metrics=m,
                          model=arrays.get(MODEL),
                          arrays={k: v for k, v in arrays.items() if k != MODEL})
                   for m, arrays in audit.good]
        # under dp, the clip bounds every update (and a reference drawn from the other clients'
        # norms would make one client's acceptance depend on their data)
        updates, too_large = ((updates, 0) if self.privacy is not None
                              else self.validator.bound_updates(updates, self.state.model))
        updates, clipped = self.validator.clip_updates(updates, self.state.model,
                                                       server.settings.run.update_clip)
        self.note_processes(u.metrics for u in updates)
        self.check_kept_state(updates)
        row: dict = {"clients-trained": len(updates), "failures": collected.failed,
                     "timeouts": collected.timed_out,
                     "rejected": collected.rejected + audit.rejected + too_large,
                     "train-audited": audit.audited, "train-audit-rejected": audit.rejected,
                     **clock}
        if server.settings.run.update_clip > 0:
            row["clipped"] = clipped
        if self.validator.largest_ratio is not None:  # how close the kept updates came
            row["norm-ratio-max"] = float(self.validator.largest_ratio)
        traffic = exchange.bytes_down, exchange.bytes_up
        answered = len(exchange.replies) - collected.failed
        # under dp = central the rollback is not taken: whether it happens depends on the clients'
        # losses, which the release does not privatize (one client could tip the majority)
        if (self.before_aggregation is not None and self.privacy is None
                and 2 * collected.nonfinite_loss > answered > 0):
            self.warn(f"round {server_round}: {collected.nonfinite_loss} of {answered} clients "
                      "report a non-finite loss when training from the global model; the last "
                      "aggregation is rolled back and this round's updates are not used.")
            self.state, self.before_aggregation = self.before_aggregation, None
            row.update({"clients-trained": 0, "rolled-back": 1})
            return row, *traffic
        return self.aggregate_updates(server_round, updates, row), *traffic

    def aggregate_updates(self, server_round: int, updates: Sequence[Update], row: dict,
                          lr: float = 1.0) -> dict:
        """Aggregate a round's validated, bounded ``updates`` into the server state with the
        method's rule (``lr`` != 1: the model then moves that factor of the way, ``async-lr``),
        keeping the previous state when none is usable or the aggregate is not finite; returns
        ``row`` with the aggregation's diagnostics."""
        server, method = self.server, self.method
        released = updates
        if self.privacy is not None and method.uploads_model:
            released = [self.private_release(server_round, updates, row)]
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
            row["update-cosine"] = self.update_cosine(previous.model, self.state.model, updates)
        for key in method.client_diagnostics:
            values = [u.metrics[key] for u in updates if key in u.metrics]
            if values:
                row[key] = float(np.mean(values))
                row[f"{key}-median"] = float(np.median(values))  # one client cannot drag it
        row.update(diagnostics)
        row[CLIENT_SECONDS] = float(sum(u.metrics.get(CLIENT_SECONDS, 0.0) for u in updates))
        if updates and all(TRAIN_LOSS in u.metrics for u in updates):
            row[TRAIN_LOSS] = float(np.average([u.metrics[TRAIN_LOSS] for u in updates],
                                               weights=[u.num_examples for u in updates]))
            row[f"{TRAIN_LOSS}-median"] = float(np.median([u.metrics[TRAIN_LOSS]
                                                           for u in updates]))
        return row

    def empty_round(self, server_round: int, clock: dict) -> dict:
        """A round that drew no client (``sampling = poisson``): nothing is trained or sent; under
        ``dp`` the noise alone is released, as in any round."""
        self.warn(f"round {server_round}: sampling = poisson drew none of the "
                  f"{len(self.server.training_clients())} training clients; nothing is trained.")
        row = {"clients-trained": 0, **clock}
        if self.profiles is not None:
            row.update({"sim-seconds": 0.0, "sim-time": self.sim_time})
        return self.aggregate_updates(server_round, [], row) if self.privacy is not None else row

    def private_release(self, server_round: int, updates: Sequence[Update], row: dict,
                        ) -> Update:
        """``dp = central``: the round's updates as the one update the method's server rule
        aggregates: the model the round started from plus the clipped updates' noised sum over
        the expected clients (:class:`~pflalign.server.privacy.CentralPrivacy`)."""
        shared = self.server.shared_model(self.state)
        release = self.privacy.release(shared, [u.model for u in updates], server_round)
        row.update(release.entries)
        return Update(client=-1, num_examples=1, metrics={}, model={**shared, **release.model})

    def available_sample(self, server_round: int, wanted: int, over: float,
                         ) -> tuple[list[int], int, dict]:
        """The round's clients among those reachable when it starts (:mod:`pflalign.server.clock`:
        the clock waits for the next to become reachable when none is), how many of their
        replies it wants, and the row's entries (``available``; ``waited``: simulated seconds
        the clock moved on for one)."""
        pool = self.server.training_clients()
        reachable = self.availability.available(pool, self.sim_time)
        entries: dict = {}
        if not reachable:
            opening = self.availability.next_opening(pool, self.sim_time)
            entries["waited"] = opening - self.sim_time
            self.sim_time = opening
            reachable = self.availability.available(pool, self.sim_time)
            self.warn(f"round {server_round}: no client is reachable; the clock waits "
                      f"{entries['waited']:.0f} simulated s for the next.")
        entries["available"] = len(reachable)
        if len(reachable) < wanted:
            self.warn(f"round {server_round}: {len(reachable)} of the {wanted} clients this round "
                      "wants are reachable; it trains those.")
        count = min(len(pool), max(1, round(wanted * over))) if over > 1 else wanted
        sampled = sample_available(reachable, count, self.server.seed, server_round)
        return sampled, min(wanted, len(sampled)), entries

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

    def close_round(self, server_round: int, messages: Sequence[Outgoing], exchange: Exchange,
                    wanted: int) -> tuple[Exchange, dict]:
        """The replies a synchronous round uses, by their simulated arrival
        (:mod:`pflalign.server.clock`): each client's download of its message, its training
        samples at its compute speed and its upload of its reply; a failed or silent client
        never arrives. Returns the exchange with the used replies only, and the row's clock
        entries (``sim-seconds``, ``sim-time``, and how many were ``late`` or ``unneeded``)."""
        sent = {m.client: sent_bytes(m.payload.arrays) for m in messages}
        arrivals: list[float | None] = []
        for reply in exchange.replies:
            info = self.server.clients.get(reply.sender) if reply.sender is not None else None
            if reply.error is not None or reply.timed_out or info is None \
                    or reply.sender not in sent:
                arrivals.append(None)
                continue
            arrivals.append(self.profiles.seconds(
                reply.sender, sent[reply.sender], self.charged_samples(info),
                records_bytes(reply.arrays.values())))
        closed = close_round(arrivals, wanted, self.server.settings.run.round_deadline)
        kept = set(closed.used)
        replies = [r for i, r in enumerate(exchange.replies)
                   if arrivals[i] is None or i in kept]  # failures stay, to be counted
        for i, reply in enumerate(exchange.replies):
            # a dropped client trained and keeps what it trained, on its device: its state is
            # one a checkpoint must ask for, as a used client's is
            if arrivals[i] is not None and i not in kept and reply.metrics.get(KEPT_STATE):
                self.saved_state.add(reply.sender)
        self.sim_time += closed.seconds
        clock = {"sim-seconds": closed.seconds, "sim-time": self.sim_time}
        if self.server.settings.run.round_deadline > 0:
            clock["late"] = closed.late
        if self.server.settings.run.over_selection > 1:
            clock["unneeded"] = closed.unneeded
        if closed.late:
            self.warn(f"round {server_round}: {closed.late} client(s) would "
                      f"reply after round-deadline = {self.server.settings.run.round_deadline:g} "
                      "simulated s; their updates are not used.")
        return Exchange(replies, exchange.bytes_down, exchange.bytes_up), clock

    def record_uploads(self, server_round: int, messages: Sequence[Outgoing],
                       exchange: Exchange) -> None:
        """``record-uploads``: each training reply's array records as they reached the server,
        before any check, with the records the server sent that client, one ``.npz`` a client."""
        folder = (Path(self.server.settings.run.out_dir) / "uploads" / slug(self.label)
                  / f"round-{server_round}")
        folder.mkdir(parents=True, exist_ok=True)
        sent = {m.client: m.payload.arrays for m in messages}
        for reply in exchange.replies:
            if reply.error is not None or reply.sender not in sent:
                continue
            arrays = {f"{side}/{record}/{key}": np.asarray(value)
                      for side, records in (("upload", reply.arrays),
                                            ("sent", sent[reply.sender]))
                      for record, entries in records.items() for key, value in entries.items()}
            np.savez(folder / f"client-{reply.sender}.npz", **arrays)

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
        answered = metrics["eval-clients"] - metrics.get("eval-busy", 0) - collected.failed
        # under dp = central the rollback is not taken: whether it happens depends on the clients'
        # losses, which the release does not privatize (one client could tip the majority)
        if (self.before_aggregation is not None and self.privacy is None
                and 2 * collected.nonfinite_loss > answered > 0):
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
        wanted = server.largest_first(server.eval_sample(method.eval_clients(server),
                                                         server_round))
        busy = self.buffered.busy() & set(wanted) if self.buffered is not None else set()
        messages = [self.message(cid, method.eval_payload(server, self.state, cid, server_round),
                                 server_round)
                    for cid in wanted if cid not in busy]  # in real time, in flight: training
        exchange = self.exchange(EVALUATE, messages)
        collected = self.validator.collect(exchange.replies, {}, method.reply_metrics(EVALUATE))
        audit = self.audit.check_evaluation(server_round, messages, collected, self.exchange,
                                            lambda cid: self.message(cid, Payload(),
                                                                     server_round))
        rows = [m for m, _ in audit.good]
        self.note_processes(rows)
        rejected = collected.rejected + audit.rejected
        metrics: dict = {"eval-failures": collected.failed + rejected,
                         "eval-rejected": rejected, "evaluated": len(rows),
                         "eval-clients": len(wanted), "eval-audited": audit.audited,
                         "eval-audit-rejected": audit.rejected}
        if busy:
            metrics["eval-busy"] = len(busy)
        info = {int(m[PARTITION_ID]): server.clients[int(m[PARTITION_ID])] for m in rows}
        seen = [m for m in rows if not info[int(m[PARTITION_ID])].unseen]
        unseen = [m for m in rows if info[int(m[PARTITION_ID])].unseen]
        if seen:
            metrics.update(accuracy_summary([m[PERSONAL_CORRECT] for m in seen],
                                            [m[NUM_TEST] for m in seen]))
            metrics[PERSONAL_LOSS] = float(np.average(
                [m[PERSONAL_LOSS] for m in seen], weights=[m[NUM_TEST] for m in seen]))
            metrics[f"{PERSONAL_LOSS}-median"] = float(np.median([m[PERSONAL_LOSS]
                                                                 for m in seen]))
            tested = sum(m[NUM_TEST] for m in seen)
            # a next-token model (a language model, or LEAF's character LSTM): the perplexity
            # of every seen client's test tokens together
            language = (is_language_model(server.settings.run.model)
                        or server.settings.run.model == "char-lstm")
            if language:
                metrics["personal-ppl"] = float(np.exp(metrics[PERSONAL_LOSS]))
            if method.has_global_model and all(GLOBAL_CORRECT in m for m in seen):
                metrics["global-acc"] = sum(m[GLOBAL_CORRECT] for m in seen) / tested
                if language and all(GLOBAL_LOSS in m for m in seen):
                    metrics["global-ppl"] = float(np.exp(np.average(
                        [m[GLOBAL_LOSS] for m in seen], weights=[m[NUM_TEST] for m in seen])))
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

    def update_cosine(self, previous: State, new: State, updates: Sequence[Update]) -> float:
        """Mean cosine between each client's update and the aggregated update (trainable shared
        entries): how much aggregation agrees with the clients' directions."""
        spec = self.server.trainable_shared
        base = spec.flatten(previous, np.float64)
        return mean_cosine([spec.flatten(u.model, np.float64) - base for u in updates
                            if u.model is not None], spec.flatten(new, np.float64) - base)

    def final_metrics(self, last_eval: Mapping[str, float]) -> dict[str, float]:
        seconds = [r["round-seconds"] for r in self.rounds]
        final = dict(last_eval)
        if self.rounds and TRAIN_LOSS in self.rounds[-1]:
            final[TRAIN_LOSS] = self.rounds[-1][TRAIN_LOSS]
        if self.rounds and "dp-epsilon" in self.rounds[-1]:
            final["dp-epsilon"] = self.rounds[-1]["dp-epsilon"]
        final.update({
            "rounds": len(self.rounds),
            "seconds-per-round": float(np.mean(seconds)) if seconds else 0.0,
            "total-seconds": float(np.sum(seconds)),
            "bytes-up": int(sum(r["bytes-up"] for r in self.rounds)),
            "bytes-down": int(sum(r["bytes-down"] for r in self.rounds)),
        })
        budget = self.server.settings.run.time_budget
        if self.profiles is not None and budget > 0:
            final["at-time-budget"] = self.at_time_budget(budget)
        return final

    def at_time_budget(self, budget: float) -> dict:
        """The method at a simulated-time budget: its last evaluation in a round that ended by
        ``budget`` (the round, its clock and accuracies), or only the budget when none did."""
        within = [r for r in self.rounds if "personal-acc" in r and r["sim-time"] <= budget]
        out: dict = {"budget": budget}
        if within:
            row = within[-1]
            out.update({"round": row["round"], "sim-time": row["sim-time"],
                        **{k: row[k] for k in ("personal-acc", "global-acc", "unseen-acc")
                           if k in row}})
        return out
