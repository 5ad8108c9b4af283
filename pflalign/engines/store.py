"""Client state kept in memory up to a budget, and spilled to memory-mapped files beyond it.

The in-process engines (sequential, batched) keep every client's saved state (its
:meth:`~pflalign.wire.state.ArrayState.to_arrays`: pFLAlign's Delta, v and P, Ditto's personal
model, SCAFFOLD's c_i, ...) in a :class:`ClientStateStore`. States are held in memory, most recently
used last; when the bytes held exceed ``memory-budget-gb``, the least recently used ones are written
to one directory per client (one ``.npy`` file per array) and dropped from memory. A spilled state
is read back memory-mapped (:func:`numpy.load` with ``mmap_mode="r"``): only the pages a client's
rule touches are read, and the rule copies what it keeps (``from_arrays`` copies). A client's new
state replaces its file. Nothing is lost or changed by spilling: a run gives the same metrics under
any budget (a test checks it). The store may be used from two threads at once (a Ray worker hands
states over while it trains other clients): every access holds its lock.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator, MutableMapping
from pathlib import Path

import numpy as np

from pflalign.wire.state import State


def arrays_bytes(arrays: State) -> int:
    return sum(np.asarray(a).nbytes for a in arrays.values())


class ClientStateStore(MutableMapping[int, State]):
    """``client id -> saved state``, at most ``budget_bytes`` of it in memory (0: no cap); the
    rest in files under a private directory made in ``spill_root`` on the first spill, and
    removed with the store."""

    def __init__(self, budget_bytes: int, spill_root: str | Path | None = None):
        self.budget = int(budget_bytes)
        self.spill_root = Path(spill_root) if spill_root is not None else None
        self._memory: OrderedDict[int, State] = OrderedDict()
        self._sizes: dict[int, int] = {}
        self._disk: dict[int, Path] = {}
        self._dir: Path | None = None
        self.resident = 0
        #: bytes and states written to disk over the store's life, and its peak resident bytes
        self.spilled_bytes = 0
        self.spills = 0
        self.peak_resident = 0
        self._lock = threading.RLock()

    # --- mapping ---------------------------------------------------------------------------
    def __getitem__(self, client: int) -> State:
        with self._lock:
            if client in self._memory:
                self._memory.move_to_end(client)
                return self._memory[client]
            if client in self._disk:
                folder = self._disk[client]
                names = (folder / "names.txt").read_text().splitlines()
                return {name: np.load(folder / f"{k}.npy", mmap_mode="r")
                        for k, name in enumerate(names)}
        raise KeyError(client)

    def __setitem__(self, client: int, arrays: State) -> None:
        with self._lock:
            self._drop(client)
            size = arrays_bytes(arrays)
            self._memory[client] = arrays
            self._sizes[client] = size
            self.resident += size
            self._enforce()
            self.peak_resident = max(self.peak_resident, self.resident)

    def __delitem__(self, client: int) -> None:
        with self._lock:
            if client not in self:
                raise KeyError(client)
            self._drop(client)

    def __contains__(self, client: object) -> bool:
        with self._lock:
            return client in self._memory or client in self._disk

    def __iter__(self) -> Iterator[int]:
        with self._lock:
            clients = [*self._memory, *(c for c in self._disk if c not in self._memory)]
        yield from clients

    def __len__(self) -> int:
        with self._lock:
            return len(self._memory) + len(self._disk)

    def take(self, clients: Iterable[int]) -> dict[int, State]:
        """The states of those of ``clients`` held here, as copies, and removed from the store
        in one step (another thread sees each state either here or gone)."""
        out = {}
        with self._lock:
            for client in clients:
                if client in self:
                    out[client] = {k: np.array(v) for k, v in self[client].items()}
                    self._drop(client)
        return out

    # --- spilling --------------------------------------------------------------------------
    @property
    def on_disk(self) -> int:
        """Clients whose state is in files now."""
        return len(self._disk)

    def _drop(self, client: int) -> None:
        if client in self._memory:
            del self._memory[client]
            self.resident -= self._sizes.pop(client)
        folder = self._disk.pop(client, None)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    def _enforce(self) -> None:
        if self.budget <= 0:
            return
        while self.resident > self.budget and self._memory:
            client, arrays = self._memory.popitem(last=False)
            self.resident -= self._sizes.pop(client)
            self._spill(client, arrays)

    def _spill(self, client: int, arrays: State) -> None:
        if self._dir is None:
            root = self.spill_root or Path(tempfile.gettempdir())
            root.mkdir(parents=True, exist_ok=True)
            self._dir = Path(tempfile.mkdtemp(prefix=".client-state-", dir=root))
            weakref.finalize(self, shutil.rmtree, str(self._dir), True)
        folder = self._dir / str(client)
        folder.mkdir()
        for k, array in enumerate(arrays.values()):
            np.save(folder / f"{k}.npy", np.asarray(array), allow_pickle=False)
        (folder / "names.txt").write_text("\n".join(arrays))
        self._disk[client] = folder
        self.spilled_bytes += arrays_bytes(arrays)
        self.spills += 1

    def describe(self) -> str | None:
        """One line on what was spilled (None when nothing was)."""
        if not self.spills:
            return None
        return (f"client state over memory-budget-gb = {self.budget / 1e9:g}: "
                f"{self.spills} states ({self.spilled_bytes / 1e6:.0f} MB) written to "
                f"{self._dir}, {self.on_disk} clients' state there at the end; peak in memory "
                f"{self.peak_resident / 1e6:.0f} MB")

    def close(self) -> None:
        """Remove the spill files now (also done when the store is collected)."""
        with self._lock:
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
            self._disk.clear()
