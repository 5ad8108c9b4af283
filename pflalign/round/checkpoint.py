"""Checkpoints of a method entry's run, so that a killed run continues exactly (``--resume``).

A run's state at the end of round r is small and explicit: the server state (and the one before the
latest aggregation, for a rollback), every client's method state, the finished rounds' rows, the
latest evaluation's per-client results, the clients known to keep state, each round feature's
state under its name (:mod:`pflalign.round.feature`) and the scheduler's (FedBuff's clients in
flight).
Nothing else is needed: every random draw is derived from (seed, round, client, stream)
(:mod:`pflalign.server.sampling`, :func:`pflalign.training.loops.make_generator`), so round r + 1
run in a new process is the round r + 1 of the uninterrupted run. The process-wide torch and NumPy
generators are saved and restored too, for completeness.

One file per method entry, ``<out-dir>/checkpoints/<slug of the label>.npz``, holds the arrays
(indexed ``a0``, ``a1``, ...; their group and name are listed in the metadata) and a JSON
metadata entry: the format and its version, the label, the round, a fingerprint of the entry's
settings (:func:`entry_fingerprint`), the rows and the rest. It is written atomically (a
temporary file moved into place), so a ``kill -9`` leaves the previous checkpoint or the new
one, never a partial one, and it is removed once the entry's results are in ``results.json``.
"""

from __future__ import annotations

import contextlib
import json
import zipfile
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pflalign.outputs.results import slug
from pflalign.server.validation import ClientFailure, state_problem
from pflalign.settings.fingerprint import entry_fingerprint
from pflalign.settings.options import ConfigError
from pflalign.wire.messages import Payload
from pflalign.wire.protocol import CLIENT_STATE, ID, PARTITION_ID, STATE, STATE_CHUNK
from pflalign.wire.state import State, atomic_write

CHECKPOINT_FORMAT = "pflalign-checkpoint"
FORMAT_VERSION = 2
#: keys that change nothing a run computes: left out of the fingerprints
DIRECTORY = "checkpoints"

#: array groups of a checkpoint file
SERVER, BEFORE, CLIENT, RNG, SCHEDULER = ("server", "before-aggregation", "client", "rng",
                                          "scheduler")


def checkpoint_path(out_dir: str | Path, label: str) -> Path:
    """Where the checkpoint of the method entry ``label`` of a run writing to ``out_dir`` lives."""
    return Path(out_dir) / DIRECTORY / f"{slug(label)}.npz"


@dataclass
class Snapshot:
    """Everything a federation needs to continue after round :attr:`round` (see the module
    docstring). Rows and client results are JSON-able; states are flat arrays."""

    round: int
    server: State
    #: the server state before the latest aggregation (None: none to roll back to)
    before_aggregation: State | None
    #: every client's method state, by client id (the clients that keep state)
    clients: dict[int, State]
    rounds: list[dict]
    client_results: list[dict]
    saved_state: list[int]
    #: the latest evaluation's metrics (what the final metrics are made of)
    last_eval: dict
    #: each round feature's :meth:`~pflalign.round.feature.RoundFeature.state_dict`, by name
    features: dict = field(default_factory=dict)
    #: the process-wide generators: ``torch`` (its state) and ``numpy`` (MT19937 keys)
    rng_arrays: State = field(default_factory=dict)
    #: the rest of NumPy's generator state (position, cached Gaussian)
    rng_meta: dict = field(default_factory=dict)
    #: the scheduler's state: ``mode = async``'s clients in flight and their replies (JSON
    #: metadata and arrays, :meth:`~pflalign.round.fedbuff.BufferedRounds.state_dict`)
    scheduler: dict = field(default_factory=dict)
    scheduler_arrays: State = field(default_factory=dict)
    #: per client id (a string): trainings sent and updates aggregated (RoundLoop.usage)
    usage: dict = field(default_factory=dict)


def capture_rng() -> tuple[State, dict]:
    """The process-wide torch and NumPy generator states, as arrays and JSON metadata."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return ({"torch": torch.get_rng_state().numpy().copy(), "numpy": np.asarray(keys).copy()},
            {"numpy": [str(kind), int(pos), int(has_gauss), float(cached)]})


def restore_rng(arrays: Mapping[str, np.ndarray], meta: Mapping[str, list]) -> None:
    """Set the process-wide generators to what :func:`capture_rng` returned."""
    if "torch" in arrays:
        torch.set_rng_state(torch.from_numpy(np.array(arrays["torch"], dtype=np.uint8)))
    if "numpy" in arrays and "numpy" in meta:
        kind, pos, has_gauss, cached = meta["numpy"]
        np.random.set_state((kind, np.asarray(arrays["numpy"], dtype=np.uint32), int(pos),
                             int(has_gauss), float(cached)))


class StoredStates(MutableMapping[int, State]):
    """The client states of a checkpoint file, by client id, each read from the file when it is
    asked for (a resumed run of 10,000 clients never holds them all). The file stays open while
    this lives, so a later checkpoint replacing it changes nothing read here. Deleting a client
    forgets it; :meth:`nonempty` leaves out the clients whose state has no arrays."""

    def __init__(self, archive, index: Mapping[int, list[tuple[str, str]]]):
        self._archive = archive
        self._index = dict(index)

    def __getitem__(self, client: int) -> State:
        return {name: self._archive[key] for key, name in self._index[client]}

    def __setitem__(self, client: int, state: State) -> None:
        raise TypeError("a checkpoint's client states are read-only")

    def __delitem__(self, client: int) -> None:
        del self._index[client]

    def __contains__(self, client: object) -> bool:
        return client in self._index

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._index))

    def __len__(self) -> int:
        return len(self._index)

    def nonempty(self) -> StoredStates:
        return StoredStates(self._archive, {c: k for c, k in self._index.items() if k})


def nonempty(states: Mapping[int, State]) -> MutableMapping[int, State]:
    """The clients of ``states`` whose state has arrays (read lazily from a checkpoint file)."""
    if isinstance(states, StoredStates):
        return states.nonempty()
    return {cid: state for cid, state in states.items() if state}


def _write_archive(handle, meta: dict,
                   groups: Iterable[tuple[str, int | None, Mapping[str, np.ndarray]]]) -> None:
    """An ``.npz`` archive (what :func:`numpy.load` reads, as :func:`numpy.savez` writes it) of
    the arrays of ``groups``, written one array at a time, as ``a0``, ``a1``, ...; and last the
    metadata, with each array's group, owner and name, and the clients met (``clients``)."""
    names: list[list] = []
    clients: list[int] = []
    with zipfile.ZipFile(handle, mode="w", compression=zipfile.ZIP_STORED,
                         allowZip64=True) as archive:
        def put(key: str, value: np.ndarray) -> None:
            with archive.open(f"{key}.npy", mode="w", force_zip64=True) as out:
                np.lib.format.write_array(out, np.asanyarray(value), allow_pickle=False)

        for group, owner, state in groups:
            if group == CLIENT:
                clients.append(int(owner))
            for name, value in state.items():
                put(f"a{len(names)}", value)
                names.append([group, owner, name])
        put("meta", np.array(json.dumps({**meta, "names": names, "clients": clients})))


class Checkpoint:
    """The checkpoint file of one method entry: when to write it, writing, reading, removing.

    ``every``: write after every round r with ``r % every == 0`` and ``r < rounds`` (0: never;
    an existing file is still read on resume)."""

    def __init__(self, path: str | Path, label: str, fingerprint: str, every: int, rounds: int):
        self.path = Path(path)
        self.label = label
        self.fingerprint = fingerprint
        self.every = int(every)
        self.rounds = int(rounds)

    @classmethod
    def for_entry(cls, out_dir: str | Path, label: str, settings: Mapping[str, object],
                  ) -> Checkpoint:
        """The checkpoint of entry ``label`` run with ``settings`` (its own, overrides applied)."""
        return cls(checkpoint_path(out_dir, label), label, entry_fingerprint(settings, label),
                   int(settings["checkpoint-every"]), int(settings["rounds"]))

    def due(self, server_round: int) -> bool:
        """Whether a checkpoint is written after ``server_round``."""
        return self.every > 0 and server_round % self.every == 0 and server_round < self.rounds

    def write(self, snapshot: Snapshot,
              clients: Iterable[tuple[int, State]] | None = None) -> Path:
        """Write ``snapshot`` atomically, replacing the previous checkpoint. ``clients`` (in
        place of ``snapshot.clients``): the clients' states as ``(id, state)`` pairs, each
        written into the file as it comes, so that no more than one is held here at a time; an
        exception raised by it leaves the previous checkpoint as it was."""
        def groups() -> Iterator[tuple[str, int | None, Mapping[str, np.ndarray]]]:
            yield SERVER, None, snapshot.server
            if snapshot.before_aggregation is not None:
                yield BEFORE, None, snapshot.before_aggregation
            pairs = (sorted(snapshot.clients.items()) if clients is None else clients)
            for cid, state in pairs:
                yield CLIENT, int(cid), state
            yield RNG, None, snapshot.rng_arrays
            if snapshot.scheduler_arrays:
                yield SCHEDULER, None, snapshot.scheduler_arrays

        meta = {"format": CHECKPOINT_FORMAT, "version": FORMAT_VERSION, "label": self.label,
                "fingerprint": self.fingerprint, "round": snapshot.round,
                "has-before-aggregation": snapshot.before_aggregation is not None,
                "rounds": snapshot.rounds, "client-results": snapshot.client_results,
                "saved-state": sorted(snapshot.saved_state), "last-eval": snapshot.last_eval,
                "features": snapshot.features, "rng": snapshot.rng_meta,
                "scheduler": snapshot.scheduler, "usage": snapshot.usage}
        atomic_write(self.path, lambda handle: _write_archive(handle, meta, groups()))
        return self.path

    def read(self) -> Snapshot | None:
        """The checkpoint's snapshot (None when there is no file); a
        :class:`~pflalign.settings.options.ConfigError` for a file that cannot be read or was
        written for another entry or config."""
        if not self.path.exists():
            return None
        try:
            archive = np.load(self.path, allow_pickle=False)  # kept open by the client states
            meta = json.loads(str(archive["meta"]))
            names = meta["names"]
            # every array read once (a damaged file fails here, not later in the run); only
            # the server's and the generators' are kept: a client's is read again when needed
            loaded = {}
            for i, (group, _, _) in enumerate(names):
                value = archive[f"a{i}"]
                if group != CLIENT:
                    loaded[i] = value
        except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as err:
            raise ConfigError(f"The checkpoint '{self.path}' cannot be read ({err}); remove it "
                              f"to run '{self.label}' from round 1.") from err
        if meta.get("format") != CHECKPOINT_FORMAT or meta.get("version") != FORMAT_VERSION:
            raise ConfigError(f"'{self.path}' is not a checkpoint of this version of pflalign "
                              f"(format {meta.get('format')!r}, version {meta.get('version')!r}); "
                              f"remove it to run '{self.label}' from round 1.")
        if meta.get("label") != self.label or meta.get("fingerprint") != self.fingerprint:
            raise ConfigError(f"The checkpoint '{self.path}' was written by a run of "
                              f"'{meta.get('label')}' with another config; resume with the config "
                              f"it was written with, or remove it to run '{self.label}' from "
                              "round 1.")
        groups: dict[tuple[str, int | None], State] = {}
        index: dict[int, list[tuple[str, str]]] = {int(cid): [] for cid in meta["clients"]}
        for i, (group, owner, name) in enumerate(names):
            if group == CLIENT:
                index[int(owner)].append((f"a{i}", name))
            else:
                groups.setdefault((group, owner), {})[name] = loaded[i]
        before = groups.get((BEFORE, None), {}) if meta["has-before-aggregation"] else None
        return Snapshot(
            round=int(meta["round"]), server=groups.get((SERVER, None), {}),
            before_aggregation=before, clients=StoredStates(archive, index),
            rounds=meta["rounds"], client_results=meta["client-results"],
            saved_state=[int(c) for c in meta["saved-state"]], last_eval=meta["last-eval"],
            features=meta["features"], rng_arrays=groups.get((RNG, None), {}),
            rng_meta=meta["rng"], scheduler=meta["scheduler"], usage=meta["usage"],
            scheduler_arrays=groups.get((SCHEDULER, None), {}))

    def remove(self) -> None:
        """Remove the checkpoint (and temporary files a killed write left beside it), and the
        checkpoints folder when nothing else is in it."""
        for path in (self.path, *self.path.parent.glob(f".{self.path.name}.*.tmp")):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()  # only when empty


# --- a round loop's checkpoints -----------------------------------------------------------------
class _NoCheckpoint(Exception):
    """A client's state cannot be had: no checkpoint is written this time (the message says
    why)."""


def write_checkpoint(loop, checkpoint: Checkpoint, server_round: int,
                     last_eval: Mapping[str, float]) -> None:
    """Write ``loop``'s state after ``server_round`` to ``checkpoint``; when a client's state
    cannot be had (or a feature or the scheduler says none may be written), warn and keep
    the previous checkpoint, which is still a consistent earlier point of the run."""
    refusal = next((why for why in (
        *(f.checkpoint_refusal(loop, server_round) for f in loop.features),
        loop.scheduler.checkpoint_refusal(server_round)) if why), None)
    if refusal:
        if server_round == checkpoint.every:  # said once
            loop.warn(refusal)
        return
    loop.scheduler.before_evaluation()  # replies in flight are kept, never messages
    scheduler, scheduler_arrays = loop.scheduler.state_dict()
    rng_arrays, rng_meta = capture_rng()
    snapshot = Snapshot(
        round=server_round, server=loop.state.to_arrays(),
        before_aggregation=(None if loop.before_aggregation is None
                            else loop.before_aggregation.to_arrays()),
        clients={}, rounds=loop.rounds, client_results=loop.client_results,
        saved_state=sorted(loop.messaging.saved_state), last_eval=dict(last_eval),
        features={f.name: f.state_dict() for f in loop.features},
        usage={str(cid): counts for cid, counts in loop.usage.items()},
        rng_arrays=rng_arrays, rng_meta=rng_meta, scheduler=scheduler,
        scheduler_arrays=scheduler_arrays)
    try:
        checkpoint.write(snapshot, client_states(loop, server_round))
    except _NoCheckpoint as reason:
        loop.warn(f"no checkpoint after round {server_round}: {reason}.")

def client_states(loop, server_round: int) -> Iterator[tuple[int, State]]:
    """The method state of every client that keeps one, in client order, as ``(id, state)``
    pairs: a state still to be restored as it is, the others asked of the clients
    :data:`STATE_CHUNK` at a time (a :data:`~pflalign.wire.protocol.STATE` exchange, which
    no round's bytes count), so that a checkpoint never holds every client's state at once.
    :class:`_NoCheckpoint` when a client does not give it."""
    messaging = loop.messaging
    order = sorted(messaging.saved_state)
    for start in range(0, len(order), STATE_CHUNK):
        chunk = order[start:start + STATE_CHUNK]
        ask = [cid for cid in chunk if cid not in messaging.pending_restore]
        states: dict[int, State] = {}
        if ask:
            exchange = messaging.exchange(STATE, [messaging.message(cid, Payload(), server_round)
                                                  for cid in ask])
            for reply in exchange.replies:
                try:
                    messaging.validator.validate(reply, {}, {PARTITION_ID: ID}, (CLIENT_STATE,))
                except ClientFailure as failure:
                    raise _NoCheckpoint(str(failure)) from None
                state = dict(reply.arrays.get(CLIENT_STATE, {}))
                problem = state_problem(loop.method.ClientState, state, loop.server.initial)
                if problem:
                    raise _NoCheckpoint(f"{reply.who}'s saved state was rejected: {problem}")
                states[reply.sender] = state
            missing = sorted(set(ask) - set(states))
            if missing:
                raise _NoCheckpoint(f"clients {missing} did not give their state")
        for cid in chunk:
            yield cid, (messaging.pending_restore[cid] if cid in messaging.pending_restore
                        else states.pop(cid))


def restore(loop, snapshot: Snapshot) -> dict[str, float]:
    """Continue from ``snapshot``: the server state, rows, client results, features and
    scheduler as they were after its round, each client's state pending until that client's
    next message. Returns the latest evaluation's metrics."""
    names = sorted(f.name for f in loop.features)
    if sorted(snapshot.features) != names:
        raise ConfigError(f"The checkpoint of '{loop.label}' holds the state of the round "
                          f"features {sorted(snapshot.features)}, this run has {names}; "
                          f"remove it to run '{loop.label}' from round 1.")
    for feature in loop.features:
        feature.load_state_dict(snapshot.features[feature.name])
    loop.state = loop.method.ServerState.from_arrays(snapshot.server)
    loop.before_aggregation = (None if snapshot.before_aggregation is None else
                               loop.method.ServerState.from_arrays(
                                   snapshot.before_aggregation))
    loop.rounds = list(snapshot.rounds)
    loop.client_results = list(snapshot.client_results)
    loop.messaging.saved_state = set(snapshot.saved_state)
    loop.usage = {int(cid): list(counts) for cid, counts in snapshot.usage.items()}
    loop.messaging.pending_restore = nonempty(snapshot.clients)  # each read when it is sent
    restore_rng(snapshot.rng_arrays, snapshot.rng_meta)
    loop.scheduler.load_state_dict(snapshot.scheduler, snapshot.scheduler_arrays)
    return dict(snapshot.last_eval)
