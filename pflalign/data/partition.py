"""Splitting a labelled dataset across federated clients, deterministically from a seed.

Four partitioners, each returning one index array per client (every sample assigned exactly once):

* :func:`iid_partition` -- uniform random split.
* :func:`dirichlet_partition` -- label skew: for every class, the clients' shares are drawn from
  ``Dir(alpha)`` (as in NIID-Bench and PFLlib, including their rule that a client already holding
  its fair share ``N / K`` receives no more).
* :func:`pathological_partition` -- each client holds exactly ``classes_per_client`` classes, each
  class split into equal shards among its holders (McMahan et al.; PFLlib's "pat").
* :func:`quantity_partition` -- IID labels, power-law client sizes.
* :func:`rotated_partition` -- domain shift: client groups whose images are rotated by the group's
  angle, Dirichlet label skew within a group, held-out groups for the unseen clients.
* :func:`natural_partition` -- the dataset's own clients (Shakespeare's roles): a seeded subset
  of those with at least ``min_samples`` samples.
* ``flwr:<Partitioner>`` -- one of flwr-datasets' partitioners by its class name
  (:mod:`pflalign.data.flwr_partitioners`).

Each client's samples are then split into its own train and test parts, stratified by label, so its
test labels follow its train labels (:func:`split_train_test`); in the natural partition, in time
order instead: the first part of a client's samples trains, the rest tests (as LEAF splits
Shakespeare), so that no test text comes before training text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pflalign.settings.options import ConfigError

DIRICHLET_TRIES = 10


def _check_capacity(num_samples: int, num_clients: int, min_samples: int) -> None:
    if num_clients * min_samples > num_samples:
        raise ConfigError(
            f"{num_clients} clients with at least {min_samples} samples each need "
            f"{num_clients * min_samples} samples, but the dataset has {num_samples}; lower "
            "num-clients (+ num-unseen-clients) or min-samples-per-client.")


def iid_partition(labels: np.ndarray, num_clients: int, rng: np.random.Generator,
                  min_samples: int = 1) -> list[np.ndarray]:
    """Shuffle all indices and cut them into ``num_clients`` parts whose sizes differ by <= 1."""
    _check_capacity(len(labels), num_clients, min_samples)
    return [np.sort(part) for part in np.array_split(rng.permutation(len(labels)), num_clients)]


def _top_up_small_clients(parts: list[np.ndarray], min_samples: int,
                          rng: np.random.Generator) -> int:
    """Move random samples from the largest clients to those under ``min_samples``.

    Terminates because the capacity check guarantees ``sum(sizes) >= K * min_samples``, so while a
    client is short, some other client holds more than ``min_samples``. Returns how many clients
    were topped up.
    """
    sizes = np.array([len(p) for p in parts])
    short = np.flatnonzero(sizes < min_samples)
    for client in short:
        while len(parts[client]) < min_samples:
            donor = int(np.argmax(sizes))  # the first largest, as before: sizes kept current
            give = min(min_samples - len(parts[client]), len(parts[donor]) - min_samples)
            order = rng.permutation(len(parts[donor]))
            parts[client] = np.concatenate([parts[client], parts[donor][order[:give]]])
            parts[donor] = parts[donor][np.sort(order[give:])]
            sizes[client], sizes[donor] = len(parts[client]), len(parts[donor])
    return len(short)


def _gather_by_client(drawn: Sequence[np.ndarray], counts: Sequence[np.ndarray],
                      sizes: np.ndarray) -> list[np.ndarray]:
    """Each client's indices: its consecutive cut of every class's shuffled ``drawn`` indices
    (``counts[c][k]`` of class ``c`` to client ``k``, in client order), the classes in order.
    One stable sort by client instead of a split per class and client."""
    owners = np.concatenate([np.repeat(np.arange(len(count)), count) for count in counts])
    order = np.argsort(owners, kind="stable")
    return np.split(np.concatenate(drawn)[order], np.cumsum(sizes)[:-1])


def dirichlet_partition(labels: np.ndarray, num_clients: int, alpha: float,
                        rng: np.random.Generator, min_samples: int = 10,
                        num_classes: int | None = None) -> tuple[list[np.ndarray], int]:
    """Label-skewed partition: per class, client proportions ~ Dir(alpha).

    A client that already holds ``N / K`` samples gets a zero share of the remaining classes
    (NIID-Bench/PFLlib). Up to :data:`DIRICHLET_TRIES` draws are made until every client holds at
    least ``min_samples``; if none succeeds (for example with many clients and a small alpha, where
    some clients almost surely draw near-zero shares of every class) the draw whose smallest client
    is largest is kept and its short clients are topped up with random samples from the largest
    clients. Never loops forever. Returns the parts and the number of topped-up clients.
    """
    if alpha <= 0:
        raise ConfigError(f"dirichlet-alpha must be > 0, got {alpha}.")
    _check_capacity(len(labels), num_clients, min_samples)
    num_classes = num_classes or int(labels.max()) + 1
    by_class = [np.flatnonzero(labels == c) for c in range(num_classes)]
    fair_share = len(labels) / num_clients
    best: list[np.ndarray] | None = None
    best_min = -1
    for _ in range(DIRICHLET_TRIES):
        sizes = np.zeros(num_clients, dtype=np.int64)
        drawn, counts = [], []  # per class: its shuffled indices and each client's cut of them
        for idx in by_class:
            idx = rng.permutation(idx)
            shares = rng.dirichlet(np.full(num_clients, alpha)) * (sizes < fair_share)
            shares /= shares.sum()
            cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(np.int64)
            count = np.diff(np.concatenate([[0], cuts, [len(idx)]]))
            drawn.append(idx)
            counts.append(count)
            sizes += count
        smallest = int(sizes.min())
        if smallest > best_min:
            best_min = smallest
            best = _gather_by_client(drawn, counts, sizes)
        if smallest >= min_samples:
            break
    assert best is not None
    repaired = _top_up_small_clients(best, min_samples, rng) if best_min < min_samples else 0
    return [np.sort(p) for p in best], repaired


def pathological_partition(labels: np.ndarray, num_clients: int, classes_per_client: int,
                           rng: np.random.Generator, min_samples: int = 1,
                           num_classes: int | None = None) -> list[np.ndarray]:
    """Each client holds exactly ``classes_per_client`` distinct classes.

    Classes are dealt cyclically from a random permutation, so every client gets k distinct
    classes and every class has ``floor`` or ``ceil`` of ``K * k / C`` holders; each class's
    shuffled samples are cut into equal shards among its holders.
    """
    num_classes = num_classes or int(labels.max()) + 1
    if classes_per_client > num_classes:
        raise ConfigError(f"classes-per-client = {classes_per_client} exceeds the dataset's "
                          f"{num_classes} classes; lower it.")
    _check_capacity(len(labels), num_clients, min_samples)
    order = rng.permutation(num_classes)
    slots = (np.arange(num_clients)[:, None] * classes_per_client
             + np.arange(classes_per_client)[None, :]) % num_classes
    client_classes = order[slots]
    pieces: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(num_classes):
        holders = np.flatnonzero((client_classes == c).any(axis=1))
        if len(holders) == 0:
            continue
        idx = rng.permutation(np.flatnonzero(labels == c))
        if len(idx) < len(holders):
            raise ConfigError(f"Class {c} has {len(idx)} samples but {len(holders)} clients "
                              "should hold it under partition=pathological; lower num-clients "
                              "or classes-per-client.")
        for client, shard in zip(holders, np.array_split(idx, len(holders)), strict=True):
            pieces[client].append(shard)
    parts = [np.sort(np.concatenate(p)) for p in pieces]
    smallest = min(len(p) for p in parts)
    if smallest < min_samples:
        raise ConfigError(f"partition=pathological leaves a client with {smallest} samples, below "
                          f"min-samples-per-client = {min_samples}; lower num-clients or raise "
                          "classes-per-client.")
    return parts


def quantity_partition(labels: np.ndarray, num_clients: int, power: float,
                       rng: np.random.Generator, min_samples: int = 1) -> list[np.ndarray]:
    """IID labels with power-law sizes: ``min_samples`` each, the rest shared as rank^-power.

    Ranks are assigned to clients by a random permutation, so which client is largest depends on
    the seed.
    """
    _check_capacity(len(labels), num_clients, min_samples)
    rest = len(labels) - num_clients * min_samples
    shares = rng.permutation(np.arange(1, num_clients + 1, dtype=np.float64) ** -power)
    extra = np.floor(shares / shares.sum() * rest).astype(np.int64)
    extra[np.argsort(-shares, kind="stable")[: rest - int(extra.sum())]] += 1
    cuts = np.cumsum(extra + min_samples)[:-1]
    return [np.sort(p) for p in np.split(rng.permutation(len(labels)), cuts)]


def split_train_test(indices: np.ndarray, labels: np.ndarray, test_fraction: float,
                     rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Stratified per-client split: ``floor(n * f)`` test samples (at least 1), by label.

    The client's samples are shuffled, stably sorted by label, and every position ``i`` with
    ``floor((i + 1) f) > floor(i f)`` goes to test: systematic sampling over the label-sorted list,
    so each label's test count is within one of ``f`` times its count. Samples without one label
    (a language model's: a label per token) are split at random, in the shuffled order.
    """
    shuffled = rng.permutation(indices)
    ordered = (shuffled[np.argsort(labels[shuffled], kind="stable")] if labels.ndim == 1
               else shuffled)
    pos = np.arange(len(ordered))
    is_test = np.floor((pos + 1) * test_fraction) > np.floor(pos * test_fraction)
    if not is_test.any() and len(ordered) >= 2:
        is_test[len(ordered) // 2] = True
    return np.sort(ordered[~is_test]), np.sort(ordered[is_test])


@dataclass(frozen=True)
class Partition:
    """Per-client train/test index arrays. Clients ``>= num_train_clients`` are unseen clients."""

    train: tuple[np.ndarray, ...]
    test: tuple[np.ndarray, ...]
    num_train_clients: int
    topped_up_clients: int = 0
    #: per-client image rotation in degrees (partition=rotated); empty when there is none
    rotations: tuple[float, ...] = ()
    #: each client's natural name (partition=natural: a play and role); empty otherwise
    names: tuple[str, ...] = ()
    #: whether each client's samples are in time order, split in that order (partition=natural)
    in_order: bool = False

    def rotation(self, client: int) -> float:
        return self.rotations[client] if self.rotations else 0.0

    @property
    def num_clients(self) -> int:
        return len(self.train)

    def is_unseen(self, client: int) -> bool:
        return client >= self.num_train_clients

    def summary(self, labels: np.ndarray | None, num_classes: int) -> dict:
        """Samples per client per label, for train and test, as JSON-ready lists (None for
        ``labels`` None: samples without one label, a language model's windows)."""
        def counts(idx: np.ndarray) -> list[int] | None:
            if labels is None:
                return None
            return np.bincount(labels[idx], minlength=num_classes).tolist()

        return {
            "num-train-clients": self.num_train_clients,
            "num-unseen-clients": self.num_clients - self.num_train_clients,
            "topped-up-clients": self.topped_up_clients,
            "clients": [
                {"id": i, "unseen": self.is_unseen(i), "num-train": len(tr), "num-test": len(te),
                 "rotation": self.rotation(i), **({"name": self.names[i]} if self.names else {}),
                 "train-labels": counts(tr), "test-labels": counts(te)}
                for i, (tr, te) in enumerate(zip(self.train, self.test, strict=True))
            ],
        }


def rotated_partition(labels: np.ndarray, num_clients: int, num_unseen: int,
                      angles: Sequence[float], unseen_groups: int, alpha: float,
                      rng: np.random.Generator, min_samples: int, num_classes: int,
                      ) -> tuple[list[np.ndarray], list[float], int]:
    """Domain-shift partition: the samples are split evenly at random into one group per angle;
    training clients are spread round-robin over the first ``len(angles) - unseen_groups`` groups
    and unseen clients over the last ``unseen_groups`` (leave-groups-out; over all groups when
    ``unseen_groups = 0``); within a group, labels are split by :func:`dirichlet_partition`.
    Returns the parts (training clients first), each client's angle, and the topped-up count."""
    held_out = unseen_groups if num_unseen else 0
    if held_out >= len(angles):
        raise ConfigError(f"partition=rotated holds out {held_out} of {len(angles)} angle groups; "
                          "at least one must remain for the training clients.")
    groups = np.array_split(rng.permutation(len(labels)), len(angles))
    seen = list(range(len(angles) - held_out))
    unseen = list(range(len(angles) - held_out, len(angles))) if held_out else seen
    members: dict[int, list[int]] = {g: [] for g in range(len(angles))}
    for c in range(num_clients):
        members[seen[c % len(seen)]].append(c)
    for u in range(num_unseen):
        members[unseen[u % len(unseen)]].append(num_clients + u)
    parts: list[np.ndarray] = [np.empty(0, np.int64)] * (num_clients + num_unseen)
    topped_up = 0
    for g, clients in members.items():
        if not clients:
            continue
        idx = groups[g]
        local, extra = dirichlet_partition(labels[idx], len(clients), alpha, rng, min_samples,
                                           num_classes)
        topped_up += extra
        for c, part in zip(clients, local, strict=True):
            parts[c] = np.sort(idx[part])
    rotations = [0.0] * (num_clients + num_unseen)
    for g, clients in members.items():
        for c in clients:
            rotations[c] = float(angles[g])
    return parts, rotations, topped_up


def natural_partition(groups: np.ndarray, num_clients: int, rng: np.random.Generator,
                      min_samples: int, names: Sequence[str] = ()) -> tuple[list[np.ndarray],
                                                                            list[str]]:
    """The dataset's own clients: ``groups[i]`` is sample ``i``'s natural client. Of the groups
    with at least ``min_samples`` samples, ``num_clients`` are drawn at random (seeded), in
    the drawn order; each keeps its samples in their order (time order for text). Returns the
    parts and the drawn groups' names."""
    ids, counts = np.unique(groups, return_counts=True)
    eligible = ids[counts >= min_samples]
    if num_clients > len(eligible):
        raise ConfigError(
            f"partition = natural: {len(eligible)} of the dataset's {len(ids)} natural clients "
            f"have at least {min_samples} samples, fewer than the {num_clients} asked for; lower "
            "num-clients (+ num-unseen-clients) or min-samples-per-client.")
    chosen = rng.choice(eligible, num_clients, replace=False)
    order = np.argsort(groups, kind="stable")
    bounds = np.searchsorted(groups[order], np.stack([chosen, chosen + 1]))
    parts = [order[lo:hi] for lo, hi in bounds.T]
    return parts, [names[g] if names else str(g) for g in chosen]


def split_in_order(indices: np.ndarray, test_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The first samples train and the last ``floor(n * f)`` (at least 1) test."""
    num_test = max(1, math.floor(len(indices) * test_fraction)) if len(indices) >= 2 else 0
    return indices[:len(indices) - num_test], indices[len(indices) - num_test:]


def make_partition(labels: np.ndarray, num_classes: int, *, scheme: str, num_clients: int,
                   num_unseen: int = 0, seed: int = 0, alpha: float = 0.1,
                   classes_per_client: int = 2, quantity_power: float = 1.0,
                   min_samples: int = 10, test_fraction: float = 0.25,
                   angles: Sequence[float] = (0.0,), unseen_groups: int = 0,
                   groups: np.ndarray | None = None, group_names: Sequence[str] = (),
                   time_ordered: bool = True, partition_args: str = "",
                   split: np.ndarray | None = None) -> Partition:
    """Partition over ``num_clients + num_unseen`` clients; split each into train/test.
    ``groups`` (one natural client per sample) is what ``scheme = natural`` partitions by; with
    ``time_ordered`` each natural client's last samples are its test split (text), otherwise a
    stratified random one. ``scheme = flwr:NAME`` is flwr-datasets' partitioner of that name,
    built with ``partition_args``. ``split`` (each sample's split as the data gives it, 0 train
    and 1 test) replaces the drawn split of each natural client; another partition refuses it."""
    total = num_clients + num_unseen
    if split is not None and scheme != "natural":
        raise ConfigError(f"partition = {scheme!r} pools the samples and splits each client's "
                          "share at random, but the data gives each sample's train/test split, "
                          "which belongs to its own clients: set partition = natural (with a "
                          "client column or array), or leave the split out of the data.")
    rng = np.random.default_rng([seed, 0])
    topped_up = 0
    rotations: list[float] = []
    if scheme == "natural":
        if groups is None:
            raise ConfigError("partition = natural needs a dataset with natural clients "
                              "(dataset = shakespeare, npz:PATH with a client array, or "
                              "imagefolder:DIR with one folder per client); choose iid, "
                              "dirichlet, pathological, quantity or rotated.")
        parts, names = natural_partition(groups, total, rng, min_samples, group_names)
        if split is not None:
            splits = [(part[split[part] == 0], part[split[part] == 1]) for part in parts]
            empty = [(names[i], side) for i, (train, test) in enumerate(splits)
                     for side, rows in (("train", train), ("test", test)) if len(rows) == 0]
            if empty:
                raise ConfigError(f"partition = natural: client {empty[0][0]!r} has no "
                                  f"{empty[0][1]} samples in the data's split; give every "
                                  "client both (or leave the split out, to draw one).")
        elif time_ordered:
            splits = [split_in_order(part, test_fraction) for part in parts]
        else:
            split_rng = np.random.default_rng([seed, 1])
            splits = [split_train_test(p, labels, test_fraction, split_rng) for p in parts]
        return Partition(train=tuple(s[0] for s in splits), test=tuple(s[1] for s in splits),
                         num_train_clients=num_clients, names=tuple(names),
                         in_order=time_ordered)
    if scheme == "rotated":
        parts, rotations, topped_up = rotated_partition(
            labels, num_clients, num_unseen, angles, unseen_groups, alpha, rng, min_samples,
            num_classes)
    elif scheme == "iid":
        parts = iid_partition(labels, total, rng, min_samples)
    elif scheme == "dirichlet":
        parts, topped_up = dirichlet_partition(labels, total, alpha, rng, min_samples, num_classes)
    elif scheme == "pathological":
        parts = pathological_partition(labels, total, classes_per_client, rng, min_samples,
                                       num_classes)
    elif scheme == "quantity":
        parts = quantity_partition(labels, total, quantity_power, rng, min_samples)
    elif scheme.startswith("flwr:"):
        from pflalign.data.flwr_partitioners import flwr_partition

        parts = flwr_partition(labels, total, scheme, partition_args, seed, min_samples)
    else:
        raise ConfigError(f"Unknown partition '{scheme}'; choose iid, dirichlet, pathological, "
                          "quantity, rotated, natural or flwr:<Partitioner>.")
    split_rng = np.random.default_rng([seed, 1])
    splits = [split_train_test(p, labels, test_fraction, split_rng) for p in parts]
    return Partition(train=tuple(s[0] for s in splits), test=tuple(s[1] for s in splits),
                     num_train_clients=num_clients, topped_up_clients=topped_up,
                     rotations=tuple(rotations))


def parse_angles(text: str) -> tuple[float, ...]:
    """'rotation-angles' as a tuple of finite floats (at least one)."""
    try:
        angles = tuple(float(a) for a in str(text).split(",") if a.strip())
    except ValueError:
        raise ConfigError(f"Config key 'rotation-angles' = {text!r} must be comma-separated "
                          "numbers of degrees, e.g. '0,30,60,90'.") from None
    if not angles or not all(math.isfinite(a) for a in angles):
        raise ConfigError(f"Config key 'rotation-angles' = {text!r} needs at least one finite "
                          "angle, e.g. '0,30,60,90'.")
    return angles
