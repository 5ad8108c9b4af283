"""FedCP (Zhang, Hua, Wang, Song, Xue, Ma, Guan, FedCP: Separating Feature Information for
Personalized Federated Learning via Conditional Policy, KDD 2023, arXiv 2307.01217).

The model splits into a feature extractor ``f`` (every layer but the last) and a head (the last
layer, ``W^hd``). Beside them each client uses a Conditional Policy Network (CPN, ``Theta``): a
linear layer ``K -> 2K``, LayerNorm over the ``2K`` units and ReLU, read as ``K x 2`` and
soft-maxed over the two slots for every feature, which gives ``r`` and ``s = 1 - r``
(:class:`ConditionalPolicy`). For a sample with features ``h = f(x; W_i^fe)``:

- the CPN's input is ``C_i = (v_i / ||v_i||) * h`` with ``v_i`` the column sums of the client's
  personalized head weight ``W_i^hd`` (held fixed during a round; :func:`client_vector`);
- ``{r, s} = CPN(C_i)``; ``r * h`` goes to the frozen global head ``W^hd`` and ``s * h`` to the
  personalized head ``W_i^hd``; the prediction is the sum of their logits (:func:`fedcp_logits`).

Client, each round: it loads the global feature extractor, the global head (frozen) and the
global CPN, and its own personalized head (the run's initial head until it first trains). It
trains ``W_i^fe``, ``W_i^hd`` and ``Theta_i`` with the run's local optimizer on
``CE(out, y) + lambda MMD^2(f(x; W_i^fe), f(x; W^fe))``, the second extractor being a frozen copy of
the received global one (:func:`mmd2`, the biased estimate with a sum of Gaussian kernels). It
keeps ``W_i^hd`` and uploads ``W_i^fe``, ``(W^hd + W_i^hd) / 2`` as the head, and ``Theta_i``
(record ``cpn``). Server: FedAvg by sample count of the model and, separately, of the CPN.

``personal-acc`` scores the client's model as the protocol has it after the round's download: the
global feature extractor, global head and CPN with its own personalized head (the evaluation of
the authors' code); ``global-acc`` scores the global model alone (extractor and global head, no
CPN). A new client's personalized head is the run's initial head, as every client's is before
its first round.

Deviations from the authors' code, following the paper's text instead: the policy is a plain
softmax (the code draws Gumbel noise, also at test time); ``v_i`` comes from the personalized head
from the first round on (the code starts from a random vector). The MMD kernel bandwidths
(``{10, 15, 20, 50}``, ``exp(-d^2 / (2 sigma))``) are not given in the paper; these are the
authors' code's. The CPN adds ``2K^2 + 6K`` values to the traffic (527,360 for the ``cnn``'s
``K = 512``, about 90% of its model).

Its local training is one :class:`~pflalign.training.runs.LocalRun` with its own objective
(:class:`PolicyObjective`), the personalized head and the CPN as the run's extra tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from pflalign.methods.base import Method
from pflalign.models.registry import head_of, without_head
from pflalign.process.caches import cached
from pflalign.server.aggregation import FlatSpec
from pflalign.server.runtime import ServerRuntime
from pflalign.settings.params import Params, param
from pflalign.training.client import ClientRuntime
from pflalign.training.corrections import Entries
from pflalign.training.loops import derive_seed
from pflalign.training.objectives import (
    ModelCall,
    Objective,
    Step,
    cross_entropy,
    prefixed,
    with_prefix,
)
from pflalign.training.runs import LocalRun, Rule
from pflalign.wire.messages import Payload, Received, Update, Upload
from pflalign.wire.protocol import LOCAL_STEPS, MODEL, TRAIN_LOSS, Metric
from pflalign.wire.state import ArrayState, ServerState, State, TorchState

CPN, HEAD = "cpn", "head"
#: the MMD's Gaussian kernel bandwidths sigma in exp(-||u - v||^2 / (2 sigma))
BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)
_CPN_STREAM = 0xC9


class ConditionalPolicy(nn.Module):
    """The CPN: ``K -> 2K`` linear, LayerNorm, ReLU, then a softmax over two slots per feature.
    Returns ``(r, s)``, each ``batch x K``, with ``r + s = 1``."""

    def __init__(self, features: int):
        super().__init__()
        self.linear = nn.Linear(features, 2 * features)
        self.norm = nn.LayerNorm(2 * features)

    def forward(self, conditional: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.relu(self.norm(self.linear(conditional)))
        k = conditional.shape[1]
        policy = torch.softmax(torch.stack([logits[:, :k], logits[:, k:]], dim=2), dim=2)
        return policy[..., 0], policy[..., 1]


def new_policy(features: int, seed: int) -> ConditionalPolicy:
    """The run's initial CPN (seeded, the same on the server and every client)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, _CPN_STREAM))
        return ConditionalPolicy(features)


def client_vector(head_weight: torch.Tensor) -> torch.Tensor:
    """``v_i / ||v_i||`` with ``v_i`` the column sums of the personalized head's ``C x K`` weight
    (the sum of its class rows), detached: it is fixed during the round."""
    v = head_weight.detach().sum(dim=0)
    return v / v.norm()


Layer = Callable[[torch.Tensor], Any]


def fedcp_logits(features: torch.Tensor, vector: torch.Tensor, policy: Layer,
                 global_head: Layer, personal_head: Layer) -> torch.Tensor:
    """``W^hd(r * h) + W_i^hd(s * h)`` with ``{r, s} = CPN(v * h)`` (the CPN and the heads as
    modules, or as functional calls of them)."""
    r, s = policy(vector * features)
    return global_head(r * features) + personal_head(s * features)


class FedCPModel(nn.Module):
    """A client's FedCP model as one module (features, policy, both heads), so that the shared
    evaluation loop can score it."""

    def __init__(self, model: nn.Module, global_head: nn.Module, personal_head: nn.Module,
                 policy: ConditionalPolicy):
        super().__init__()
        self.model, self.global_head = model, global_head
        self.personal_head, self.policy = personal_head, policy
        # in the state dict: a saved model keeps it
        self.register_buffer("vector", client_vector(personal_head.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with without_head(self.model):
            features = self.model(x)
        return fedcp_logits(features, self.vector, self.policy, self.global_head,
                            self.personal_head)


def mmd2(x: torch.Tensor, y: torch.Tensor, bandwidths: Sequence[float] = BANDWIDTHS,
         mask: torch.Tensor | None = None) -> torch.Tensor:
    """The biased estimate of MMD^2 between the samples ``x`` and ``y`` (rows) under the kernel
    ``sum_sigma exp(-||u - v||^2 / (2 sigma))``:
    ``mean k(x, x') + mean k(y, y') - 2 mean k(x, y)``. ``mask`` (1 for a sample, 0 for
    padding; paired rows of ``x`` and ``y``) restricts the means to the masked-in rows."""
    def kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        d2 = (a.unsqueeze(1) - b.unsqueeze(0)).pow(2).sum(dim=2)  # smooth at distance 0
        return sum(torch.exp(-d2 / (2 * sigma)) for sigma in bandwidths)

    if mask is None:
        return kernel(x, x).mean() + kernel(y, y).mean() - 2 * kernel(x, y).mean()
    w = mask / mask.sum().clamp_min(1)
    return w @ kernel(x, x) @ w + w @ kernel(y, y) @ w - 2 * (w @ kernel(x, y) @ w)


@dataclass(frozen=True)
class PolicyObjective(Objective):
    """A FedCP client's round: ``CE(W^hd(r * h) + W_i^hd(s * h), y) + lambda MMD^2(h, h^g)``
    with ``h`` the trained extractor's features and ``h^g`` the received extractor's
    (``reference``, held fixed). The personalized head (``head.*``) and the CPN
    (``cpn.*``) are the run's extra tensors, ``policy`` the CPN's structure; ``vector["v"]`` is
    ``v_i / ||v_i||``. MMD^2 is reported as the diagnostic ``mmd``."""

    reference: Entries
    vector: Entries
    policy: ConditionalPolicy
    lambda_: float

    def loss(self, model: ModelCall, params: Mapping[str, torch.Tensor], extras: Entries,
             state: Entries, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None,
             ) -> Step:
        features = model.features(params, x)
        policy = prefixed(extras, CPN)
        logits = fedcp_logits(
            features, self.vector["v"],
            lambda c: functional_call(self.policy, policy, (c,)),
            lambda h: model.head(params, h),
            lambda h: model.head_with(prefixed(extras, HEAD), h))
        ce = cross_entropy(logits, y, mask)
        with torch.no_grad():
            reference = model.features({**params, **self.reference}, x)
        mmd = mmd2(features, reference, mask=mask)
        return Step(ce + self.lambda_ * mmd, ce, {"mmd": mmd})


@cached(maxsize=None)
def _policy_spec(features: int) -> FlatSpec:
    """The layout of a CPN's state (what a reply's ``cpn`` record must match)."""
    with torch.device("meta"):
        policy = ConditionalPolicy(features)
    return FlatSpec.of({k: np.empty(tuple(v.shape), dtype=np.float32)
                        for k, v in policy.state_dict().items()})


@dataclass(frozen=True)
class FedCPParams(Params):
    prefix = "fedcp"

    lambda_: float = param(0.5, "Weight lambda of the MMD between the client's features and the "
                           "received global extractor's. The authors use 5 with SGD at 0.005 "
                           "(MNIST, 4-layer CNN); 0.5 keeps their lambda x lr at this project's "
                           "lr = 0.05, where 5 makes local training unstable.", minimum=0.0)


@dataclass
class FedCPClientState(ArrayState):
    #: the personalized head W_i^hd (the run's initial head until the client first trains)
    head: TorchState | None = None


@dataclass
class FedCPServerState(ServerState):
    #: the global CPN Theta
    cpn: State = dataclasses.field(default_factory=dict)


class FedCP(Method):
    name = "fedcp"
    feature_head = True
    summary = ("Conditional policy: per sample, a policy network splits the features between the "
               "frozen global head and a personalized head; extractor, policy and the heads' "
               "mean are averaged.")
    paper = ("Zhang et al., FedCP: Separating Feature Information for Personalized Federated "
             "Learning via Conditional Policy, KDD 2023")
    Params = FedCPParams
    not_private = ("its clients upload a policy network beside the model, which the server "
                   "averages as a separate record outside DP-FedAvg's one clipped update")
    #: the MMD between the global and personalized features (>= 0)
    train_metrics = {"mmd": Metric()}
    ClientState = FedCPClientState
    ServerState = FedCPServerState

    # --- client --------------------------------------------------------------------------------
    def _parts(self, client: ClientRuntime, received: Received, state: FedCPClientState,
               ) -> tuple[nn.Module, nn.Module, nn.Module, ConditionalPolicy, str]:
        """The received model, the frozen global head, the personalized head, the CPN, and the
        head's name."""
        model = client.new_model(received.model)
        name, global_head = head_of(model)
        personal = client.new_model()  # the run's initial model: its head until trained
        if state.head:
            head_of(personal)[1].load_state_dict(state.head)
        personal_head = head_of(personal)[1]
        policy = new_policy(global_head.in_features, client.seed).to(client.device)
        policy.load_state_dict(received.arrays[CPN])
        global_head.requires_grad_(False)
        return model, global_head, personal_head, policy, name

    @staticmethod
    def _result(model_state: Mapping[str, torch.Tensor], name: str,
                global_head: Mapping[str, torch.Tensor], own_head: TorchState,
                policy: Mapping[str, torch.Tensor], loss: float, mmd: float, steps: int,
                ) -> tuple[Upload, FedCPClientState]:
        """The upload (the trained extractor, ``(W^hd + W_i^hd) / 2`` as the head, the CPN) and
        the new state (``W_i^hd``) of a client's round."""
        upload = dict(model_state)
        for key, value in own_head.items():
            upload[f"{name}.{key}"] = (global_head[key] + value) / 2
        return (Upload(upload, {TRAIN_LOSS: loss, LOCAL_STEPS: steps, "mmd": mmd},
                       arrays={CPN: dict(policy)}),
                FedCPClientState(own_head))

    def train(self, client: ClientRuntime, received: Received, state: FedCPClientState,
              ) -> Rule:
        model, global_head, personal_head, policy, name = self._parts(client, received, state)
        reference = {k: v for k, v in received.model.items() if not k.startswith(f"{name}.")}
        objective = PolicyObjective(reference,
                                    {"v": client_vector(personal_head.weight)}, policy,
                                    self.params.lambda_)
        result = yield LocalRun(received.model, trainable=tuple(reference),
                                objective=objective, extras={
                                    **with_prefix(personal_head.state_dict(), HEAD),
                                    **with_prefix(policy.state_dict(), CPN)})
        own_head = prefixed(result.extras, HEAD)
        stats = result.stats
        return self._result(result.model, name, global_head.state_dict(), own_head,
                            prefixed(result.extras, CPN), stats.loss, stats.metrics["mmd"],
                            stats.steps)

    def _personalized(self, client: ClientRuntime, received: Received,
                      state: FedCPClientState) -> FedCPModel:
        model, global_head, personal_head, policy, _ = self._parts(client, received, state)
        return FedCPModel(model, global_head, personal_head, policy)

    def scored_module(self, model: nn.Module, num_classes: int) -> nn.Module:
        global_head = head_of(model)[1]
        personal_head = nn.Linear(global_head.in_features, global_head.out_features,
                                  bias=global_head.bias is not None)
        return FedCPModel(model, global_head, personal_head,
                          ConditionalPolicy(global_head.in_features))

    def evaluate(self, client: ClientRuntime, received: Received,
                 state: FedCPClientState) -> dict:
        global_result = client.test(received.model)
        personalized = self._personalized(client, received, state)
        return client.eval_metrics(client.test(personalized), global_result)

    # --- server --------------------------------------------------------------------------------
    @staticmethod
    def _features(server: ServerRuntime) -> int:
        return head_of(server.template_model())[1].in_features

    def init_server(self, server: ServerRuntime, model: State) -> FedCPServerState:
        policy = new_policy(self._features(server), server.seed)
        return FedCPServerState(model=model, cpn={k: v.detach().numpy().copy()
                                                  for k, v in policy.state_dict().items()})

    def reply_arrays(self, server: ServerRuntime) -> dict[str, FlatSpec]:
        return {CPN: _policy_spec(self._features(server))}

    def train_payload(self, server: ServerRuntime, state: FedCPServerState, client: int,
                      server_round: int) -> Payload:
        return Payload({MODEL: server.shared_model(state), CPN: state.cpn})

    eval_payload = train_payload

    def aggregate(self, server: ServerRuntime, state: FedCPServerState, server_round: int,
                  updates: Sequence[Update]) -> tuple[FedCPServerState, dict[str, float]]:
        weights = [u.num_examples for u in updates]
        model = server.average([u.model for u in updates], weights)
        cpn = server.average([u.arrays[CPN] for u in updates], weights,
                             FlatSpec.of(updates[0].arrays[CPN]))
        return dataclasses.replace(server.with_model(state, model), cpn=cpn), {}
