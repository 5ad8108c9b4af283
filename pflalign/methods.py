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
    variant_of: str | None = None

    def load_client(self) -> Any:
        return _load(self.client)

    def load_strategy(self) -> Any:
        return _load(self.strategy)


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


_TRAIN_KEYS = ("lr", "momentum", "weight-decay", "batch-size", "local-epochs", "local-steps")
_PFLALIGN_KEYS = ("pflalign-lr", "pflalign-beta", "pflalign-eps", "pflalign-precondition",
                  "pflalign-gamma", "pflalign-personalize", "pflalign-state", "pflalign-bn",
                  "batch-size", "local-epochs", "local-steps", "lr")
_PFLALIGN_PAPER = ("Kim et al., Personalized Federated Learning for Gradient Alignment "
                   "(pFLAlign), arXiv 2605.02143")


def _pflalign(name: str, summary: str, **overrides: Any) -> MethodSpec:
    """pFLAlign, or with ``overrides`` one of its ablations (ALGORITHMS.md 1.11): pflalign with
    some ``pflalign-*`` switches fixed."""
    return MethodSpec(name=name, summary=summary, paper=_PFLALIGN_PAPER,
                      client="clients.pflalign:PFLAlignClient",
                      strategy="strategies.pflalign:PFLAlignStrategy", keys=_PFLALIGN_KEYS,
                      overrides={f"pflalign-{k}": v for k, v in overrides.items()},
                      variant_of="pflalign" if overrides else None)


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
        _pflalign("pflalign", "pFLAlign: clients start from global + their offset Delta and "
                  "train with a persistent multiplicative preconditioner P and a gamma-weighted "
                  "removal of Delta; the server averages (ALGORITHMS.md 1)."),
        _pflalign("pflalign-noprecond", "pFLAlign without the preconditioner (raw "
                          "gradient, SGD rate 'lr').", precondition=False),
        _pflalign("pflalign-gamma0", "pFLAlign with gamma = 0 (the offset is kept).",
                          gamma="zero"),
        _pflalign("pflalign-gamma05", "pFLAlign with gamma = 1/2.", gamma="half"),
        _pflalign("pflalign-gamma1", "pFLAlign with gamma = 1 (the offset is removed "
                          "over the round).", gamma="one"),
        _pflalign("pflalign-hardgamma", "pFLAlign with gamma = 1/2 + 1/2 sign(m Delta).",
                          gamma="hard"),
        _pflalign("pflalign-nopersonal", "pFLAlign with Delta = 0 (no personalized "
                          "initialization, no correction).", personalize=False),
        _pflalign("pflalign-sgd", "pFLAlign with P = 1 and Delta = 0: FedAvg with plain "
                          "SGD.", precondition=False, personalize=False),
    )
}
