"""``dataset = clients``: the clients hold the data, the server none.

A Flower user's own ClientApp has its own data loaders; it answers a strategy's messages with
:func:`clients.answer`, which reads them into one client's :class:`NodeData`
(:func:`pflalign.data.loaders.node_data_from_loaders`). The server's side of such a run is a
:class:`ClientsFederation`: the shape of one sample and the number of classes from the config
(``input-shape``, ``num-classes``), which the model is built with, and the clients' ids
(``num-clients`` training clients, then ``num-unseen-clients`` unseen ones), but no samples.
Each client's split sizes are what it declares at discovery, so they weight its reply as a
deployed Flower strategy's ``num-examples`` would; the audits, which recompute replies from the
server's copy of the data, are refused with this dataset (``run/config.py``), as are the
engines that run the clients from pooled data (sequential, batched).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from pflalign.data.datasets import ClientData, Dataset
from pflalign.settings.options import ConfigError
from pflalign.settings.schema import FEATURES, IMAGE

#: the ``dataset`` value of a run whose data only the clients hold
CLIENTS = "clients"


def parse_input_shape(text: str) -> tuple[int, ...]:
    """``"1,28,28"`` -> ``(1, 28, 28)``, in one sentence if it is not one to three positive
    whole numbers."""
    parts = [p.strip() for p in str(text).replace("x", ",").split(",") if p.strip()]
    if not parts or len(parts) > 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ConfigError(f"input-shape = {text!r}: give one sample's shape as the clients' "
                          "loaders give it, e.g. '16' (feature vectors) or '1,28,28' (images, "
                          "channels first).")
    return tuple(int(p) for p in parts)


def clients_kind(input_shape: tuple[int, ...]) -> str:
    """What the clients' samples are: images (channels, height, width) or feature vectors."""
    return IMAGE if len(input_shape) == 3 else FEATURES


@dataclass(frozen=True)
class ClientsPartition:
    """The clients of a ``dataset = clients`` run: their ids, and which are unseen."""

    num_train_clients: int
    num_clients: int
    in_order = True

    def is_unseen(self, client: int) -> bool:
        return client >= self.num_train_clients

    def rotation(self, client: int) -> float:
        return 0.0

    def summary(self) -> dict:
        """The clients' ids; their split sizes are each client's own (declared at discovery)."""
        return {"num-train-clients": self.num_train_clients,
                "num-unseen-clients": self.num_clients - self.num_train_clients,
                "topped-up-clients": 0, "clients": []}


@dataclass(frozen=True)
class ClientsFederation:
    """The server's view of a ``dataset = clients`` run (the interface of
    :class:`~pflalign.data.federated.FederatedDataset`, without samples)."""

    dataset: Dataset
    partition: ClientsPartition
    #: the clients' split sizes are theirs to declare (discovery takes them as given)
    sizes_declared = True
    targets_per_sample = 1

    def client_data(self, client: int, device: torch.device | str = "cpu") -> ClientData:
        raise ConfigError("dataset = 'clients': this process holds no client's data; a "
                          "ClientApp of your own gives it (clients.answer with your data "
                          "loaders), on engine = 'flower' or your own ServerApp.")

    def sizes(self, client: int) -> tuple[int, int]:
        raise ConfigError("dataset = 'clients': a client's split sizes are its own, declared "
                          "at discovery.")

    def summary(self) -> dict:
        return {"dataset": CLIENTS, "samples": None, **self.partition.summary()}


def clients_federation(cfg: Mapping[str, object]) -> ClientsFederation:
    """The federation of a ``dataset = clients`` config."""
    shape = parse_input_shape(str(cfg["input-shape"]))
    empty = np.empty((0, *shape), np.float32)
    empty.setflags(write=False)
    dataset = Dataset(name=CLIENTS, images=empty, labels=np.empty(0, np.int64),
                      num_classes=int(cfg["num-classes"]), mean=(0.0,), std=(1.0,),
                      kind=clients_kind(shape))
    train = int(cfg["num-clients"])
    unseen = int(cfg["num-unseen-clients"])
    return ClientsFederation(dataset, ClientsPartition(train, train + unseen))
