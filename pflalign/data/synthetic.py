"""Synthetic(alpha, beta): the standard generated pFL dataset, any number of clients, each
client's data generated from the seed when it is asked for.

Li et al., "Federated Optimization in Heterogeneous Networks" (FedProx), MLSys 2020, Section 5.1,
after Shamir et al. (2014): client ``k`` has its own softmax model and its own input
distribution, and labels its inputs with that model:

* ``u_k ~ N(0, alpha^2)``, ``W_k[i, j] ~ N(u_k, 1)`` (``C x d``), ``b_k[i] ~ N(u_k, 1)``:
  ``alpha`` sets how much the clients' models differ;
* ``B_k ~ N(0, beta^2)``, ``v_k[j] ~ N(B_k, 1)``, ``x ~ N(v_k, Sigma)`` with
  ``Sigma = diag(j^-1.2)``, ``j = 1..d``: ``beta`` sets how much their inputs differ;
* ``y = argmax(W_k x + b_k)``.

``alpha`` and ``beta`` are standard deviations (the paper writes ``N(0, alpha)``; its published
generator draws with standard deviation ``alpha``). Synthetic-IID (``synthetic-iid = true``):
one ``W``, ``b`` with entries ``N(0, 1)`` for every client and ``x ~ N(0, Sigma)``.

Client sizes follow a power law (Pareto): ``n_k = floor(m (1 - U_k)^(-1 / s))`` with
``U_k ~ U[0, 1)``, ``m`` = min-samples-per-client and ``s`` = synthetic-size-power, capped at
synthetic-max-samples. Sizes are drawn for the whole federation at once (one number per client);
a client's samples are generated from ``(seed, client)`` alone, in the same way whichever process,
engine or order asks, so a federation of 100,000 clients never holds all their data: a round
generates the data of the clients it samples. Each client's first samples train and its last
``floor(n * test-fraction)`` (at least one) test (the samples are i.i.d., so this is a random
split); evaluate-on = validation carves the last part of the training samples.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from pflalign.data.datasets import ClientData, Dataset
from pflalign.settings.schema import FEATURES

NAME = "synthetic"
#: random streams under the run's seed: client sizes, the shared model of Synthetic-IID, and
#: (with the client's id appended) each client's data
SIZE_STREAM, SHARED_STREAM, CLIENT_STREAM = 10, 11, 12
#: the exponent of the input covariance's diagonal, ``Sigma_jj = j^-1.2``
COVARIANCE_DECAY = 1.2


@dataclass(frozen=True)
class SyntheticSpec:
    """What defines a Synthetic(alpha, beta) federation (all from the run's config)."""

    alpha: float
    beta: float
    iid: bool
    features: int
    classes: int
    size_power: float
    min_samples: int
    max_samples: int
    num_clients: int
    num_unseen: int
    test_fraction: float
    validation_fraction: float | None
    seed: int

    @classmethod
    def of(cls, cfg: Mapping[str, object]) -> SyntheticSpec:
        validation = cfg["evaluate-on"] == "validation"
        return cls(alpha=float(cfg["synthetic-alpha"]), beta=float(cfg["synthetic-beta"]),
                   iid=bool(cfg["synthetic-iid"]), features=int(cfg["synthetic-features"]),
                   classes=int(cfg["synthetic-classes"]),
                   size_power=float(cfg["synthetic-size-power"]),
                   min_samples=int(cfg["min-samples-per-client"]),
                   max_samples=int(cfg["synthetic-max-samples"]),
                   num_clients=int(cfg["num-clients"]),
                   num_unseen=int(cfg["num-unseen-clients"]),
                   test_fraction=float(cfg["test-fraction"]),
                   validation_fraction=float(cfg["validation-fraction"]) if validation else None,
                   seed=int(cfg["seed"]))

    @property
    def total(self) -> int:
        return self.num_clients + self.num_unseen


def client_sizes(spec: SyntheticSpec) -> np.ndarray:
    """Every client's sample count (train and test), one draw per client."""
    uniform = np.random.default_rng([spec.seed, SIZE_STREAM]).random(spec.total)
    sizes = np.floor(spec.min_samples * (1.0 - uniform) ** (-1.0 / spec.size_power))
    return np.clip(sizes, spec.min_samples, spec.max_samples).astype(np.int64)


def _held_out(n: np.ndarray, fraction: float) -> np.ndarray:
    """How many of ``n`` samples the last part holds (as partition.split_in_order does)."""
    return np.where(n >= 2, np.maximum(1, np.floor(n * fraction)), 0).astype(np.int64)


def split_sizes(spec: SyntheticSpec, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Clients of ``n`` samples: their training samples and their evaluation samples (the test
    split, or with evaluate-on = validation the validation part of the training split)."""
    test = _held_out(n, spec.test_fraction)
    if spec.validation_fraction is None:
        return n - test, test
    train = n - test
    validation = _held_out(train, spec.validation_fraction)
    return train - validation, validation


def generate(spec: SyntheticSpec, client: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Client ``client``'s ``n`` samples: float32 inputs ``n x d`` and int64 labels."""
    rng = np.random.default_rng([spec.seed, CLIENT_STREAM, client])
    scale = np.arange(1, spec.features + 1, dtype=np.float64) ** (-COVARIANCE_DECAY / 2)
    if spec.iid:
        shared = np.random.default_rng([spec.seed, SHARED_STREAM])
        weights = shared.normal(0.0, 1.0, (spec.classes, spec.features))
        bias = shared.normal(0.0, 1.0, spec.classes)
        centre = np.zeros(spec.features)
    else:
        model_mean = rng.normal(0.0, spec.alpha)
        input_mean = rng.normal(0.0, spec.beta)
        weights = rng.normal(model_mean, 1.0, (spec.classes, spec.features))
        bias = rng.normal(model_mean, 1.0, spec.classes)
        centre = rng.normal(input_mean, 1.0, spec.features)
    x = centre + rng.standard_normal((n, spec.features)) * scale
    y = np.argmax(x @ weights.T + bias, axis=1)
    return x.astype(np.float32), y.astype(np.int64)


@dataclass(frozen=True)
class GeneratedPartition:
    """The clients of a generated federation: their ids and split sizes, nothing else held."""

    num_train_clients: int
    train_sizes: np.ndarray
    test_sizes: np.ndarray
    topped_up_clients: int = 0
    rotations: tuple[float, ...] = ()
    names: tuple[str, ...] = ()
    in_order: bool = True

    @property
    def num_clients(self) -> int:
        return len(self.train_sizes)

    def is_unseen(self, client: int) -> bool:
        return client >= self.num_train_clients

    def rotation(self, client: int) -> float:
        return 0.0

    def summary(self) -> dict:
        """Each client's split sizes (label counts would need every client's data)."""
        return {
            "num-train-clients": self.num_train_clients,
            "num-unseen-clients": self.num_clients - self.num_train_clients,
            "topped-up-clients": 0,
            "clients": [{"id": i, "unseen": self.is_unseen(i), "num-train": int(tr),
                         "num-test": int(te), "rotation": 0.0, "train-labels": None,
                         "test-labels": None}
                        for i, (tr, te) in enumerate(zip(self.train_sizes.tolist(),
                                                         self.test_sizes.tolist(), strict=True))],
        }


@dataclass(frozen=True)
class SyntheticFederation:
    """A federated dataset whose clients' data are generated on demand (the interface of
    :class:`~pflalign.data.federated.FederatedDataset`)."""

    spec: SyntheticSpec
    dataset: Dataset
    partition: GeneratedPartition
    sample_counts: np.ndarray
    _last: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    targets_per_sample = 1
    #: the sizes are the server's own (drawn from the seed), never what a node declares
    sizes_declared = False

    def client_data(self, client: int, device: torch.device | str = "cpu") -> ClientData:
        """Client ``client``'s train and evaluation tensors, generated from the seed (the last
        client asked for is kept: a train and an evaluate of one client generate once)."""
        if not 0 <= client < self.partition.num_clients:
            raise ValueError(f"Client id {client} is outside 0..{self.partition.num_clients - 1}; "
                             "the node's partition-id does not match this run's num-clients.")
        if self._last.get("client") != client:
            x, y = generate(self.spec, client, int(self.sample_counts[client]))
            self._last.clear()
            self._last.update(client=client, x=torch.from_numpy(x), y=torch.from_numpy(y))
        x, y = self._last["x"], self._last["y"]
        train = int(self.partition.train_sizes[client])
        held = int(self.partition.test_sizes[client])
        data = ClientData(x[:train], y[:train], x[train:train + held], y[train:train + held],
                          self.dataset.normalizer())
        return data.to(device)

    def sizes(self, client: int) -> tuple[int, int]:
        return int(self.partition.train_sizes[client]), int(self.partition.test_sizes[client])

    def summary(self) -> dict:
        return {"dataset": self.dataset.name, "samples": int(self.sample_counts.sum()),
                **self.partition.summary()}


def synthetic_federation(cfg: Mapping[str, object]) -> SyntheticFederation:
    """The federation of a ``dataset = synthetic`` config (sizes drawn, no data generated)."""
    spec = SyntheticSpec.of(cfg)
    counts = client_sizes(spec)
    train, held = split_sizes(spec, counts)
    name = f"{NAME}-iid" if spec.iid else f"{NAME}({spec.alpha:g},{spec.beta:g})"
    empty = np.empty((0, spec.features), np.float32)
    empty.setflags(write=False)
    dataset = Dataset(name=name, images=empty, labels=np.empty(0, np.int64),
                      num_classes=spec.classes, mean=(0.0,), std=(1.0,), kind=FEATURES)
    return SyntheticFederation(spec=spec, dataset=dataset,
                               partition=GeneratedPartition(spec.num_clients, train, held),
                               sample_counts=counts)
