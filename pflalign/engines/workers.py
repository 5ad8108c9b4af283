"""``engine = batched`` on Ray actors: a round's clients split across worker processes.

With ``batched-workers`` = N > 1 (or ``auto``, or a ``--ray-address`` cluster), the batched engine
runs in N Ray actors, each a :class:`Worker`: it holds the pooled data once and the model's frozen
parts once (both by the process caches of :mod:`pflalign.data.federated` and
:mod:`pflalign.models.registry`), keeps the saved state of the clients it serves in its own
:class:`~pflalign.engines.store.ClientStateStore` (spilled beyond its share of ``memory-budget-gb``,
in its node's own ``out-dir``), and runs its share of every exchange with the one client path (a
:class:`~pflalign.engines.batched.BatchedEngine`). The driver (:class:`ActorEngine`) keeps the round
loop, so validation, aggregation, metrics and checkpoints are those of one process.

Each exchange, the driver assigns the messages to the actors (:func:`assign`): a client goes to
the actor that holds its state while that actor has less than an even share of the exchange's
work, the others to the least loaded actor; a client whose state is elsewhere has it moved
first, actor to actor through Ray's object store. Each actor's share is then handed out in
pieces (:class:`WorkQueues`), at most two calls queued on an actor at a time, pieces shrinking as
its share empties; an actor that runs out of work while another still has clients waiting takes
the smallest of them, up to half of their work (work stealing: a training client's state moves
with it, an evaluated client moves only if it holds none), so that actors of unequal speed, or
clients whose cost the split mispredicted, finish together. Each piece comes back as one
:class:`~pflalign.wire.messages.Exchange`; the replies are put back in message order. Uploads come
back through the object store (NumPy arrays are read from it without a copy). Which actor serves
a client changes nothing it computes: every draw is derived from (seed, round, client), so with
one torch thread per actor the metrics equal the sequential engine's at one thread, bit for bit,
for every N.

An actor that dies during an exchange fails the clients of its share not yet answered (error
replies naming it, as a failed client is named), the round completes without them, and a new
actor takes its place before the next exchange; the state of the clients it held is lost with
it, and each such client is warned about when it next replies without it. Needs Ray; nothing
here imports it at import time.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from pflalign.data.federated import federated_dataset
from pflalign.engines.base import Engine, EngineFactory, register_engine
from pflalign.engines.batched import BatchedEngine
from pflalign.engines.ray_cluster import LOOPBACK_HOSTS, check_ray_address, parse_ray_address
from pflalign.outputs.results import Reporter
from pflalign.settings.options import ConfigError
from pflalign.settings.schema import Settings
from pflalign.training.loops import configure_threads, num_local_steps
from pflalign.wire.messages import Exchange, Outgoing, Reply
from pflalign.wire.protocol import EVALUATE, RESTORE, STATE, TRAIN
from pflalign.wire.state import State

#: the concurrency group of a worker's state hand-overs (:meth:`Worker.take`,
#: :meth:`Worker.put`): a thread of their own, so that a worker hands a state over while it
#: trains other clients
STATE_GROUP = "state"


class _Collecting(Reporter):
    """A worker's reporter: its lines are kept for the driver to print (once each)."""

    def __init__(self) -> None:
        super().__init__(quiet=True)
        self.lines: list[str] = []

    def info(self, text: str) -> None:
        self.lines.append(text)

    def warn(self, text: str) -> None:
        self.lines.append(f"WARNING: {text}")


class Worker:
    """One actor's side: the data and the model's frozen parts loaded once per process, and for
    the running method entry a :class:`BatchedEngine` holding the state of the clients it
    serves."""

    def __init__(self, settings: Settings, index: int, workers: int):
        import ray

        self.index, self.workers = index, workers
        self.host = ray.util.get_node_ip_address() if ray.is_initialized() else socket.gethostname()
        configure_threads(settings.run.client_resources_num_cpus)
        try:
            federated_dataset(settings)  # the pooled data, once per process
        except Exception as err:
            raise ConfigError(f"worker {index} on node {self.host} cannot load the run's data "
                              f"({err}); every node of the Ray cluster needs the dataset under "
                              f"the same data-root ('{settings.run.data_root}').") from err
        self.engine: BatchedEngine | None = None
        self.reporter = _Collecting()

    def where(self) -> tuple[str, int]:
        """The address of this worker's Ray node, and its process id."""
        import ray

        return ray.util.get_node_ip_address(), os.getpid()

    def start(self, settings: Settings) -> None:
        """A new method entry: its settings, and no client state (the last entry's files go)."""
        if self.engine is not None:
            self.engine.close()
        share = settings.run.memory_budget_gb / self.workers
        self.spill = Path(settings.run.out_dir) / ".workers" / f"worker-{self.index}"
        self.engine = BatchedEngine(settings.replace({"memory-budget-gb": share,
                                                      "out-dir": str(self.spill)}), self.reporter)

    def exchange(self, action: str, messages: Sequence[Outgoing]
                 ) -> tuple[Exchange, list[str], list[int], float]:
        """The exchange's replies, what it said, which of its clients this worker now holds a
        saved state of, and the seconds it took."""
        started = time.perf_counter()
        exchange = self.engine.exchange(action, messages)
        seconds = time.perf_counter() - started
        lines, self.reporter.lines = self.reporter.lines, []
        states = self.engine.states
        return exchange, lines, [m.client for m in messages if m.client in states], seconds

    def take(self, clients: Sequence[int]) -> dict[int, State]:
        """The saved states of ``clients`` (those it holds), removed from this worker."""
        return self.engine.states.take(clients)

    def put(self, states: Mapping[int, State]) -> None:
        for cid, state in states.items():
            self.engine.states[cid] = dict(state)

    def holds(self) -> list[int]:
        return sorted(self.engine.states) if self.engine is not None else []

    def memory_note(self) -> str | None:
        return self.engine.memory_note() if self.engine is not None else None

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
            for folder in (self.spill, self.spill.parent):  # the spill folders, once empty
                with contextlib.suppress(OSError):
                    folder.rmdir()


#: how far above an even share of the exchange's work a worker may be and still keep a client
#: whose state it holds (so that assignments balanced by :func:`assign` stay put round to round)
KEEP_SLACK = 0.05


def assign(clients: Sequence[int], home: Mapping[int, int], workers: int,
           costs: Sequence[float] | None = None, slack: float = 0.0) -> list[int]:
    """The worker of each of ``clients`` (one exchange's, in message order), balancing their
    ``costs`` (default 1 each: their count). Clients are taken largest cost first (message order
    among equals): one stays with the worker ``home`` gives it while that worker's load with it
    stays within ceil(total / workers) x (1 + ``slack``) (``math.inf``: always); the others go to
    the least loaded worker (the lowest index first), the longest-processing-time-first rule."""
    costs = [1.0] * len(clients) if costs is None else [float(c) for c in costs]
    cap = math.inf if slack == math.inf else math.ceil(sum(costs) / workers) * (1 + slack)
    order = sorted(range(len(clients)), key=lambda i: (-costs[i], i))
    load = [0.0] * workers
    out: list[int | None] = [None] * len(clients)
    for i in order:
        k = home.get(clients[i])
        if k is not None and k < workers and load[k] + costs[i] <= cap + 1e-9:
            out[i] = k
            load[k] += costs[i]
    for i in order:
        if out[i] is None:
            k = min(range(workers), key=lambda w: (load[w], w))
            out[i] = k
            load[k] += costs[i]
    return [int(k) for k in out]


#: calls an exchange keeps queued on one worker: one running, one waiting, so that the worker
#: does not wait for the driver between pieces
DEPTH = 2
#: a piece is at least 1/PIECES of what the worker's queue holds (guided self-scheduling)
PIECES = 4
#: and at least this many seconds of work, by the rate measured so far (a call costs a worker
#: about 5 ms of its own: at 1,000 clients an evaluation's last pieces of one client each took
#: less than that)
MIN_PIECE_SECONDS = 0.1


class WorkQueues:
    """One exchange's messages queued per worker and handed out in pieces; a worker left without
    work takes the smallest messages of the fullest queue, up to half of its cost.

    Each worker's queue holds the message indices ``owners`` gives it, largest cost first (as
    :func:`assign` placed them). :meth:`piece` hands out the head of a queue: at least
    ``min_items`` messages, at least 1/:data:`PIECES` of the queue's cost and at least the cost
    its caller names, so that pieces shrink as the queue empties (guided self-scheduling;
    Polychronopoulos and Kuck, IEEE Trans. Computers 36(12), 1987). :meth:`steal` moves messages
    from the tail (the smallest) of the queue holding the most cost to an idle worker's, up to
    half of that queue's cost and at least one message, taking only those ``movable`` allows
    (work stealing; Blumofe and Leiserson, JACM 46(5), 1999)."""

    def __init__(self, owners: Sequence[int], costs: Sequence[float], workers: int,
                 min_items: int = 1):
        self.costs = [float(c) for c in costs]
        self.min_items = max(1, int(min_items))
        order = sorted(range(len(owners)), key=lambda i: (-self.costs[i], i))
        self.queues = [deque(i for i in order if owners[i] == k) for k in range(workers)]

    def queued(self, k: int) -> float:
        """The cost waiting in worker ``k``'s queue."""
        return sum(self.costs[i] for i in self.queues[k])

    def piece(self, k: int, min_cost: float = 0.0) -> list[int]:
        """The next messages for worker ``k`` (none when its queue is empty), at least
        ``min_cost`` of them where the queue holds that much."""
        queue, target = self.queues[k], max(self.queued(k) / PIECES, min_cost)
        out: list[int] = []
        cost = 0.0
        while queue and (len(out) < self.min_items or cost < target):
            out.append(queue.popleft())
            cost += self.costs[out[-1]]
        return out

    def steal(self, k: int, movable: Callable[[int], bool] = lambda i: True,
              ) -> tuple[int, list[int]] | None:
        """Move to worker ``k``'s queue the smallest movable messages of the other queue with the
        most movable cost, up to half of it; returns that queue's worker and the messages moved
        (None: nothing to take)."""
        others = [(sum(self.costs[i] for i in q if movable(i)), -v)
                  for v, q in enumerate(self.queues) if v != k and any(movable(i) for i in q)]
        if not others:
            return None
        load, victim = max(others)  # the most movable cost, the lowest index among equals
        victim, half = -victim, load / 2
        taken: list[int] = []
        cost = 0.0
        for i in reversed(self.queues[victim]):
            if not movable(i):
                continue
            if taken and cost >= half:
                break
            taken.append(i)
            cost += self.costs[i]
        if not taken:
            return None
        gone = set(taken)
        self.queues[victim] = deque(i for i in self.queues[victim] if i not in gone)
        self.queues[k].extend(sorted(taken, key=lambda i: (-self.costs[i], i)))
        return victim, taken

    def drop(self, k: int) -> list[int]:
        """Empty worker ``k``'s queue (it died); returns what was in it."""
        out = list(self.queues[k])
        self.queues[k].clear()
        return out


def resolve_workers(settings: Settings, cluster: Mapping[str, float]) -> int:
    """``batched-workers`` as a number: ``auto`` is one per GPU when clients use GPUs, else one
    per ``client-resources-num-cpus`` cores of ``cluster`` (Ray's resources); a
    :class:`ConfigError` when the workers asked for cannot all be placed."""
    run = settings.run
    cpus, gpus = run.client_resources_num_cpus, run.client_resources_num_gpus
    have_cpus, have_gpus = float(cluster.get("CPU", 0)), float(cluster.get("GPU", 0))
    text = str(run.batched_workers).strip()
    if text == "auto":
        n = int(have_gpus // gpus) if gpus > 0 else int(have_cpus // cpus)
        return max(1, n)
    n = int(text)
    if n * cpus > have_cpus + 1e-9 or n * gpus > have_gpus + 1e-9:
        need = f"{n * cpus:g} CPUs" + (f" and {n * gpus:g} GPUs" if gpus else "")
        raise ConfigError(
            f"batched-workers = {n} needs {need} (client-resources-num-cpus = {cpus:g}"
            + (f", client-resources-num-gpus = {gpus:g}" if gpus else "")
            + f" each), but the Ray cluster has {have_cpus:g} CPUs and {have_gpus:g} GPUs; "
            "lower batched-workers (or use auto) or the resources per worker.")
    return n


class WorkerPool:
    """The run's N actors, started once and kept across its method entries."""

    def __init__(self, settings: Settings, reporter: Reporter, address: str | None = None):
        import ray

        self.ray = ray
        self.reporter = reporter
        self.settings = settings
        self.said: set[str] = set()
        if not ray.is_initialized():
            from pflalign.engines.flower_process import bind_ray_to_loopback, set_flower_environment
            from pflalign.process.interrupt import reinstall_handlers

            set_flower_environment()  # Ray's usage statistics off, no warning at every start

            args: dict = {"include_dashboard": False, "logging_level": "ERROR",
                          "log_to_driver": False, "runtime_env": _runtime_env()}
            if address is None or parse_ray_address(address)[0] in LOOPBACK_HOSTS:
                bind_ray_to_loopback()  # a Ray of this machine listens on 127.0.0.1 only
            if address is None:
                ray.init(num_cpus=os.cpu_count(), **args)
            else:
                ray.init(address=address, **args)
            reinstall_handlers()  # ray.init installs its own SIGTERM handler
        self.n = resolve_workers(settings, ray.cluster_resources())
        run = settings.run
        self.options = {"num_cpus": run.client_resources_num_cpus,
                        "num_gpus": run.client_resources_num_gpus,
                        "scheduling_strategy": "SPREAD", "max_restarts": 0}
        self.actors = [self._new(k) for k in range(self.n)]
        places = ray.get([a.where.remote() for a in self.actors])
        hosts = sorted({host for host, _ in places})
        reporter.info(f"engine = batched on {self.n} Ray workers (on {', '.join(hosts)}), "
                      f"{run.client_resources_num_cpus:g} CPU(s) each")
        self.places = places

    def _new(self, k: int):
        remote = self.ray.remote(concurrency_groups={STATE_GROUP: 1})(Worker)
        actor = remote.options(**self.options).remote(self.settings, k, self.n)
        try:
            self.ray.get(actor.where.remote())
        except self.ray.exceptions.RayActorError as err:
            cause = getattr(err, "cause", None) or err
            raise ConfigError(_first_line(cause)) from None
        return actor

    def restart(self, k: int, settings: Settings) -> None:
        """A new actor in place of actor ``k`` (which died), ready for the running entry."""
        self.actors[k] = self._new(k)
        self.ray.get(self.actors[k].start.remote(settings))

    def say(self, lines: Sequence[str]) -> None:
        for line in lines:
            if line not in self.said:
                self.said.add(line)
                if line.startswith("WARNING: "):
                    self.reporter.warn(line[len("WARNING: "):])
                else:
                    self.reporter.info(line)

    def close(self) -> None:
        for actor in self.actors:
            try:
                self.ray.get(actor.close.remote())
            except Exception:  # noqa: BLE001 (a dead actor has nothing left to close)
                pass
            self.ray.kill(actor)
        self.actors = []


def _runtime_env() -> dict:
    """The workers import the project from this process's ``sys.path``."""
    import sys

    return {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}}


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    for line in reversed(text.splitlines()):
        if "ConfigError:" in line:
            return line.split("ConfigError:", 1)[1].strip()
    return text.splitlines()[0] if text else type(err).__name__


class ActorEngine(Engine):
    """The batched engine of one method entry, its clients served by a :class:`WorkerPool`."""

    def __init__(self, settings: Settings, pool: WorkerPool):
        self.settings = settings
        self.pool = pool
        self.ray = pool.ray
        #: what Ray raises for a call to a worker that died
        self.gone = (self.ray.exceptions.RayActorError, self.ray.exceptions.WorkerCrashedError,
                     self.ray.exceptions.ObjectLostError)
        self.ray.get([a.start.remote(settings) for a in pool.actors])
        #: the worker holding each client's saved state
        self.home: dict[int, int] = {}
        #: clients whose state was lost moving it from a worker that died (told with the death)
        self.lost_in_moves: set[int] = set()
        self.clients: dict = {}  # discovered: their split sizes weigh the assignment
        self._local = BatchedEngine(settings, pool.reporter)  # discovery only: no client runs
        run = settings.run
        #: the fewest clients of a piece: a whole cohort where the workers stack one (vmap)
        vmap = run.batched_backend == "vmap" or (run.batched_backend == "auto"
                                                 and run.client_resources_num_gpus > 0)
        self.min_items = run.cohort_size if vmap else 1
        #: per action, the workers' seconds and the cost they served so far: a piece is sized
        #: to at least MIN_PIECE_SECONDS of work by their ratio
        self.pace: dict[str, list[float]] = {}

    def discover(self):
        self.clients = self._local.discover()
        return self.clients

    def _costs(self, action: str, clients: Sequence[int]) -> list[float]:
        """Each client's share of an exchange's work: its local steps to train (every method
        trains in proportion to them), its test samples to evaluate; 1 for a client not
        discovered."""
        t = self.settings.training
        out = []
        for cid in clients:
            info = self.clients.get(cid)
            if info is None:
                out.append(1.0)
            elif action == TRAIN:
                out.append(float(num_local_steps(info.num_train, t.batch_size, t.local_epochs,
                                                 t.local_steps)))
            else:
                out.append(float(max(info.num_test, 1)))
        return out

    def exchange(self, action: str, messages: Sequence[Outgoing]) -> Exchange:
        if not messages:
            return Exchange([], 0, 0)
        n = len(self.pool.actors)
        clients = [m.client for m in messages]
        costs = self._costs(action, clients)
        if action == STATE:  # a query goes where the state is, and moves nothing
            owners = [self.home.get(cid, 0) for cid in clients]
        else:
            # training is balanced (a state moves when its worker has more than its share);
            # other exchanges are short: a client with a home stays there
            slack = KEEP_SLACK if action == TRAIN else math.inf
            owners = assign(clients, self.home, n, costs, slack)
            self._move(messages, enumerate(owners))
        queues = WorkQueues(owners, costs, n, self.min_items)
        return self._run(action, messages, queues)

    def _movable(self, action: str, messages: Sequence[Outgoing]) -> Callable[[int], bool]:
        """Which messages an idle worker may take from another's queue: a training client (its
        state moves with it), an evaluated client holding no state, never a state query."""
        if action == TRAIN:
            return lambda i: True
        if action == EVALUATE:
            return lambda i: messages[i].client not in self.home
        return lambda i: False

    def _run(self, action: str, messages: Sequence[Outgoing], queues: WorkQueues) -> Exchange:
        """Hand the queued messages to the workers in pieces, an idle worker stealing, until every
        message has its reply; a worker that dies fails what it had not answered."""
        actors, n = self.pool.actors, len(self.pool.actors)
        clients = [m.client for m in messages]
        movable = self._movable(action, messages)
        pace = self.pace.setdefault(action, [0.0, 0.0])  # seconds, cost
        replies: list[Reply | None] = [None] * len(messages)
        pending: dict = {}  # a call in flight -> (its worker, its messages)
        running = [0] * n
        failed: dict[int, list[int]] = {}  # a dead worker -> the messages it failed
        reasons: dict[int, str] = {}
        down = up = 0

        def submit(k: int, steal: bool = True) -> None:
            least = MIN_PIECE_SECONDS * pace[1] / pace[0] if pace[0] > 0 else 0.0
            while k not in failed and running[k] < DEPTH:
                piece = queues.piece(k, least)
                if not piece and steal and running[k] == 0:
                    taken = queues.steal(k, movable)
                    if taken is not None:
                        self._move(messages, ((i, k) for i in taken[1]))
                        piece = queues.piece(k, least)
                if not piece:
                    return
                call = actors[k].exchange.remote(action, [messages[i] for i in piece])
                pending[call] = (k, piece)
                running[k] += 1

        for k in range(n):  # every worker's own share first, then the idle steal
            submit(k, steal=False)
        for k in range(n):
            submit(k)
        while pending:
            (call,), _ = self.ray.wait(list(pending), num_returns=1)
            k, piece = pending.pop(call)
            running[k] -= 1
            try:
                exchange, lines, held, seconds = self.ray.get(call)
            except self.gone as err:
                if k not in failed:
                    failed[k], reasons[k] = queues.drop(k), _first_line(err)[:200]
                failed[k].extend(piece)
                continue
            self.pool.say(lines)
            pace[0] += seconds
            pace[1] += sum(queues.costs[i] for i in piece)
            for i, reply in zip(piece, exchange.replies, strict=True):
                replies[i] = reply
            down, up = down + exchange.bytes_down, up + exchange.bytes_up
            if action != STATE:  # a client's home: the worker holding its saved state
                kept = set(held)
                for i in piece:
                    if clients[i] in kept:
                        self.home[clients[i]] = k
                    else:
                        self.home.pop(clients[i], None)
            submit(k)
        for k, lost_messages in failed.items():
            for i in lost_messages:
                cid = clients[i]
                replies[i] = Reply(cid, f"client {cid}", error=(
                    f"failed: its worker (Ray actor {k}) died during the exchange "
                    f"({reasons[k]})"))
            held = {cid for cid, w in self.home.items() if w == k}
            for cid in held:
                del self.home[cid]
            lost = held | self.lost_in_moves  # and those that were moving out of it
            self.lost_in_moves.clear()
            self.pool.reporter.warn(
                f"Ray worker {k} died; its {len(lost_messages)} client(s) of this exchange count "
                f"as failed, {len(lost)} client(s)' saved state went with it, and a new worker "
                "takes its place for the next exchange.")
            self.pool.restart(k, self.settings)
        return Exchange(replies, down, up)  # type: ignore[arg-type]

    def _move(self, messages: Sequence[Outgoing], targets: Iterable[tuple[int, int]]) -> None:
        """For each (message index, worker) of ``targets``, move the saved state of the message's
        client to that worker from the worker holding it, worker to worker, by the workers' state
        threads (a message carrying a restored state brings its own)."""
        moves: dict[tuple[int, int], list[int]] = {}
        for i, k in targets:
            cid, old = messages[i].client, self.home.get(messages[i].client)
            if old is not None and old != k and RESTORE not in messages[i].payload.arrays:
                moves.setdefault((old, k), []).append(cid)
        actors = self.pool.actors
        for (old, new), moved in moves.items():
            states = actors[old].take.options(concurrency_group=STATE_GROUP).remote(moved)
            try:
                self.ray.get(actors[new].put.options(concurrency_group=STATE_GROUP)
                             .remote(states))
            except self.gone:
                # a worker died: the states go back where they were when that one lives (the
                # exchange then finds the dead worker and fails the clients sent to it);
                # otherwise they are lost (the clients start afresh, as the method's rule says)
                try:
                    self.ray.get(actors[old].put.options(concurrency_group=STATE_GROUP)
                                 .remote(states))
                except self.gone:
                    for cid in moved:
                        del self.home[cid]
                    self.lost_in_moves.update(moved)
                continue
            for cid in moved:
                self.home[cid] = new

    def memory_note(self) -> str | None:
        notes = [n for n in self.ray.get([a.memory_note.remote() for a in self.pool.actors]) if n]
        return "; ".join(f"worker {k}: {n}" for k, n in enumerate(notes)) if notes else None

    def close(self) -> None:
        self.ray.get([a.close.remote() for a in self.pool.actors])
        self._local.close()


@contextlib.contextmanager
def session(settings: Settings, reporter: Reporter, ray_address: str | None,
            ) -> Iterator[EngineFactory]:
    """The batched engine for a run (:data:`~pflalign.engines.base.Session`): in this process
    when ``batched-workers`` is 1 and no cluster is named, else on Ray actors (a local Ray, or the
    cluster at ``ray_address``), which are stopped when the run ends."""
    if str(settings.run.batched_workers).strip() == "1" and not ray_address:
        yield lambda s: BatchedEngine(s, reporter)
        return
    if ray_address is None:  # this machine's cores and GPUs, checked before Ray starts
        import torch

        resolve_workers(settings, {"CPU": os.cpu_count() or 1, "GPU": torch.cuda.device_count()})
    else:
        check_ray_address(ray_address)
    import ray

    started_here = not ray.is_initialized()
    pool = None
    try:
        pool = WorkerPool(settings, reporter, ray_address)
        yield lambda s: ActorEngine(s, pool)
    finally:
        if pool is not None:
            pool.close()
        if started_here:
            ray.shutdown()


register_engine("batched", session=session)
