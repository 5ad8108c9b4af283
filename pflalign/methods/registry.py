"""The method registry: every federated method is one line here.

Each entry maps a name to a method class (``pflalign/methods/<name>.py``), which declares its
``Params``, its state and its client and server rules; a variant (an ablation) is an existing
method with some of its ``Params`` fixed. Nothing here imports an engine, so every method runs
the same under every engine (``engine = flower | sequential``).

**What is scored.** ``personal-acc`` scores each method's personalized model on the client's test
split and ``global-acc`` the global model where the method has one; each method's section says
which model that is, and what a new client (an unseen client, or a seen one evaluated before its
first training) does. ``--methods all`` runs every method except the variants; any entry can carry
its own settings, which is how sweeps run on one partition in one start:
``--methods "fedavg,pflalign(pflalign-lr=2),pflalign(pflalign-lr=5)"`` (the entry is its label in
tables and results.json).

**Deviations and limits, stated.** Only the clients sampled in a round train in it, for every
method (pFedMe's paper lets all clients update locally and averages a subset; here the sampled
clients are the same for every method, which keeps the comparison fair and the cost bounded).
SCAFFOLD weights the model step by sample count (the paper's 1/|S| for equal-size clients) and
refuses momentum and weight decay, as option II assumes plain SGD; APFL refuses momentum, since
its personal model follows plain SGD. ``local-steps`` caps only a round's main local training
(``local-epochs``); phases counted in their own epochs (FedRep's head epochs, Ditto's personal
epochs, fine-tuning and new-client fitting) run in full. A layer frozen in a phase keeps its
batch-norm statistics too. Each method's defining rule is tested against hand-computed values
(``tests/test_baselines.py``, ``tests/test_baseline_clients.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pflalign.methods.apfl import APFL
from pflalign.methods.base import Method
from pflalign.methods.ditto import Ditto
from pflalign.methods.fedala import FedALA
from pflalign.methods.fedavg import FedAvg
from pflalign.methods.fedavg_ft import FedAvgFineTune
from pflalign.methods.fedbn import FedBN
from pflalign.methods.fedcp import FedCP
from pflalign.methods.feddbe import FedDBE
from pflalign.methods.feddyn import FedDyn
from pflalign.methods.fedper import FedPer
from pflalign.methods.fedprox import FedProx
from pflalign.methods.fedrep import FedRep
from pflalign.methods.gpfl import GPFL
from pflalign.methods.local import Local
from pflalign.methods.perfedavg import PerFedAvg
from pflalign.methods.pfedme import PFedMe
from pflalign.methods.pflalign import PFLAlignMethod
from pflalign.methods.scaffold import Scaffold
from pflalign.models.registry import MODELS
from pflalign.models.user import is_user_model
from pflalign.settings.options import ConfigError, Value
from pflalign.settings.params import Search


@dataclass(frozen=True)
class MethodSpec:
    """A registered name: its method class, and for a variant the config keys it fixes."""

    name: str
    method: type[Method]
    summary: str
    #: config keys the entry fixes (a variant's Params)
    overrides: Mapping[str, Value] = field(default_factory=dict)
    variant_of: str | None = None

    @property
    def paper(self) -> str:
        return self.method.paper

    @property
    def has_global_model(self) -> bool:
        return self.method.has_global_model

    @property
    def needs_batch_norm(self) -> bool:
        return self.method.needs_batch_norm

    @property
    def local_optimizer(self) -> bool:
        return self.method.local_optimizer

    @property
    def search_space(self) -> dict[str, Search]:
        """Config key -> the values ``--tune`` may try: the shared local-training keys the method
        tunes (``lr`` for most), then its own Params' searches; keys the spec fixes (a variant's)
        are not searched."""
        space = self.method.search_space(self.overrides)
        return {k: v for k, v in space.items() if k not in self.overrides}

    def build(self, settings: Mapping[str, Value]) -> Method:
        """The method with its ``Params`` read from a validated config."""
        return self.method(self.method.Params.from_settings(settings))


def method(cls: type[Method]) -> MethodSpec:
    """A method under its own name."""
    return MethodSpec(cls.name, cls, cls.summary)


def variant(name: str, cls: type[Method], summary: str, **fixed: Any) -> MethodSpec:
    """``cls`` with some of its Params fixed (by field name), registered as ``name``."""
    keys = cls.Params.keys()
    return MethodSpec(name, cls, summary, overrides={keys[k]: v for k, v in fixed.items()},
                      variant_of=cls.name)


METHODS: dict[str, MethodSpec] = {spec.name: spec for spec in (
    method(FedAvg),
    method(FedAvgFineTune),
    method(Local),
    method(FedProx),
    method(Scaffold),
    method(Ditto),
    method(FedPer),
    method(FedRep),
    method(FedBN),
    method(APFL),
    method(PerFedAvg),
    method(PFedMe),
    method(FedALA),
    method(FedDyn),
    method(FedCP),
    method(GPFL),
    method(FedDBE),
    method(PFLAlignMethod),
    variant("pflalign-noprecond", PFLAlignMethod, "pFLAlign without the preconditioner (raw "
            "gradient, SGD rate 'lr').", precondition=False),
    variant("pflalign-gamma0", PFLAlignMethod, "pFLAlign with gamma = 0 (the offset is kept).",
            gamma="zero"),
    variant("pflalign-gamma05", PFLAlignMethod, "pFLAlign with gamma = 1/2.", gamma="half"),
    variant("pflalign-gamma1", PFLAlignMethod, "pFLAlign with gamma = 1 (the offset is removed "
            "over the round).", gamma="one"),
    variant("pflalign-hardgamma", PFLAlignMethod, "pFLAlign with gamma = 1/2 + 1/2 "
            "sign(m Delta).", gamma="hard"),
    variant("pflalign-nopersonal", PFLAlignMethod, "pFLAlign with Delta = 0 (no personalized "
            "initialization, no correction).", personalize=False),
    variant("pflalign-genie", PFLAlignMethod, "pFLAlign's federation (personalized "
            "initialization and offsets) with GENIE as the local update, its state persistent "
            "per client (docs/algorithms.md 4.2).", local_update="genie"),
    variant("pflalign-sgd", PFLAlignMethod, "pFLAlign with P = 1 and Delta = 0: FedAvg with "
            "plain SGD.", precondition=False, personalize=False),
)}




def method_overrides(spec: MethodSpec, model: str,
                     entry_overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The config changes a method entry runs with: the spec's fixed keys, the entry's own, and
    for a method that needs batch norm the batch-norm version of the run's ``model`` when it has
    none."""
    overrides = {**spec.overrides, **entry_overrides}
    model = overrides.get("model", model)
    registered = MODELS.get(str(model))
    if (spec.needs_batch_norm and "model" not in entry_overrides and registered is not None
            and registered.batch_norm_version):
        overrides["model"] = model = registered.batch_norm_version
        registered = MODELS[model]
    if spec.needs_batch_norm and is_user_model(str(model)):
        return overrides  # the method refuses, when it is built, a user's model without any
    if spec.needs_batch_norm and not (registered is not None and registered.batch_norm):
        with_norm = ", ".join(name for name, m in MODELS.items() if m.batch_norm)
        raise ConfigError(f"Method '{spec.name}' needs a model with batch norm; model '{model}' "
                          f"has none: choose one of {with_norm}.")
    return overrides
