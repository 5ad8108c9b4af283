"""The engine-free method interface: a method's rules and state, and nothing about how they run.

A method is one class in one file (``pflalign/methods/<name>.py``) with

- ``Params``: a frozen dataclass of its hyperparameters (:mod:`pflalign.settings.params`);
- ``ClientState`` and ``ServerState``: dataclasses of what a client and the server keep between
  rounds, each flattening to ``dict[str, ndarray]`` (:mod:`pflalign.wire.state`);
- client rules, written once: :meth:`Method.train` (given what the server sent and my state,
  train; return the upload and my new state) and :meth:`Method.evaluate` (which model scores this
  client). Each is a generator that yields its runs of local training
  (:class:`~pflalign.training.runs.LocalRun`, with its own objective when the method trains on
  more than the model's cross-entropy: :mod:`pflalign.training.objectives`) and receives their
  results; a rule that trains nothing (most evaluations) may be a plain function;
- server rules: :meth:`Method.train_payload` / :meth:`Method.eval_payload` (what client i
  receives) and :meth:`Method.aggregate` (how the uploads update the server state), each FedAvg's
  by default;
- :meth:`Method.check`: the configurations it refuses, before any data is read.

Engines (:mod:`pflalign.run.driver`) call these rules and execute the local runs, one client at a
time or a cohort together; they hold no learning logic, and a method never sees an engine. A
variant (an ablation) is a registered method with some config keys fixed
(:mod:`pflalign.methods.registry`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Generic, TypeVar

from torch import nn

from pflalign.models.language import is_language_model
from pflalign.server.aggregation import FlatSpec
from pflalign.server.runtime import ServerRuntime
from pflalign.settings.options import ConfigError, Value
from pflalign.settings.params import NoParams, Params, Search
from pflalign.settings.schema import LocalTraining, Settings
from pflalign.training.client import ClientRuntime
from pflalign.training.runs import Rule
from pflalign.wire.messages import Payload, Received, Update
from pflalign.wire.protocol import (
    EVAL_METRICS,
    EVALUATE,
    GLOBAL_EVAL_METRICS,
    MODEL,
    TRAIN,
    TRAIN_METRICS,
    Metric,
)
from pflalign.wire.state import ArrayState, NoClientState, ServerState, State

P = TypeVar("P", bound=Params)
C = TypeVar("C", bound=ArrayState)
S = TypeVar("S", bound=ServerState)


class Method(Generic[P, C, S]):
    """Base of every method: FedAvg's server rules; client rules left to the method."""

    name: ClassVar[str]
    summary: ClassVar[str]
    paper: ClassVar[str]
    Params: ClassVar[type] = NoParams
    ClientState: ClassVar[type] = NoClientState
    ServerState: ClassVar[type] = ServerState
    #: global-acc is reported (the method has a global model that can score a client)
    has_global_model: ClassVar[bool] = True
    #: the run's model is swapped for its batch-norm version (``cnn`` -> ``cnn-bn``)
    needs_batch_norm: ClassVar[bool] = False
    #: local training takes ``local-optimizer`` (false: the method has its own rule)
    local_optimizer: ClassVar[bool] = True
    #: clients upload their model after training
    uploads_model: ClassVar[bool] = True
    #: the server update is an average of client models, so ``aggregation`` (mean, trimmed-mean,
    #: median) applies to it (false for server updates such as SCAFFOLD's and FedDyn's)
    robust_aggregation: ClassVar[bool] = True
    #: the method can run ``mode = async`` (FedBuff, :mod:`pflalign.server.buffered`): its server
    #: update is an average of uploaded models, so an update from an older global model can be
    #: rebased onto the current one and weighted by its staleness (false for server rules that
    #: keep running corrections, mix, or learn from the round's cohort as a whole)
    asynchronous: ClassVar[bool] = False
    #: the method can run under ``dp`` (docs/privacy.md): everything its clients upload is the
    #: exchanged model, and its server rule uses the uploads only through their average, which
    #: DP-FedAvg's clipped, noised mean then replaces; else :attr:`not_private` says why not
    private: ClassVar[bool] = False
    not_private: ClassVar[str] = "its server rule is not an average of uploaded models"
    #: the method can run ``task = regression`` (a model with one output and the mean squared
    #: error); else :attr:`not_regression` says why not
    regression: ClassVar[bool] = True
    not_regression: ClassVar[str] = ""
    #: shared local-training keys (:class:`~pflalign.training.loops.LocalTraining`) whose search
    #: spaces ``--tune`` adds to the method's own Params' (empty for a method with its own step
    #: size)
    tuned_training: ClassVar[tuple[str, ...]] = ("lr",)
    #: the metrics of its training replies beyond :data:`~pflalign.wire.protocol.TRAIN_METRICS`,
    #: and of its evaluation replies beyond :data:`~pflalign.wire.protocol.EVAL_METRICS` (and
    #: ``GLOBAL_EVAL_METRICS`` with a global model): a reply carrying another is rejected
    train_metrics: ClassVar[Mapping[str, Metric]] = {}
    eval_metrics: ClassVar[Mapping[str, Metric]] = {}
    #: the training metrics averaged over the round's clients into the round's row (derived:
    #: those of :attr:`train_metrics` marked ``diagnostic``)
    client_diagnostics: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.client_diagnostics = tuple(k for k, m in cls.train_metrics.items() if m.diagnostic)

    def reply_metrics(self, action: str) -> dict[str, Metric]:
        """Every metric a reply of ``action`` (train or evaluate) may carry, with its range."""
        if action == TRAIN:
            return {**TRAIN_METRICS, **self.train_metrics}
        if action == EVALUATE:
            return {**EVAL_METRICS, **(GLOBAL_EVAL_METRICS if self.has_global_model else {}),
                    **self.eval_metrics}
        raise ValueError(f"no reply metrics are declared for the action {action!r}")
    #: the method works on the features a classifier head receives (its input vector per
    #: sample), which a language model's next-token head does not have one of
    feature_head: ClassVar[bool] = False
    #: the method splits the model into a body and a linear head
    #: (:func:`~pflalign.models.registry.head_of`); every feature-head method does
    needs_head: ClassVar[bool] = False

    @classmethod
    def search_space(cls, fixed: Mapping[str, Value]) -> dict[str, Search]:
        """Config key -> the values ``--tune`` may try: the shared local-training keys in
        :attr:`tuned_training`, then the Params' own searches. ``fixed`` holds the keys a variant
        fixes (a method whose step size depends on them overrides this)."""
        shared = LocalTraining.search_space()
        return {**{k: shared[k] for k in cls.tuned_training}, **cls.Params.search_space()}

    def __init__(self, params: P):
        self.params = params

    @classmethod
    def hyperparameters(cls, settings: Settings) -> dict[str, Value]:
        """The values of the config keys this method's rules read, as a run resolved them
        (``settings``: the entry's own): the local work (batch size, epochs, steps, the step
        size it tunes), the local optimizer and its keys where the method takes one, then its
        own Params. Written per method into results.json (``hyperparameters``) for the report."""
        training = settings.training
        local = {key: getattr(training, name) for name, key in LocalTraining.keys().items()}
        keys = ["batch-size", "local-epochs", "local-steps", *cls.tuned_training]
        if cls.local_optimizer:
            keys += ["local-optimizer", *{
                "sgd": ["momentum"], "adam": ["adam-lr"], "adamw": ["adam-lr"],
                "genie": [k for k in local if k.startswith("genie-")],
            }[training.local_optimizer], "weight-decay"]
        params = cls.Params.from_settings(settings)
        own = {key: getattr(params, name) for name, key in cls.Params.keys().items()}
        return {**{key: local[key] for key in dict.fromkeys(keys)}, **own}

    @classmethod
    def check(cls, settings: Settings) -> None:
        """Refuse, in one :class:`~pflalign.settings.options.ConfigError` sentence, a configuration
        this method cannot run (``settings``: a method entry's own, its overrides applied); the
        config parser calls it for every entry before any data is read. The default refuses a robust
        ``aggregation`` for a server update that is not an average of models, and a
        ``local-optimizer`` other than sgd for a method with its own local rule."""
        if cls.feature_head and is_language_model(settings.run.model):
            raise ConfigError(f"{cls.name} cannot run on a language model (model = "
                              f"{settings.run.model!r}): it works on the feature vector a "
                              "classifier head receives per sample, and a causal LM predicts "
                              "every token; choose another method for it.")
        aggregation = settings.run.aggregation
        if aggregation != "mean" and not cls.robust_aggregation:
            raise ConfigError(f"aggregation = {aggregation!r} is not defined for {cls.name}: its "
                              "server update is not an average of models; use aggregation = "
                              f"'mean' for it, e.g. '{cls.name}(aggregation=mean)'.")
        if settings.run.mode == "async":
            if not cls.asynchronous:
                raise ConfigError(f"{cls.name} cannot run mode = 'async': its server update is "
                                  "not an average of uploaded models that an update from an "
                                  "older model can be rebased into (docs/systems.md lists the "
                                  "methods that can); run it with mode = 'sync', or leave "
                                  "it out of this run.")
            if settings.gga.enabled:
                raise ConfigError("gga = true anneals the global model before each synchronous "
                                  "round's training, and mode = 'async' has no such rounds: "
                                  "set gga = false or mode = 'sync'.")
        clip = settings.run.update_clip
        if clip > 0 and settings.run.dp != "off":
            raise ConfigError(f"update-clip = {clip:g} and dp = {settings.run.dp!r} both clip the "
                              "updates: dp-clip bounds them under dp; remove update-clip.")
        if clip > 0 and settings.run.mode == "async":
            raise ConfigError(f"update-clip = {clip:g} clips the updates of a synchronous round "
                              "against the round's median, and mode = 'async' has no such "
                              "rounds: remove it or set mode = 'sync'.")
        if settings.run.task == "regression" and not cls.regression:
            raise ConfigError(f"{cls.name} cannot run task = 'regression': "
                              f"{cls.not_regression}; leave it out of this run.")
        if settings.run.dp != "off":
            if not cls.private:
                raise ConfigError(f"{cls.name} cannot run dp = {settings.run.dp!r}: "
                                  f"{cls.not_private}, so no clipped, noised mean can stand for "
                                  "its uploads (docs/privacy.md lists the methods that can); "
                                  "leave it out of this run.")
            if aggregation != "mean" and settings.run.dp in ("central", "distributed"):
                raise ConfigError(f"aggregation = {aggregation!r} cannot run under dp = "
                                  f"{settings.run.dp!r}: DP-FedAvg releases a noised sum of "
                                  "clipped updates, and a robust rule (a trimmed mean, a median, "
                                  "Krum, ...) is no sum (the clip bounds each client's influence "
                                  "instead); "
                                  "use aggregation = 'mean'.")
        if settings.run.secure_aggregation != "off":
            cls.check_secure(settings)
        optimizer = settings.training.local_optimizer
        if not cls.local_optimizer and optimizer != "sgd":
            raise ConfigError(f"local-optimizer = {optimizer!r} does not apply to {cls.name} "
                              "(own local update rule); set it per method instead, e.g. "
                              "'fedavg(local-optimizer=genie)', or use pflalign-genie.")

    @classmethod
    def check_secure(cls, settings: Settings) -> None:
        """Refuse, in one sentence, what cannot run beside secure aggregation: a method whose
        server reads more than the mean upload, and every feature that reads one upload."""
        run, why = settings.run, "the server sees only the sum of a round's updates"
        if not cls.private:
            raise ConfigError(f"{cls.name} cannot run secure-aggregation = "
                              f"{run.secure_aggregation!r}: {cls.not_private}, and {why}; leave "
                              "it out of this run.")
        refusals = [
            (run.aggregation != "mean", f"aggregation = {run.aggregation!r} reads each upload"),
            (run.update_clip > 0, f"update-clip = {run.update_clip:g} scales each upload (the "
                                  "clip of secagg-clip bounds every coordinate instead)"),
            (run.train_audit_fraction > 0, f"train-audit-fraction = "
                                           f"{run.train_audit_fraction:g} recomputes each upload"),
            (run.dp == "central" and run.dp_clipping == "adaptive",
             "dp-clipping = 'adaptive', which counts the clipped uploads one by one (a fixed "
             "dp-clip is applied by each client before it masks its update)"),
            (run.mode == "async", "mode = 'async' aggregates single arrivals"),
            (run.over_selection > 1 or run.round_deadline > 0,
             "over-selection and round-deadline choose among the round's uploads"),
            (settings.gga.enabled, "gga = true is not run beside it")]
        for refused, reason in refusals:
            if refused:
                raise ConfigError(f"secure-aggregation = {run.secure_aggregation!r} cannot run "
                                  f"with {reason}: {why}.")

    # --- what a client's evaluation scores (save-models) ----------------------------------------
    def scored_module(self, model: nn.Module, num_classes: int) -> nn.Module:
        """A module of the form :meth:`evaluate` scores as a client's personal model, around
        ``model`` (a fresh copy of the run's model; ``num_classes``: the task's): the model
        itself, or the method's own wrapper (FedDBE's, GPFL's, FedCP's). A saved client model
        (:mod:`pflalign.round.features.models`) is loaded into it."""
        return model

    def saved_keys(self, model: nn.Module, num_classes: int) -> tuple[str, ...]:
        """The state-dict entries of a saved client model (:meth:`scored_module` around
        ``model``): all but frozen parameters (a language model's base weights, which the run's
        model rebuilds). Computed once per method and model shape."""
        scored = self.scored_module(model, num_classes)
        frozen = {k for k, p in scored.named_parameters() if not p.requires_grad}
        return tuple(k for k in scored.state_dict() if k not in frozen)

    # --- client rules --------------------------------------------------------------------------
    def train(self, client: ClientRuntime, received: Received, state: C) -> Rule:
        """One round of local training; its result is the upload and the client's new state."""
        raise NotImplementedError

    def evaluate(self, client: ClientRuntime, received: Received, state: C) -> Rule:
        """Score this client's model(s); its result is :meth:`ClientRuntime.eval_metrics` and
        any extras."""
        raise NotImplementedError

    # --- server rules --------------------------------------------------------------------------
    def personal_keys(self, server: ServerRuntime) -> tuple[str, ...]:
        """Model entries that stay on the clients: never sent, uploaded or averaged."""
        return ()

    def init_server(self, server: ServerRuntime, model: State) -> S:
        """The server state before round 1, from the run's initial model."""
        return self.ServerState(model=model)

    def train_payload(self, server: ServerRuntime, state: S, client: int,
                      server_round: int) -> Payload:
        """What ``client`` receives for training (default: the global model)."""
        return Payload({MODEL: server.shared_model(state)})

    def eval_payload(self, server: ServerRuntime, state: S, client: int,
                     server_round: int) -> Payload:
        """What ``client`` receives for evaluation (default: the global model)."""
        return Payload({MODEL: server.shared_model(state)})

    def eval_clients(self, server: ServerRuntime) -> list[int]:
        """Clients evaluated (default: every client, unseen ones included)."""
        return sorted(server.clients)

    def reply_arrays(self, server: ServerRuntime) -> dict[str, FlatSpec]:
        """Array records a training reply carries beside the model, with their specs."""
        return {}

    def aggregate(self, server: ServerRuntime, state: S, server_round: int,
                  updates: Sequence[Update]) -> tuple[S, dict[str, float]]:
        """The new server state from the round's validated updates, and diagnostics for the
        round's row (default: FedAvg by num-examples, docs/algorithms.md 1.6)."""
        new = server.average([u.model for u in updates], [u.num_examples for u in updates])
        return server.with_model(state, new), {}

    def round_diagnostics(self, server: ServerRuntime, state: S) -> dict[str, float]:
        """Extra per-round metrics recorded after aggregation (default: none)."""
        return {}
