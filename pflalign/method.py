"""The engine-free method interface: a method's rules and state, and nothing about how they run.

A method is one class in one file (``pflalign/methods/<name>.py``) with

- ``Params``: a frozen dataclass of its hyperparameters (:mod:`pflalign.params`);
- ``ClientState`` and ``ServerState``: dataclasses of what a client and the server keep between
  rounds, each flattening to ``dict[str, ndarray]`` (:mod:`pflalign.state`);
- client rules: :meth:`Method.train` (given what the server sent and my state, train; return the
  upload and my new state) and :meth:`Method.evaluate` (which model scores this client);
- server rules: :meth:`Method.train_payload` / :meth:`Method.eval_payload` (what client i
  receives) and :meth:`Method.aggregate` (how the uploads update the server state), each FedAvg's
  by default.

Engines (:mod:`pflalign.engines`) call these rules; they hold no learning logic, and a method
never sees an engine. A variant (an ablation) is a registered method with some config keys fixed
(:mod:`pflalign.methods`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

from pflalign.aggregation import FlatSpec, State
from pflalign.client import ClientRuntime, Received, Upload
from pflalign.options import Value
from pflalign.params import NoParams, Params
from pflalign.protocol import MODEL
from pflalign.state import ArrayState, NoClientState, ServerState

if TYPE_CHECKING:  # the server's view, for type hints only (it imports this module)
    from pflalign.cohort import Cohort
    from pflalign.server import ServerRuntime

P = TypeVar("P", bound=Params)
C = TypeVar("C", bound=ArrayState)
S = TypeVar("S", bound=ServerState)


@dataclass
class Payload:
    """What the server sends one client for one action: named array records (NumPy state dicts;
    :data:`~pflalign.protocol.MODEL` is the model) and per-client config entries."""

    arrays: dict[str, State] = field(default_factory=dict)
    config: dict[str, Value] = field(default_factory=dict)


@dataclass
class Update:
    """A validated training reply, as the server rule sees it."""

    client: int
    num_examples: float
    metrics: dict[str, float]
    #: the uploaded model (its shared entries), None when the method uploads none
    model: State | None
    #: further validated array records (e.g. SCAFFOLD's control-variate change)
    arrays: dict[str, State] = field(default_factory=dict)


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
    #: shared local-training keys (:class:`~pflalign.train.LocalTraining`) whose search spaces
    #: ``--tune`` adds to the method's own Params' (empty for a method with its own step size)
    tuned_training: ClassVar[tuple[str, ...]] = ("lr",)
    #: client metrics averaged over the round's clients into the round's row
    client_diagnostics: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def search_space(cls, fixed: Mapping[str, Value]) -> dict[str, tuple[Value, ...]]:
        """Config key -> the values ``--tune`` may try: the shared local-training keys in
        :attr:`tuned_training`, then the Params' own searches. ``fixed`` holds the keys a variant
        fixes (a method whose step size depends on them overrides this)."""
        from pflalign.train import LocalTraining

        shared = LocalTraining.search_space()
        return {**{k: shared[k] for k in cls.tuned_training}, **cls.Params.search_space()}

    def __init__(self, params: P):
        self.params = params

    # --- client rules --------------------------------------------------------------------------
    def train(self, client: ClientRuntime, received: Received, state: C) -> tuple[Upload, C]:
        """One round of local training: the upload and the client's new state."""
        raise NotImplementedError

    def evaluate(self, client: ClientRuntime, received: Received, state: C,
                 ) -> dict[str, float | int]:
        """Score this client's model(s): :meth:`ClientRuntime.eval_metrics` and any extras."""
        raise NotImplementedError

    # --- batched client rules (the batched engine; optional) ----------------------------------
    def train_cohort(self, cohort: Cohort, received: Sequence[Received], states: Sequence[C],
                     ) -> list[tuple[Upload, C]]:
        """:meth:`train` for every client of ``cohort`` at once (``received[i]`` and
        ``states[i]`` are client ``cohort.clients[i]``'s): the same uploads and states, computed
        on stacked models (:mod:`pflalign.cohort`). A method without it runs one client at a time
        on the batched engine."""
        raise NotImplementedError

    def evaluate_cohort(self, cohort: Cohort, received: Sequence[Received],
                        states: Sequence[C]) -> list[dict[str, float | int]]:
        """:meth:`evaluate` for every client of ``cohort``, with the same metrics."""
        raise NotImplementedError

    def cohort_unsupported(self) -> str | None:
        """Why this method (with its Params) cannot run its client rules as a cohort; None when
        it can. The batched rules count only when defined by the class that defines the
        per-client ones (a subclass that changes :meth:`train` does not inherit a batched rule
        that no longer matches it)."""
        return self.missing_batched_rule()

    @classmethod
    def missing_batched_rule(cls) -> str | None:
        """Why the class has no batched rules (None when it has both)."""
        for rule in ("train", "evaluate"):
            if _owner(cls, rule) is not _owner(cls, f"{rule}_cohort"):
                return f"it has no batched {rule} rule: {rule}_cohort"
        if cls.needs_batch_norm:
            return "it needs batch norm, whose statistics the cohort does not keep per client"
        return None

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
        round's row (default: FedAvg by num-examples, ALGORITHMS.md 1.6)."""
        new = server.average([u.model for u in updates], [u.num_examples for u in updates])
        return server.with_model(state, new), {}

    def round_diagnostics(self, server: ServerRuntime, state: S) -> dict[str, float]:
        """Extra per-round metrics recorded after aggregation (default: none)."""
        return {}



def _owner(cls: type, name: str) -> type | None:
    """The class in ``cls``'s method resolution order that defines ``name``."""
    return next((c for c in cls.__mro__ if name in vars(c)), None)
