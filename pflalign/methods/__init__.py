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

from pflalign.config import ConfigError


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
    #: the method needs batch norm: the run's model is swapped for its batch-norm version
    #: (``cnn`` -> ``cnn-bn``) unless the entry sets ``model`` itself
    needs_batch_norm: bool = False
    #: the method's local training takes ``local-optimizer`` (false: it has its own rule)
    local_optimizer: bool = True

    def load_client(self) -> Any:
        return _load(self.client)

    def load_strategy(self) -> Any:
        return _load(self.strategy)


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


_TRAIN_KEYS = ("lr", "momentum", "weight-decay", "batch-size", "local-epochs", "local-steps",
               "local-optimizer", "adam-lr", "genie-lr", "genie-moving-avg", "genie-p",
               "genie-precondition", "genie-noise", "genie-mask")
_PFLALIGN_KEYS = ("pflalign-lr", "pflalign-beta", "pflalign-eps", "pflalign-precondition",
                  "pflalign-gamma", "pflalign-personalize", "pflalign-state", "pflalign-bn",
                  "pflalign-local-update", "genie-lr", "genie-moving-avg", "genie-p",
                  "genie-precondition", "genie-noise", "genie-mask",
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
                      variant_of="pflalign" if overrides else None, local_optimizer=False)


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
        MethodSpec(
            name="fedprox",
            summary="FedAvg with a proximal term mu/2 ||w - w_global||^2 in each client's "
                    "local objective.",
            paper="Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020",
            client="clients.fedprox:FedProxClient",
            strategy="strategies.fedavg:FedAvgStrategy",
            keys=(*_TRAIN_KEYS, "fedprox-mu"),
        ),
        MethodSpec(
            name="scaffold",
            summary="Client and server control variates correct each local gradient for client "
                    "drift (variance reduction); option II control-variate update.",
            paper="Karimireddy et al., SCAFFOLD: Stochastic Controlled Averaging for Federated "
                  "Learning, ICML 2020",
            client="clients.scaffold:ScaffoldClient",
            strategy="strategies.scaffold:ScaffoldStrategy",
            keys=(*_TRAIN_KEYS, "scaffold-server-lr"),
            local_optimizer=False,
        ),
        MethodSpec(
            name="ditto",
            summary="FedAvg for the global model, plus a personal model per client trained "
                    "with a proximal pull lambda/2 ||v - w_global||^2.",
            paper="Li et al., Ditto: Fair and Robust Federated Learning Through "
                  "Personalization, ICML 2021",
            client="clients.ditto:DittoClient",
            strategy="strategies.fedavg:FedAvgStrategy",
            keys=(*_TRAIN_KEYS, "ditto-lambda", "ditto-personal-epochs"),
        ),
        MethodSpec(
            name="fedper",
            summary="Shared body averaged by FedAvg; the head (last head-layers layers) stays "
                    "on each client; body and head trained jointly.",
            paper="Arivazhagan et al., Federated Learning with Personalization Layers, "
                  "arXiv 1912.00818",
            client="clients.fedper:FedPerClient",
            strategy="strategies.partial:HeadStrategy",
            keys=(*_TRAIN_KEYS, "head-layers", "finetune-epochs"),
            has_global_model=False,
        ),
        MethodSpec(
            name="fedrep",
            summary="Shared representation (body) and personal head: the head is trained "
                    "first with the body frozen, then the body with the head frozen.",
            paper="Collins et al., Exploiting Shared Representations for Personalized "
                  "Federated Learning, ICML 2021",
            client="clients.fedrep:FedRepClient",
            strategy="strategies.partial:HeadStrategy",
            keys=(*_TRAIN_KEYS, "head-layers", "fedrep-head-epochs", "finetune-epochs"),
            has_global_model=False,
        ),
        MethodSpec(
            name="fedbn",
            summary="FedAvg of every layer except batch norm, which stays local to each "
                    "client (runs on cnn-bn when the model is cnn).",
            paper="Li et al., FedBN: Federated Learning on Non-IID Features via Local Batch "
                  "Normalization, ICLR 2021",
            client="clients.fedbn:FedBNClient",
            strategy="strategies.partial:BatchNormStrategy",
            keys=(*_TRAIN_KEYS, "finetune-epochs"),
            has_global_model=False,
            needs_batch_norm=True,
        ),
        MethodSpec(
            name="apfl",
            summary="Each client mixes a personal model v with the global model w as "
                    "alpha v + (1 - alpha) w, learning alpha by gradient descent.",
            paper="Deng, Kamani, Mahdavi, Adaptive Personalized Federated Learning, "
                  "arXiv 2003.13461",
            client="clients.apfl:APFLClient",
            strategy="strategies.fedavg:FedAvgStrategy",
            keys=(*_TRAIN_KEYS, "apfl-alpha", "apfl-adaptive", "apfl-alpha-lr"),
            local_optimizer=False,
        ),
        MethodSpec(
            name="perfedavg",
            summary="First-order MAML: the global model is trained to adapt well in one step; "
                    "clients personalize by a few SGD steps from it.",
            paper="Fallah, Mokhtari, Ozdaglar, Personalized Federated Learning with "
                  "Theoretical Guarantees: A Model-Agnostic Meta-Learning Approach, NeurIPS 2020",
            client="clients.perfedavg:PerFedAvgClient",
            strategy="strategies.fedavg:FedAvgStrategy",
            keys=("batch-size", "local-epochs", "local-steps", "perfedavg-alpha",
                  "perfedavg-beta", "perfedavg-eval-steps"),
            local_optimizer=False,
        ),
        MethodSpec(
            name="pfedme",
            summary="Personal models as Moreau-envelope proximal points of the local model "
                    "(K inner steps per batch); the server mixes with beta.",
            paper="T Dinh, Tran, Nguyen, Personalized Federated Learning with Moreau "
                  "Envelopes, NeurIPS 2020",
            client="clients.pfedme:PFedMeClient",
            strategy="strategies.pfedme:PFedMeStrategy",
            keys=("lr", "batch-size", "local-epochs", "local-steps", "pfedme-lambda", "pfedme-k",
                  "pfedme-personal-lr", "pfedme-beta"),
            local_optimizer=False,
        ),
        MethodSpec(
            name="fedala",
            summary="Adaptive local aggregation: element-wise learned weights merge the global "
                    "model into each client's model (top layers) before local training.",
            paper="Zhang et al., FedALA: Adaptive Local Aggregation for Personalized Federated "
                  "Learning, AAAI 2023",
            client="clients.fedala:FedALAClient",
            strategy="strategies.fedavg:FedAvgStrategy",
            keys=(*_TRAIN_KEYS, "fedala-eta", "fedala-rand-percent", "fedala-layers",
                  "fedala-threshold", "fedala-num-pre-loss"),
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
        _pflalign("pflalign-genie", "pFLAlign's federation (personalized initialization "
                  "and offsets) with GENIE as the local update, its state persistent per client "
                  "(ALGORITHMS.md 4.2).", **{"local-update": "genie"}),
        _pflalign("pflalign-sgd", "pFLAlign with P = 1 and Delta = 0: FedAvg with plain "
                          "SGD.", precondition=False, personalize=False),
    )
}


#: a method that needs batch norm runs on this version of the run's model
BATCH_NORM_VERSION = {"cnn": "cnn-bn"}
#: registered models with batch-norm layers
BATCH_NORM_MODELS = ("cnn-bn", "resnet18")


def method_overrides(spec: MethodSpec, settings: Mapping[str, Any],
                     entry_overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The config changes a method entry runs with: the spec's fixed keys, the entry's own, and
    for a method that needs batch norm the batch-norm version of a model without it."""
    overrides = {**spec.overrides, **entry_overrides}
    model = overrides.get("model", settings["model"])
    if spec.needs_batch_norm and "model" not in entry_overrides and model in BATCH_NORM_VERSION:
        overrides["model"] = model = BATCH_NORM_VERSION[str(model)]
    if spec.needs_batch_norm and model not in BATCH_NORM_MODELS:
        raise ConfigError(f"Method '{spec.name}' needs a model with batch norm; model '{model}' "
                          f"has none: choose one of {', '.join(BATCH_NORM_MODELS)}.")
    return overrides
