"""The federated dataset of a run: the pooled dataset and its partition, built once per process."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pflalign.data import synthetic
from pflalign.data.clients import CLIENTS, ClientsFederation, clients_federation
from pflalign.data.datasets import IGNORE_INDEX, ClientData, Dataset, load_dataset
from pflalign.data.hf_source import COLUMN_KEYS
from pflalign.data.partition import (
    Partition,
    make_partition,
    parse_angles,
    split_in_order,
    split_train_test,
)
from pflalign.data.synthetic import SyntheticFederation
from pflalign.process.caches import cached
from pflalign.settings.schema import DATA_KEYS

#: the random stream of the validation split (partition draws use 0, the test split 1, the
#: max-samples subset 2)
VALIDATION_STREAM = 3
#: ... and that of FLTrust's root set
ROOT_STREAM = 4


@dataclass(frozen=True)
class FederatedDataset:
    """A dataset, the subset of it in use, and the per-client partition of that subset."""

    dataset: Dataset
    pool: np.ndarray
    partition: Partition
    _rotated: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    _on_device: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    #: :meth:`fingerprint`, once computed
    _digest: list = field(default_factory=list, compare=False, hash=False, repr=False)
    #: each client's split sizes are the server's own (the partition), never what a node
    #: declares (:class:`~pflalign.data.clients.ClientsFederation` takes the nodes')
    sizes_declared = False

    def client_data(self, client: int, device: torch.device | str = "cpu") -> ClientData:
        """Client ``client``'s train and test tensors (copied out of the cached pool; for
        partition=rotated, rotated once by the client's angle and cached per process)."""
        if not 0 <= client < self.partition.num_clients:
            raise ValueError(f"Client id {client} is outside 0..{self.partition.num_clients - 1}; "
                             "the node's partition-id does not match this run's num-clients.")
        angle = self.partition.rotation(client)
        train = self.pool[self.partition.train[client]]
        test = self.pool[self.partition.test[client]]
        if not angle and torch.device(device).type == "cuda":
            images, labels = self.on_device(device)  # gathered where the data already is
            rows = {k: torch.from_numpy(v).to(device) for k, v in (("train", train),
                                                                   ("test", test))}
            return ClientData(images[rows["train"]], labels[rows["train"]], images[rows["test"]],
                              labels[rows["test"]], self.dataset.normalizer(),
                              self.dataset.masked_targets)
        if not angle:
            return ClientData.from_indices(self.dataset, train, test, device)
        if client not in self._rotated:
            data = ClientData.from_indices(self.dataset, self.pool[self.partition.train[client]],
                                           self.pool[self.partition.test[client]])
            self._rotated[client] = data.rotated(angle)
        return self._rotated[client].to(device)

    def on_device(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """The pooled images and labels on ``device``: moved there once per process and kept
        (on a GPU, every client's split is then gathered there, with nothing copied from the
        host per message)."""
        key = str(device)
        if key not in self._on_device and self.dataset.tokens is not None:
            # a text dataset's windows are views of one token stream: move the stream and
            # take the same windows of it there
            stream = torch.tensor(self.dataset.tokens, device=device)
            length = self.dataset.input_shape[0]
            labels = (stream[1:].long().unfold(0, length, 1) if self.dataset.labels.ndim == 2
                      else torch.tensor(self.dataset.labels, device=device))
            self._on_device[key] = (stream.unfold(0, length, 1)[:-1], labels)
        if key not in self._on_device:
            # torch.tensor copies: the pool may be a read-only (memory-mapped) array, which
            # torch.from_numpy would share and warn about
            self._on_device[key] = (torch.tensor(self.dataset.images, device=device),
                                    torch.tensor(self.dataset.labels, device=device))
        return self._on_device[key]

    @property
    def targets_per_sample(self) -> int:
        """What one sample scores: one label, or each token of a language model's window."""
        return 1 if self.dataset.labels.ndim == 1 else self.dataset.labels.shape[1]

    def sizes(self, client: int) -> tuple[int, int]:
        """Client ``client``'s train samples and test targets (a language model's test tokens;
        an instruction's response tokens), as :class:`~pflalign.data.datasets.ClientData`
        counts them."""
        if self.dataset.masked_targets:
            test = self.dataset.labels[self.pool[self.partition.test[client]]]
            return len(self.partition.train[client]), int(np.count_nonzero(test != IGNORE_INDEX))
        return (len(self.partition.train[client]),
                len(self.partition.test[client]) * self.targets_per_sample)

    def summary(self) -> dict:
        """The partition, with each client's label counts where a sample has one label, and the
        dataset's content fingerprint (:meth:`fingerprint`)."""
        labels = (self.dataset.labels[self.pool] if self.dataset.labels.ndim == 1
                  and self.dataset.labels.dtype.kind in "iu" else None)  # not a regression's
        return {"dataset": self.dataset.name, "samples": len(self.pool),
                "fingerprint": self.fingerprint(),
                **({"class-names": list(self.dataset.class_names)}
                   if self.dataset.class_names else {}),
                **self.partition.summary(labels, self.dataset.num_classes)}

    def fingerprint(self) -> str:
        """The first 16 hex digits of the SHA-256 of the data a run uses: the samples in use
        (their inputs, or a text dataset's token stream), their labels and the split the data
        gives (where it gives one), so two runs that report the same one read the same data
        whatever its file or folder was called. Hashed once per process (about 0.1 s for
        Fashion-MNIST's 55 MB)."""
        if not self._digest:
            digest = hashlib.sha256()
            data = self.dataset
            inputs = data.tokens if data.tokens is not None else data.images[self.pool]
            given = () if data.split is None else (data.split[self.pool],)  # its own split
            for array in (inputs, data.labels[self.pool], self.pool, *given):
                array = np.ascontiguousarray(array)
                digest.update(f"{array.dtype.str}{array.shape}".encode())
                digest.update(memoryview(array).cast("B"))
            self._digest.append(digest.hexdigest()[:16])
        return self._digest[0]


#: what :func:`federated_dataset` gives
Federation = FederatedDataset | SyntheticFederation | ClientsFederation


@cached(maxsize=2)
def _build(key: tuple) -> Federation:
    cfg = dict(zip(DATA_KEYS, key, strict=True))
    if cfg["dataset"] == CLIENTS:
        return clients_federation(cfg)
    if cfg["dataset"] == synthetic.NAME:
        return synthetic.synthetic_federation(cfg)
    dataset = load_dataset(cfg["dataset"], cfg["data-root"], cfg["download"], cfg["tokenizer"],
                           cfg["sequence-length"], cfg["image-size"],
                           (*(cfg[k] for k in COLUMN_KEYS), cfg["split-column"]),
                           cfg["cache-dir"], cfg["task"])
    pool, groups, split = dataset.sample_ids(), dataset.groups, dataset.split
    if 0 < cfg["max-samples"] < len(pool):
        chosen = np.sort(np.random.default_rng([cfg["seed"], 2]).choice(
            len(pool), cfg["max-samples"], replace=False))
        pool, groups = pool[chosen], None if groups is None else groups[chosen]
        split = None if split is None else split[chosen]
    partition = make_partition(
        dataset.labels[pool], dataset.num_classes, scheme=cfg["partition"],
        num_clients=cfg["num-clients"], num_unseen=cfg["num-unseen-clients"], seed=cfg["seed"],
        alpha=cfg["dirichlet-alpha"], classes_per_client=cfg["classes-per-client"],
        quantity_power=cfg["quantity-power"], min_samples=cfg["min-samples-per-client"],
        test_fraction=cfg["test-fraction"], angles=parse_angles(cfg["rotation-angles"]),
        unseen_groups=cfg["rotation-unseen-groups"], groups=groups,
        group_names=dataset.group_names, time_ordered=dataset.time_ordered,
        partition_args=cfg["partition-args"], split=split)
    if cfg["evaluate-on"] == "validation":
        partition = validation_partition(partition, dataset.labels[pool],
                                         cfg["validation-fraction"], cfg["seed"])
    return FederatedDataset(dataset=dataset, pool=pool, partition=partition)


def validation_partition(partition: Partition, labels: np.ndarray, fraction: float,
                         seed: int) -> Partition:
    """The partition with each client's test split replaced by a validation split carved from
    its training split (stratified, seeded by (seed, :data:`VALIDATION_STREAM`); the last part
    of it, for a partition in time order); the client
    trains on the rest. The test indices are dropped, so nothing evaluated or trained on in this
    mode can touch test data."""
    rng = np.random.default_rng([seed, VALIDATION_STREAM])
    splits = [split_in_order(train, fraction) if partition.in_order
              else split_train_test(train, labels, fraction, rng) for train in partition.train]
    return replace(partition, train=tuple(s[0] for s in splits),
                   test=tuple(s[1] for s in splits))


def federated_dataset(settings: Mapping[str, object]) -> Federation:
    """The run's federated dataset, cached per process (no re-reading or re-partitioning; a
    synthetic federation generates a client's data when it is asked for; with ``dataset =
    clients`` the server holds none, :mod:`pflalign.data.clients`)."""
    key = getattr(settings, "data_key", None)
    return _build(key if key is not None else tuple(settings[k] for k in DATA_KEYS))


def root_set(settings: Mapping[str, object], size: int) -> ClientData:
    """FLTrust's root set: ``size`` samples of the dataset that no client holds (outside the
    run's pool; drawn by (seed, :data:`ROOT_STREAM`)), as training data (its test split, one of
    them, is never used). Raises ValueError, naming the fix, when the pool leaves too few."""
    federation = federated_dataset(settings)
    if not isinstance(federation, FederatedDataset):
        raise ValueError(f"aggregation = 'fltrust' draws its root set from the dataset's samples "
                         f"that no client holds, and dataset = {settings['dataset']!r} has no "
                         "such pool: choose another aggregation.")
    free = np.setdiff1d(federation.dataset.sample_ids(), federation.pool)
    if len(free) < size:
        raise ValueError(f"aggregation = 'fltrust' draws its root set of {size} samples from those "
                         f"no client holds, and this run's clients hold {len(federation.pool)} of "
                         f"the dataset's {len(federation.dataset.sample_ids())} (max-samples = "
                         f"{settings['max-samples']}): set max-samples to at most "
                         f"{len(federation.dataset.sample_ids()) - size}, or a smaller "
                         "fltrust-root-size.")
    chosen = np.sort(np.random.default_rng([int(settings["seed"]), ROOT_STREAM]).choice(
        free, size, replace=False))
    return ClientData.from_indices(federation.dataset, chosen, chosen[:1])
