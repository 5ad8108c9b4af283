"""Explicit method state: dataclasses of tensors and scalars that flatten to ``dict[str, ndarray]``.

A method's :class:`ClientState` (what one client keeps between rounds: a personal model, control
variates, optimizer moments) and :class:`ServerState` (the global model and whatever else the
server keeps) are plain dataclasses. :meth:`ArrayState.to_arrays` packs one into a flat
``{name: ndarray}`` and :meth:`ArrayState.from_arrays` rebuilds it (values, dtypes and shapes
exact), so saving, resuming and shipping state is one call whatever the engine.

The field kinds and their flat names:

- a state dict (``dict[str, tensor]``): ``field/key`` for every entry;
- a per-client state dict (``dict[int, dict[str, tensor]]``): ``field/#client/key``;
- one tensor or array: ``field``;
- a scalar (``int``, ``float``, ``bool``): ``field`` as a 0-d array (read back as the Python type);
- a set of client ids (``frozenset[int]``): ``field`` as a 1-d int64 array;
- ``None``: absent. An empty state dict is absent too, so it comes back as ``None``; and a
  state dict's own keys may not start with ``#``, which marks a client id.

Client states hold ``torch.Tensor`` values (client rules compute in torch), server states NumPy
arrays (server rules aggregate in NumPy); :attr:`ArrayState.holds_tensors` says which.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, ClassVar, Self

import numpy as np
import torch

from pflalign.process.caches import cached

#: a model state or a saved state as NumPy arrays (a state dict's entries, or flat named arrays)
State = dict[str, np.ndarray]
#: the same in torch tensors (what client rules compute with)
TorchState = dict[str, torch.Tensor]

_SEP = "/"


def state_key(entry: str, field: str) -> str:
    """The flat-state key of one entry's ``field`` in an optimizer's persistent state
    (``<entry>.<field>``, e.g. ``conv1.weight.v``): the one place the format is written."""
    return f"{entry}.{field}"


def _to_numpy(value: object) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    return np.array(value, copy=True)


class ArrayState:
    """Mixin for a state dataclass: :meth:`to_arrays` / :meth:`from_arrays`."""

    #: values are torch tensors (client states) rather than NumPy arrays (server states)
    holds_tensors: ClassVar[bool] = True

    def to_arrays(self) -> State:
        """The state as one flat ``{name: ndarray}`` (copies; ``None`` fields are left out)."""
        out: State = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, frozenset | set):
                out[f.name] = np.array(sorted(value), dtype=np.int64)
            elif isinstance(value, Mapping):
                for key, item in value.items():
                    if isinstance(item, Mapping):
                        for inner, array in item.items():
                            out[f"{f.name}{_SEP}#{int(key)}{_SEP}{inner}"] = _to_numpy(array)
                    else:
                        out[f"{f.name}{_SEP}{key}"] = _to_numpy(item)
            else:
                out[f.name] = _to_numpy(value)
        return out

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> Self:
        """Rebuild a state from :meth:`to_arrays`' output (unknown names are an error)."""
        hints = _type_hints(cls)
        values: dict[str, object] = {}
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        convert = (lambda a: torch.from_numpy(np.array(a, copy=True))) if cls.holds_tensors else (
            lambda a: np.array(a, copy=True))
        for name, array in arrays.items():
            field_name, sep, rest = name.partition(_SEP)
            if field_name not in names:
                raise ValueError(f"{cls.__qualname__} has no field '{field_name}' (array "
                                 f"'{name}').")
            if not sep:
                values[field_name] = _scalar_or_array(hints[field_name], array, convert)
            elif rest.startswith("#"):
                client, _, key = rest[1:].partition(_SEP)
                per_client = values.setdefault(field_name, {})
                per_client.setdefault(int(client), {})[key] = convert(array)  # type: ignore[union-attr]
            else:
                values.setdefault(field_name, {})[rest] = convert(array)  # type: ignore[index]
        return cls(**values)


@cached(maxsize=None)
def _type_hints(cls: type) -> dict[str, object]:
    """A state class's resolved field types (resolving them compiles every annotation)."""
    return typing.get_type_hints(cls)


def _scalar_or_array(hint: object, array: np.ndarray, convert: typing.Callable) -> object:
    kinds = set(typing.get_args(hint)) | {hint}
    if frozenset[int] in kinds or any(typing.get_origin(k) is frozenset for k in kinds):
        return frozenset(int(v) for v in np.asarray(array).reshape(-1))
    for kind in (bool, int, float):
        if kind in kinds:
            return kind(np.asarray(array).item())
    return convert(array)


@dataclasses.dataclass
class NoClientState(ArrayState):
    """A method whose clients keep nothing between rounds (FedAvg)."""


@dataclasses.dataclass
class ServerState(ArrayState):
    """What every server keeps: the global model (NumPy arrays, all entries, buffers included).

    Methods with more server state subclass it."""

    holds_tensors: ClassVar[bool] = False

    model: State = dataclasses.field(default_factory=dict)


@cached(maxsize=1)
def _umask() -> int:
    """The process's umask, read without changing it (Linux; else the usual 022)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write(handle)`` on a temporary file beside ``path``, then move it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # as open() would create it (mkstemp makes it 0600)
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
