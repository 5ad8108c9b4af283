"""The method registry: every federated method is one name here.

A method has a client half (``clients/<file>.py``, run inside a Flower ClientApp) and a server half
(``strategies/<file>.py``, a Flower Strategy). They are referenced by import path so that this
module, like all of ``pflalign``, never imports ``flwr``. ``overrides`` lets a registered variant
(an ablation, say) be an existing method with some config keys fixed.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MethodSpec:
    """A registered method: its two halves, what it reads from the config, and what it reports."""

    name: str
    summary: str
    paper: str
    client: str
    strategy: str
    keys: tuple[str, ...] = ()
    overrides: Mapping[str, Any] = field(default_factory=dict)
    has_global_model: bool = True

    def load_client(self) -> Any:
        return _load(self.client)

    def load_strategy(self) -> Any:
        return _load(self.strategy)


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


_TRAIN_KEYS = ("lr", "momentum", "weight-decay", "batch-size", "local-epochs", "local-steps")

METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec(
            name="fedavg",
            summary="Sample-weighted averaging of locally trained models; every client uses "
                    "the global model.",
            paper="McMahan et al., Communication-Efficient Learning of Deep Networks from "
                  "Decentralized Data, AISTATS 2017",
            client="clients.fedavg:FedAvgClient",
            strategy="strategies.fedavg:FedAvgStrategy",
            keys=_TRAIN_KEYS,
        ),
        MethodSpec(
            name="fedavg-ft",
            summary="FedAvg, and each client's model is the global model fine-tuned locally "
                    "for finetune-epochs before evaluation.",
            paper="FedAvg + local fine-tuning (e.g. Wang et al., Federated Evaluation of "
                  "On-device Personalization, 2019)",
            client="clients.fedavg_ft:FedAvgFineTuneClient",
            strategy="strategies.fedavg:FedAvgStrategy",
            keys=(*_TRAIN_KEYS, "finetune-epochs"),
        ),
        MethodSpec(
            name="local",
            summary="Each client trains only on its own data; no averaging. Its model persists "
                    "across rounds in the client's state.",
            paper="Local-only training (the standard pFL reference)",
            client="clients.local:LocalClient",
            strategy="strategies.local:LocalStrategy",
            keys=_TRAIN_KEYS,
            has_global_model=False,
        ),
    )
}
