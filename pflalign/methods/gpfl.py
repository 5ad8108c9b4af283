"""GPFL (Zhang, Hua, Wang, Song, Xue, Ma, Guan, GPFL: Simultaneously Learning Global and
Personalized Feature Information for Personalized Federated Learning, ICCV 2023, arXiv
2308.10279).

The model splits into a feature extractor ``phi`` (every layer but the last, shared) and a head
(the last layer, personal). Two shared modules join them:

- the Conditional Valve (CoV, ``V``; Eqs. 3-4): two branches ``Linear(K, K) -> ReLU ->
  LayerNorm(K)`` computing ``gamma(c)`` and ``beta(c)`` from a conditional input ``c``, and
  ``CoV(f, c) = ReLU(f * (gamma(c) + 1) + beta(c))`` (:class:`ConditionalValve`);
- the Global Category Embedding (GCE, ``C``): one ``K``-vector per class
  (:class:`CategoryEmbedding`).

Conditional inputs (Eqs. 5-7), from the GCE ``C^`` the client received this round, held fixed:
``g = (1/U) sum_u C^[u]`` and ``p_i = (1/U) sum_u alpha_i^u C^[u]`` with ``alpha_i^u`` the share of
class ``u`` in the client's train split (:func:`conditional_inputs`). For features ``f = phi(x)``
the personalized feature ``f^P = CoV(f, p_i)`` goes to the head, the global one
``f^G = CoV(f, g)`` only into the losses. The local objective (Eqs. 8-11) is

    ``CE(head(f^P), y) + L_alg + lambda L_mlg + mu (||V||^2 + ||C||^2) / 2``

with the angle-level guidance ``L_alg = -log softmax_u(cos(f^G, C[u]))[y]`` on the trained GCE and
the magnitude-level guidance ``L_mlg = ||f^G - C^[y]||_2`` towards the received one, each averaged
over the batch (:func:`guidance_losses`). Everything trains with SGD at ``lr`` (the run's
momentum and weight decay for the extractor and the head; weight decay ``gpfl-mu`` for the CoV
and the GCE). The client keeps its head and uploads the extractor, the CoV (record ``cov``) and
the GCE (record ``gce``); the server averages each by sample count.

``personal-acc`` scores ``head(CoV(phi(x), p_i))`` with the received extractor, CoV and GCE and
the client's own head. A client without a head yet (a new client) fits the run's initial head on
that route for ``finetune-epochs`` (the extractor and CoV frozen), as FedPer's and FedRep's new
clients do; there is no global model to score (no global head).

Where the paper and the authors' code differ: this follows the paper for the conditional inputs
(the ``1/U`` in ``p_i``; both from the received GCE, from the first round on, where the code uses
each client's own GCE from before the new aggregate arrives, and zeros before the first) and for
``L_mlg`` (each sample's L2 distance, averaged; the code takes one Frobenius norm over the batch).
It follows the code for the regularizer: weight decay ``mu`` on every CoV and GCE parameter
(``mu/2`` squared norms; the paper writes ``mu ||V||_2 + mu ||C||_2``). ``gpfl-lambda`` = 0.01 and
``gpfl-mu`` = 0.1 are the authors' setting for the 4-layer CNN.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from pflalign.methods.base import Method
from pflalign.methods.partial import PartialParams
from pflalign.models.registry import head_keys, head_of, without_head
from pflalign.process.caches import cached
from pflalign.server.aggregation import FlatSpec
from pflalign.server.runtime import ServerRuntime
from pflalign.settings.params import choice, log_range, param
from pflalign.training.client import ClientRuntime
from pflalign.training.corrections import Entries
from pflalign.training.loops import STREAM_FINETUNE, derive_seed
from pflalign.training.objectives import (
    ModelCall,
    Objective,
    Step,
    batch_mean,
    cross_entropy,
    prefixed,
    with_prefix,
)
from pflalign.training.optimizers import EntryGroup, SGDGroups
from pflalign.training.runs import LocalRun, Rule
from pflalign.wire.messages import Payload, Received, Update, Upload
from pflalign.wire.protocol import LOCAL_STEPS, MODEL, TRAIN_LOSS, Metric
from pflalign.wire.state import ArrayState, ServerState, State, TorchState

COV, GCE = "cov", "gce"
_MODULE_STREAM = 0x6F1


class ConditionalValve(nn.Module):
    """GPFL's CoV: ``ReLU(f * (gamma(c) + 1) + beta(c))`` with ``gamma`` and ``beta`` each
    ``Linear(K, K) -> ReLU -> LayerNorm(K)`` of the conditional input ``c`` (one per batch)."""

    def __init__(self, features: int):
        super().__init__()
        self.gamma = nn.Sequential(nn.Linear(features, features), nn.ReLU(),
                                   nn.LayerNorm(features))
        self.beta = nn.Sequential(nn.Linear(features, features), nn.ReLU(),
                                  nn.LayerNorm(features))

    def forward(self, features: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        return F.relu(features * (self.gamma(condition) + 1) + self.beta(condition))


class CategoryEmbedding(nn.Module):
    """GPFL's GCE: one ``K``-vector per class (``weight``, ``U x K``), initialised N(0, 1)."""

    def __init__(self, classes: int, features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(classes, features))


def new_modules(classes: int, features: int, seed: int) -> tuple[ConditionalValve,
                                                                 CategoryEmbedding]:
    """The run's initial CoV and GCE (seeded: the same on the server and every client)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, _MODULE_STREAM))
        return ConditionalValve(features), CategoryEmbedding(classes, features)


def conditional_inputs(embedding: torch.Tensor, labels: torch.Tensor,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``g = (1/U) sum_u C[u]`` and ``p_i = (1/U) sum_u alpha_i^u C[u]`` (Eqs. 5-7), with
    ``alpha_i`` the class shares of ``labels``; detached."""
    classes = embedding.shape[0]
    alpha = torch.bincount(labels, minlength=classes).to(embedding) / max(len(labels), 1)
    embedding = embedding.detach()
    return embedding.sum(dim=0) / classes, (alpha[:, None] * embedding).sum(dim=0) / classes


def guidance_losses(global_features: torch.Tensor, embedding: torch.Tensor,
                    received: torch.Tensor, labels: torch.Tensor,
                    mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``L_alg`` (Eq. 8: the cross-entropy of the cosines between each ``f^G`` and every class
    embedding of the trained GCE) and ``L_mlg`` (Eq. 9: each ``f^G``'s L2 distance to its class
    in the received GCE), each averaged over the batch (its masked-in samples)."""
    cosines = F.normalize(global_features, dim=1) @ F.normalize(embedding, dim=1).T
    alg = cross_entropy(cosines, labels, mask)
    mlg = batch_mean((global_features - received[labels].detach()).norm(dim=1), mask)
    return alg, mlg


class GPFLModel(nn.Module):
    """``head(CoV(phi(x), p_i))``: a client's GPFL model as one module, for the evaluation
    loop."""

    def __init__(self, model: nn.Module, valve: ConditionalValve, personal: torch.Tensor):
        super().__init__()
        self.model, self.valve = model, valve
        self.register_buffer("personal", personal)  # in the state dict: a saved model keeps it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with without_head(self.model):
            features = self.model(x)
        return head_of(self.model)[1](self.valve(features, self.personal))


@dataclass(frozen=True)
class GuidedObjective(Objective):
    """A GPFL client's round (Eqs. 8-11): ``CE(head(f^P), y) + L_alg + lambda L_mlg``, the CoV
    (``cov.*``) and the GCE (``gce.*``) trained as the run's extra tensors (their weight decay,
    the ``mu`` term, is the optimizer's); ``inputs`` holds ``g``, ``p_i`` and the received GCE
    ``C^``, ``valve`` the CoV's structure. ``L_alg`` and ``L_mlg`` are reported as the
    diagnostics ``alg`` and ``mlg``."""

    inputs: Entries
    valve: ConditionalValve
    lambda_: float

    def loss(self, model: ModelCall, params: Mapping[str, torch.Tensor], extras: Entries,
             state: Entries, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None,
             ) -> Step:
        features = model.features(params, x)
        cov = prefixed(extras, COV)

        def valve(f: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
            return functional_call(self.valve, cov, (f, condition))

        ce = cross_entropy(model.head(params, valve(features, self.inputs["personal"])), y, mask)
        alg, mlg = guidance_losses(valve(features, self.inputs["global"]),
                                   extras[f"{GCE}.weight"], self.inputs["received"], y, mask)
        return Step(ce + alg + self.lambda_ * mlg, ce, {"alg": alg, "mlg": mlg})


@dataclass(frozen=True)
class ValvedObjective(Objective):
    """A new client's head fit: the cross-entropy of ``head(CoV(phi(x), p_i))`` with the
    received CoV (``valve_state``, fixed) and ``p_i`` (``inputs["p"]``)."""

    valve_state: Entries
    inputs: Entries
    valve: ConditionalValve

    def loss(self, model: ModelCall, params: Mapping[str, torch.Tensor], extras: Entries,
             state: Entries, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None,
             ) -> Step:
        routed = functional_call(self.valve, prefixed(self.valve_state, COV),
                                 (model.features(params, x), self.inputs["p"]))
        ce = cross_entropy(model.head(params, routed), y, mask)
        return Step(ce, ce)


@cached(maxsize=None)
def _module_specs(classes: int, features: int) -> tuple[FlatSpec, FlatSpec]:
    """The layouts of a CoV's and a GCE's state (what a reply's records must match)."""
    with torch.device("meta"):
        valve, embedding = ConditionalValve(features), CategoryEmbedding(classes, features)
    return tuple(FlatSpec.of({k: np.empty(tuple(v.shape), dtype=np.float32)
                              for k, v in m.state_dict().items()})
                 for m in (valve, embedding))  # type: ignore[return-value]


@dataclass(frozen=True)
class GPFLParams(PartialParams):
    prefix = "gpfl"
    group = "gpfl"

    lambda_: float = param(0.01, "Weight lambda of the magnitude-level guidance ||f^G - "
                           "C^[y]||_2 (the authors' value for the 4-layer CNN).", minimum=0.0,
                           search=log_range(0.001, 0.1))
    mu: float = param(0.1, "Weight decay mu of the conditional valve and the category "
                      "embedding (the authors' value for the 4-layer CNN).", minimum=0.0,
                      search=choice(0.0, 0.1, 1.0))


@dataclass
class GPFLClientState(ArrayState):
    #: the personal head (the run's initial head until the client first trains)
    head: TorchState | None = None


@dataclass
class GPFLServerState(ServerState):
    #: the global conditional valve V and category embedding C
    cov: State = dataclasses.field(default_factory=dict)
    gce: State = dataclasses.field(default_factory=dict)


class GPFL(Method):
    name = "gpfl"
    regression = False
    not_regression = ("it learns one embedding per class (its GCE) and conditions each client on "
                      "its class shares, and a regression has no classes")
    feature_head = True
    summary = ("Global and personalized features from one extractor through a conditional valve "
               "steered by a global category embedding; personal heads, the rest averaged.")
    paper = ("Zhang et al., GPFL: Simultaneously Learning Global and Personalized Feature "
             "Information for Personalized Federated Learning, ICCV 2023")
    Params = GPFLParams
    not_private = ("its clients upload the conditional valves and category embeddings beside "
                   "the model, which the server averages as separate records outside "
                   "DP-FedAvg's one clipped update")
    ClientState = GPFLClientState
    ServerState = GPFLServerState
    has_global_model = False
    local_optimizer = False
    #: L_alg (a cross-entropy over the class embeddings) and L_mlg (a mean L2 distance)
    train_metrics = {"alg": Metric(loss=True, diagnostic=True), "mlg": Metric(diagnostic=True)}

    def personal_keys(self, server: ServerRuntime) -> tuple[str, ...]:
        return head_keys(server.template_model())

    # --- client --------------------------------------------------------------------------------
    def _parts(self, client: ClientRuntime, received: Received, state: GPFLClientState,
               ) -> tuple[nn.Module, ConditionalValve, CategoryEmbedding, torch.Tensor,
                          torch.Tensor]:
        """The client's model (the received extractor, its own head), the received CoV and
        GCE, and its conditional inputs ``g`` and ``p_i``."""
        model = client.new_model({**client.initial_state(), **(state.head or {}),
                                  **received.model})
        valve, embedding = new_modules(client.num_classes, head_of(model)[1].in_features,
                                       client.seed)
        valve.load_state_dict(received.arrays[COV])
        embedding.load_state_dict(received.arrays[GCE])
        valve, embedding = valve.to(client.device), embedding.to(client.device)
        g, p_i = conditional_inputs(embedding.weight, client.data.train_y)
        return model, valve, embedding, g, p_i

    def train(self, client: ClientRuntime, received: Received, state: GPFLClientState,
              ) -> Rule:
        t, p = client.training, self.params
        model, valve, embedding, g, p_i = self._parts(client, received, state)
        result = yield LocalRun(
            model.state_dict(), objective=GuidedObjective(
                {"global": g, "personal": p_i, "received": embedding.weight.detach()}, valve,
                p.lambda_),
            extras={**with_prefix(valve.state_dict(), COV),
                    **with_prefix(embedding.state_dict(), GCE)},
            optimizer=SGDGroups(t.lr, t.momentum, t.weight_decay,
                                (EntryGroup(f"{COV}.", weight_decay=p.mu),
                                 EntryGroup(f"{GCE}.", weight_decay=p.mu))))
        personal = set(head_keys(model))
        stats = result.stats
        upload = Upload({k: v for k, v in result.model.items() if k not in personal},
                        {TRAIN_LOSS: stats.loss, LOCAL_STEPS: stats.steps, **stats.metrics},
                        arrays={COV: prefixed(result.extras, COV),
                                GCE: prefixed(result.extras, GCE)})
        return upload, GPFLClientState({k: v for k, v in result.model.items() if k in personal})

    def scored_module(self, model: nn.Module, num_classes: int) -> nn.Module:
        features = head_of(model)[1].in_features
        return GPFLModel(model, ConditionalValve(features), torch.zeros(features))

    def evaluate(self, client: ClientRuntime, received: Received,
                 state: GPFLClientState) -> Rule:
        model, valve, _, _, p_i = self._parts(client, received, state)
        if state.head is None:  # a new client fits its head on the personalized route
            fitted = yield LocalRun(
                model.state_dict(), trainable=head_keys(model), stream=STREAM_FINETUNE,
                epochs=self.params.finetune_epochs,
                objective=ValvedObjective(with_prefix(valve.state_dict(), COV), {"p": p_i},
                                          valve))
            model.load_state_dict(fitted.model)
        return client.eval_metrics(client.test(GPFLModel(model, valve, p_i)))

    # --- server --------------------------------------------------------------------------------
    @staticmethod
    def _sizes(server: ServerRuntime) -> tuple[int, int]:
        head = head_of(server.template_model())[1]
        return head.out_features, head.in_features

    def init_server(self, server: ServerRuntime, model: State) -> GPFLServerState:
        valve, embedding = new_modules(*self._sizes(server), server.seed)
        return GPFLServerState(model=model, cov=_numpy(valve.state_dict()),
                               gce=_numpy(embedding.state_dict()))

    def reply_arrays(self, server: ServerRuntime) -> dict[str, FlatSpec]:
        valve, embedding = _module_specs(*self._sizes(server))
        return {COV: valve, GCE: embedding}

    def train_payload(self, server: ServerRuntime, state: GPFLServerState, client: int,
                      server_round: int) -> Payload:
        return Payload({MODEL: server.shared_model(state), COV: state.cov, GCE: state.gce})

    eval_payload = train_payload

    def aggregate(self, server: ServerRuntime, state: GPFLServerState, server_round: int,
                  updates: Sequence[Update]) -> tuple[GPFLServerState, dict[str, float]]:
        weights = [u.num_examples for u in updates]
        valve, embedding = self.reply_arrays(server).values()
        new = server.with_model(state, server.average([u.model for u in updates], weights))
        return dataclasses.replace(
            new, cov=server.average([u.arrays[COV] for u in updates], weights, valve),
            gce=server.average([u.arrays[GCE] for u in updates], weights, embedding)), {}


def _numpy(state: Mapping[str, torch.Tensor]) -> State:
    return {k: v.detach().numpy().copy() for k, v in state.items()}
