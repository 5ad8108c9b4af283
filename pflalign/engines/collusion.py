"""Colluding attackers: the published attacks that craft one upload from all the attackers'
honest updates, and how the attackers share what they need.

The attackers of a run (``attackers`` or ``malicious-clients``, drawn from the seed) collude, as
the papers assume: each knows the others' honest updates for the round's global model. With the
attackers' honest updates ``u_1 .. u_k`` (the floating-point entries of the model they upload),
their mean ``mu`` and coordinate standard deviation ``sigma`` (over the k, ddof 0), every
sampled attacker uploads ``g + m`` for the crafted update ``m``:

- ``alie`` (Baruch et al., "A little is enough: circumventing defenses for distributed
  learning", NeurIPS 2019): ``m = mu - z sigma`` with ``s = floor(n / 2 + 1) - f`` and ``z =
  Phi^-1((n - s) / n)``, n the run's training clients and f its attackers;
- ``ipm`` (Xie et al., "Fall of empires: breaking Byzantine-tolerant SGD by inner product
  manipulation", UAI 2020): ``m = -epsilon mu``;
- ``min-max`` and ``min-sum`` (Shejwalkar and Houmansadr, "Manipulating the Byzantine: optimizing
  model poisoning attacks and defenses for federated learning", NDSS 2021, their AGR-agnostic
  attacks with the unit-vector perturbation ``p = -mu / |mu|``): ``m = mu + gamma p`` with the
  largest gamma whose largest distance to the ``u_i`` stays within the largest distance between
  two of them (min-max), or whose sum of squared distances stays within the largest such sum of
  one ``u_i`` (min-sum). The paper searches gamma by halving; both constraints are quadratic in
  gamma, so the largest gamma is solved here exactly.

Each attacker computes the others' honest updates itself, from the global model it received,
their data (in simulation every client's data is in the pool) and their state as it was before
the round: every attacker's wrapper records its state before training and after each action in
the :class:`Channel` (memory, and under the Flower engine a folder per run, since its clients run
in several processes). Training is seeded by (seed, round, client), so each is the update that
attacker computes, on every engine.
"""

from __future__ import annotations

import io
import math
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from statistics import NormalDist

import numpy as np
import torch

from pflalign.data.node import pooled_node_data
from pflalign.engines.host import handle_aside
from pflalign.engines.updates import flat_update
from pflalign.server.robust import squared_distances
from pflalign.settings.fingerprint import digest
from pflalign.settings.schema import Settings
from pflalign.wire.protocol import MODEL, ROUND, TRAIN
from pflalign.wire.state import State, atomic_write


# --- the attacks, on flat updates ---------------------------------------------------------------
def alie_z(n: int, f: int) -> float:
    """ALIE's ``z_max`` for n workers of which f are Byzantine: ``s = floor(n/2 + 1) - f``
    workers must be won over, and z is the normal quantile leaving ``s`` of them beyond it
    (Baruch et al. 2019, Algorithm 3)."""
    s = math.floor(n / 2 + 1) - f
    p = (n - s) / n
    return NormalDist().inv_cdf(min(max(p, 1e-12), 1 - 1e-12))


def alie(updates: np.ndarray, n: int, f: int) -> np.ndarray:
    """``mu - z sigma`` over the rows of ``updates`` (ddof 0)."""
    return updates.mean(axis=0) - alie_z(n, f) * updates.std(axis=0)


def ipm(updates: np.ndarray, epsilon: float) -> np.ndarray:
    """``-epsilon mu``."""
    return -epsilon * updates.mean(axis=0)


def _unit_direction(mu: np.ndarray) -> tuple[np.ndarray, float]:
    norm = float(np.linalg.norm(mu))
    return (-mu / norm, 1.0) if norm > 0 else (np.zeros_like(mu), 0.0)


def min_max_gamma(updates: np.ndarray) -> float:
    """The largest gamma with ``max_i |mu + gamma p - u_i| <= max_ij |u_i - u_j|``: per i the
    larger root of ``a g^2 + 2 b_i g + c_i = 0`` (``a = |p|^2``, ``b_i = p.(mu - u_i)``, ``c_i =
    |mu - u_i|^2 - C``), the smallest over i."""
    mu = updates.mean(axis=0)
    p, a = _unit_direction(mu)
    if a == 0 or len(updates) < 2:
        return 0.0
    limit = float(squared_distances(updates).max())
    diffs = mu - updates
    b = diffs @ p
    c = np.einsum("ij,ij->i", diffs, diffs) - limit
    roots = (-b + np.sqrt(np.maximum(b * b - a * c, 0.0))) / a
    return max(0.0, float(roots.min()))


def min_sum_gamma(updates: np.ndarray) -> float:
    """The largest gamma with ``sum_i |mu + gamma p - u_i|^2 <= max_i sum_j |u_i - u_j|^2``;
    since ``sum_i (mu - u_i) = 0`` the left side is ``S + k gamma^2 |p|^2``."""
    mu = updates.mean(axis=0)
    p, a = _unit_direction(mu)
    if a == 0 or len(updates) < 2:
        return 0.0
    limit = float(squared_distances(updates).sum(axis=1).max())
    diffs = mu - updates
    spread = float(np.einsum("ij,ij->", diffs, diffs))
    return math.sqrt(max(0.0, limit - spread) / (len(updates) * a))


def crafted(attack: str, updates: np.ndarray, settings: Settings) -> np.ndarray:
    """The update every sampled attacker uploads, from the attackers' honest ``updates``."""
    run = settings.run
    if attack == "alie":
        return alie(updates, run.num_clients, max(1, len(updates)))
    if attack == "ipm":
        return ipm(updates, run.ipm_epsilon)
    mu = updates.mean(axis=0)
    gamma = min_max_gamma(updates) if attack == "min-max" else min_sum_gamma(updates)
    return mu + gamma * _unit_direction(mu)[0]


# --- what the attackers share ------------------------------------------------------------------
class Channel:
    """The attackers' shared record of their states and updates (and, in this process, of the
    honest updates they computed for a round): in memory, and in a run's folder under its
    out-dir, which the processes of a run share (the Flower engine's clients run in several). A
    record is named (client, kind) and kept at (round, phase): a state at phase 0 before its
    client's training, 1 after it, 2 after its evaluation; the last three of each are kept."""

    def __init__(self):
        self._records: dict[tuple[Path, int, str], dict[tuple[int, int], State | None]] = {}
        self._updates: dict[tuple[Path, int], dict[int, np.ndarray]] = {}

    def clear(self, run: Path) -> None:
        """Forget a run's records (a method entry starts afresh)."""
        shutil.rmtree(run, ignore_errors=True)
        for key in [k for k in self._records if k[0] == run]:
            del self._records[key]
        for key in [k for k in self._updates if k[0] == run]:
            del self._updates[key]

    def record(self, run: Path, client: int, kind: str, server_round: int, phase: int,
               arrays: State | None) -> None:
        records = self._records.setdefault((run, client, kind), {})
        kept = None if arrays is None else {k: np.array(v, copy=True) for k, v in arrays.items()}
        records[(server_round, phase)] = kept
        for old in sorted(records)[:-3]:
            del records[old]
        path = run / f"{kind}-{client}" / f"{server_round}-{phase}.npz"
        atomic_write(path, lambda handle: np.savez(handle, **(kept or {})))
        for old in sorted(path.parent.glob("*.npz"), key=_key)[:-3]:
            old.unlink(missing_ok=True)

    def latest(self, run: Path, client: int, kind: str, server_round: int,
               phase: int = 0) -> State | None:
        """The record at (``server_round``, ``phase``), else the last one of an earlier round
        (None: none)."""
        records = dict(self._records.get((run, client, kind), {}))
        for path in (run / f"{kind}-{client}").glob("*.npz"):
            key = _key(path)
            if key not in records:
                with np.load(io.BytesIO(path.read_bytes())) as data:
                    records[key] = {k: data[k] for k in data.files} or None
        if (server_round, phase) in records:
            return records[(server_round, phase)]
        earlier = [key for key in records if key[0] < server_round]
        return records[max(earlier)] if earlier else None

    def updates(self, run: Path, server_round: int) -> dict[int, np.ndarray]:
        """The honest updates computed in this process for the round (older rounds dropped)."""
        for key in [k for k in self._updates if k[0] == run and k[1] != server_round]:
            del self._updates[key]
        return self._updates.setdefault((run, server_round), {})


def _key(path: Path) -> tuple[int, int]:
    server_round, phase = path.stem.split("-")
    return int(server_round), int(phase)


#: this process's channel
CHANNEL = Channel()
#: the attacks that use it: the colluding ones, and replay (its own last update)
CHANNEL_ATTACKS = ("alie", "ipm", "min-max", "min-sum", "replay")


def run_key(settings: Settings, label: str) -> Path:
    """A method entry's run in the channel: its folder under the run's out-dir."""
    return (Path(settings.run.out_dir).resolve() / ".collusion"
            / digest({**settings.to_dict(), "label": label})[:16])


def honest_updates(settings: Settings, colluders: Sequence[int], run: Path, config: Mapping,
                   arrays: Mapping[str, Mapping[str, torch.Tensor]], keys: Sequence[str],
                   own: tuple[int, np.ndarray]) -> np.ndarray:
    """The attackers' honest updates for this round (rows in client order): each computed once
    per process by the honest client handler from the attacker's data and its state before the
    round (``run``: the entry's :func:`run_key`)."""
    server_round = int(config[ROUND])
    known = CHANNEL.updates(run, server_round)
    known[own[0]] = own[1]
    received = arrays[MODEL]
    for client in colluders:
        if client in known:
            continue
        saved = CHANNEL.latest(run, client, "state", server_round)
        _, reply, _ = handle_aside(TRAIN, settings, client, config, arrays, saved,
                                   node=pooled_node_data(settings, client))
        known[client] = flat_update(reply[MODEL], received, keys)
    return np.stack([known[c] for c in sorted(colluders)])
