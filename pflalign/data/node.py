"""A node's own data and state on its own disk: partition files, the partition cache, state files.

In a real deployment each SuperNode holds one client. This module is what such a node keeps on
disk, so that it needs neither the pooled dataset nor its memory between messages:

- a **partition file** (``client-<i>.npz``, written by ``python -m
  pflalign.run.export_partitions``): one client's train and test images and labels exactly as the
  pooled path gives them (rotated for ``partition = rotated``), with a metadata entry: the dataset,
  its classes, input shape and normalisation, the client id, whether it is unseen, and the
  fingerprint of the config keys that define the data (:func:`data_fingerprint`), so a node refuses
  a file made for another config;
- the **partition cache**: the same file, written on a node's first message when it was given
  no partition file, so that later messages (a new process each, under Flower's default
  subprocess isolation) read only their own split instead of re-reading and re-partitioning the
  whole dataset;
- a **state file** per run and method entry (:class:`StateStore`): the client's method state as
  the flat arrays :meth:`~pflalign.wire.state.ArrayState.to_arrays` gives, written atomically after
  every training action, so that a restarted node resumes exactly where it stopped.

Every file is written to a temporary name in its directory and moved into place with
:func:`os.replace`, so a reader sees the old file or the new one, never a partial one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pflalign.data.datasets import ClientData, input_transform
from pflalign.data.federated import federated_dataset
from pflalign.data.image_arrays import cache_root
from pflalign.process.caches import cached
from pflalign.settings.fingerprint import digest
from pflalign.settings.options import ConfigError
from pflalign.settings.schema import DATA_KEYS, DATA_LOCATION_KEYS, IMAGE, NON_RUN_KEYS
from pflalign.wire.protocol import NUM_TEST, NUM_TRAIN, PARTITION_ID, UNSEEN
from pflalign.wire.state import State, atomic_write

PARTITION_FORMAT = "pflalign-partition"
STATE_FORMAT = "pflalign-state"
FORMAT_VERSION = 1
_SPLITS = ("train_x", "train_y", "test_x", "test_y")


def data_fingerprint(settings: Mapping[str, object]) -> str:
    """A short hash of the config keys that define every client's data (the keys of
    :data:`~pflalign.settings.schema.DATA_KEYS` except where the files are read from)."""
    return digest({k: settings[k] for k in DATA_KEYS if k not in DATA_LOCATION_KEYS})[:16]


@dataclass(frozen=True)
class NodeData:
    """One client's data as its node holds it: the splits, and what a model needs to know."""

    client_id: int
    data: ClientData
    num_classes: int
    input_shape: tuple[int, ...]
    unseen: bool
    #: the run's clients (num-clients + num-unseen-clients)
    num_clients: int
    #: how a batch becomes the model's input: the samples' kind and the images' mean and std
    #: (what a saved model's manifest records, :mod:`pflalign.outputs.models`)
    inputs: dict = field(default_factory=dict, hash=False, compare=False)

    def discovery(self) -> dict[str, int]:
        """The client's answer to discovery: its stable id and split sizes."""
        return {PARTITION_ID: self.client_id, NUM_TRAIN: self.data.num_train,
                NUM_TEST: self.data.num_test, UNSEEN: int(self.unseen)}


def pooled_node_data(settings: Mapping[str, object], client_id: int,
                     device: torch.device | str = "cpu") -> NodeData:
    """Client ``client_id``'s data from the pooled dataset and its partition (cached per
    process; the path every simulation takes)."""
    federation = federated_dataset(settings)
    data = federation.client_data(client_id, device)
    return NodeData(client_id=client_id, data=data, num_classes=federation.dataset.num_classes,
                    input_shape=federation.dataset.input_shape,
                    unseen=federation.partition.is_unseen(client_id),
                    num_clients=federation.partition.num_clients,
                    inputs={"kind": federation.dataset.kind,
                            "mean": list(federation.dataset.mean or ()),
                            "std": list(federation.dataset.std or ())})


# --- partition files ---------------------------------------------------------------------------
def partition_metadata(settings: Mapping[str, object], node: NodeData) -> dict:
    """What a partition file says about itself (see the module docstring)."""
    federation = federated_dataset(settings)
    dataset = federation.dataset
    return {"format": PARTITION_FORMAT, "version": FORMAT_VERSION, "dataset": dataset.name,
            "num-classes": node.num_classes, "input-shape": list(node.input_shape),
            "mean": list(dataset.mean), "std": list(dataset.std), "kind": dataset.kind,
            "client-id": node.client_id,
            "num-clients": node.num_clients,
            "num-train-clients": federation.partition.num_train_clients,
            "unseen": node.unseen, "rotation": federation.partition.rotation(node.client_id),
            "num-train": node.data.num_train, "num-test": node.data.num_test,
            "strides": {k: list(getattr(node.data, k).stride()) for k in _SPLITS},
            "fingerprint": data_fingerprint(settings),
            "data-config": {k: settings[k] for k in DATA_KEYS if k not in DATA_LOCATION_KEYS},
            **({"masked-targets": True} if node.data.masked_targets else {})}


def write_partition(path: Path, node: NodeData, metadata: Mapping[str, object]) -> Path:
    """Write one client's partition file atomically; return its path."""
    data = node.data.to("cpu")
    arrays = {"train_x": data.train_x, "train_y": data.train_y, "test_x": data.test_x,
              "test_y": data.test_y}
    arrays = {k: np.ascontiguousarray(v.numpy()) for k, v in arrays.items()}
    meta = np.array(json.dumps(dict(metadata), sort_keys=True))
    atomic_write(Path(path), lambda handle: np.savez(handle, meta=meta, **arrays))
    return Path(path)


def export_partitions(settings: Mapping[str, object], out_dir: str | Path,
                      clients: list[int] | None = None) -> list[Path]:
    """Write ``out_dir/client-<i>.npz`` for every client of the run (or for ``clients``)."""
    federation = federated_dataset(settings)
    wanted = list(range(federation.partition.num_clients)) if clients is None else clients
    paths = []
    for cid in wanted:
        if not 0 <= cid < federation.partition.num_clients:
            raise ConfigError(f"Client {cid} is outside this run's clients "
                              f"0..{federation.partition.num_clients - 1}.")
        node = pooled_node_data(settings, cid)
        paths.append(write_partition(Path(out_dir) / f"client-{cid}.npz", node,
                                     partition_metadata(settings, node)))
    return paths


def read_metadata(path: str | Path) -> dict:
    """A partition file's metadata (reads only that entry of the file)."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as archive:
            meta = json.loads(str(archive["meta"]))
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
        raise ConfigError(f"'{path}' is not a readable pflalign partition file ({err}); write "
                          "it with `python -m pflalign.run.export_partitions`.") from err
    if meta.get("format") != PARTITION_FORMAT or meta.get("version") != FORMAT_VERSION:
        raise ConfigError(f"'{path}' is not a pflalign partition file of version "
                          f"{FORMAT_VERSION}; write it again with `python -m "
                          "pflalign.run.export_partitions`.")
    return meta


def _with_strides(tensor: torch.Tensor, strides: list[int] | None) -> torch.Tensor:
    """``tensor`` with the strides the pooled path gave it, where they differ only in
    dimensions of size 1 (same memory, same values). They matter: a 1-channel N x 1 x H x W
    batch whose channel stride is 1 also reads as channels-last, and convolutions then take
    another kernel, with other rounding."""
    if strides is None or len(strides) != tensor.dim():
        return tensor
    if any(size > 1 and want != have for size, want, have
           in zip(tensor.shape, strides, tensor.stride(), strict=True)):
        return tensor
    return tensor.as_strided(tensor.shape, tuple(strides))


@cached(maxsize=4)
def _load_partition(path: str, mtime_ns: int, size: int) -> tuple[dict, NodeData]:
    meta = read_metadata(path)
    with np.load(path, allow_pickle=False) as archive:
        arrays = {k: _with_strides(torch.from_numpy(archive[k]), meta.get("strides", {}).get(k))
                  for k in _SPLITS}
    data = ClientData(arrays["train_x"], arrays["train_y"], arrays["test_x"], arrays["test_y"],
                      input_transform(str(meta.get("kind", IMAGE)), tuple(meta["mean"]),
                                      tuple(meta["std"])),
                      bool(meta.get("masked-targets", False)))
    node = NodeData(client_id=int(meta["client-id"]), data=data,
                    num_classes=int(meta["num-classes"]),
                    input_shape=tuple(int(d) for d in meta["input-shape"]),  # type: ignore[arg-type]
                    unseen=bool(meta["unseen"]), num_clients=int(meta["num-clients"]),
                    inputs={"kind": str(meta.get("kind", IMAGE)), "mean": list(meta["mean"]),
                            "std": list(meta["std"])})
    return meta, node


def load_partition(path: str | Path) -> tuple[dict, NodeData]:
    """A partition file's metadata and data (on the CPU), cached per process by the file's
    path, modification time and size (a replaced file is read again)."""
    path = Path(path).expanduser().resolve()
    try:
        stat = path.stat()
    except OSError as err:
        raise ConfigError(f"The node's data-path '{path}' cannot be read ({err}); export it "
                          "with `python -m pflalign.run.export_partitions` and copy it "
                          "there.") from err
    return _load_partition(str(path), stat.st_mtime_ns, stat.st_size)


def check_partition(meta: Mapping[str, object], path: str | Path,
                    settings: Mapping[str, object], client_id: int) -> None:
    """Refuse a partition file made for another config or another client."""
    expected = data_fingerprint(settings)
    if meta["fingerprint"] != expected:
        theirs = dict(meta.get("data-config", {}))  # type: ignore[call-overload]
        differ = [k for k in DATA_KEYS
                  if k not in DATA_LOCATION_KEYS and theirs.get(k) != settings[k]]
        detail = ", ".join(f"{k} = {theirs.get(k)!r} in the file, {settings[k]!r} in the run"
                           for k in differ) or "different data keys"
        raise ConfigError(f"The partition file '{path}' was made for another data config "
                          f"({detail}); export it again with this run's config.")
    if int(meta["client-id"]) != client_id:  # type: ignore[call-overload]
        raise ConfigError(f"The partition file '{path}' holds client {meta['client-id']}, but this "
                          f"node's partition-id is {client_id}; give each node its own file.")


def node_data_from_file(path: str | Path, settings: Mapping[str, object],
                        client_id: int) -> NodeData:
    """The node's data from its own partition file, checked against the run and the node."""
    meta, node = load_partition(path)
    check_partition(meta, path, settings, client_id)
    return node


# --- the partition cache -----------------------------------------------------------------------
def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/pflalign`` (``~/.cache/pflalign`` when unset)."""
    return cache_root()


def cached_node_data(settings: Mapping[str, object], client_id: int,
                     cache_dir: str | Path) -> NodeData:
    """The node's data from its cached partition file; on a miss, from the pooled dataset,
    written to the cache (``cache_dir/partitions/<fingerprint>/client-<i>.npz``) for the next
    process."""
    path = Path(cache_dir) / "partitions" / data_fingerprint(settings) / f"client-{client_id}.npz"
    if path.exists():
        try:
            return node_data_from_file(path, settings, client_id)
        except ConfigError:
            pass  # a damaged or foreign file: rebuild it below
    node = pooled_node_data(settings, client_id)
    try:
        write_partition(path, node, partition_metadata(settings, node))
    except OSError:
        pass  # an unwritable cache costs speed, not correctness
    return node


# --- state files -------------------------------------------------------------------------------
def run_key(settings: Mapping[str, object]) -> str:
    """A hash of the run's settings, except those that change no client's computation."""
    return digest({k: v for k, v in settings.items() if k not in NON_RUN_KEYS})[:16]


class StateStore:
    """One client's method state for one run and method entry, in ``state_dir``.

    The file is named by the client and a hash of (the Flower run id, the entry's label,
    :func:`run_key`), so a new run, or a run with another config, never picks up stale state,
    nodes sharing a directory never read each other's, and a restarted node of the same run finds
    exactly what it saved. Saving removes this client's other state files (earlier entries and
    runs), as the ClientApp drops earlier entries from ``context.state``.
    """

    PREFIX = "state-"

    def __init__(self, state_dir: str | Path, run_id: int, label: str,
                 settings: Mapping[str, object], client_id: int):
        self.dir = Path(state_dir).expanduser()
        self.run_id, self.label, self.run_key = int(run_id), label, run_key(settings)
        self.client_id = int(client_id)
        key = digest([self.run_id, label, self.run_key, self.client_id])[:20]
        self.own = f"{self.PREFIX}client{self.client_id}-"
        self.path = self.dir / f"{self.own}{key}.npz"

    def load(self) -> tuple[State, dict] | None:
        """The saved state and its metadata, or None when there is none."""
        if not self.path.exists():
            return None
        try:
            with np.load(self.path, allow_pickle=False) as archive:
                meta = json.loads(str(archive["meta"]))
                names = meta["names"]
                arrays = {name: archive[f"a{i}"] for i, name in enumerate(names)}
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
            raise RuntimeError(f"The state file '{self.path}' cannot be read ({err}); remove "
                               "it to start this client's state afresh.") from err
        if (meta.get("format") != STATE_FORMAT or meta.get("run-id") != self.run_id
                or meta.get("label") != self.label or meta.get("run-key") != self.run_key
                or meta.get("client") != self.client_id):
            return None
        return arrays, meta

    def save(self, arrays: State, server_round: int) -> Path:
        """Write the state atomically, then remove this directory's other state files."""
        names = list(arrays)
        meta = {"format": STATE_FORMAT, "version": FORMAT_VERSION, "run-id": self.run_id,
                "client": self.client_id, "label": self.label, "run-key": self.run_key,
                "round": int(server_round),
                "saved-at": time.time(), "names": names}
        payload = {f"a{i}": np.asarray(arrays[name]) for i, name in enumerate(names)}
        atomic_write(self.path, lambda handle: np.savez(
            handle, meta=np.array(json.dumps(meta, sort_keys=True)), **payload))
        for other in self.dir.glob(f"{self.own}*.npz"):
            if other != self.path:
                with contextlib.suppress(OSError):
                    other.unlink()
        return self.path


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes (to name a state file in logs)."""
    hasher = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            hasher.update(block)
    return hasher.hexdigest()
