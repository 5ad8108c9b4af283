"""FedDBE (Zhang, Hua, Wang, Song, Xue, Ma, Guan, Eliminating Domain Bias for Federated Learning in
Representation Space, NeurIPS 2023, arXiv 2311.14975): FedAvg with the domain bias eliminator.

The model splits into a feature extractor (every layer but the last) and a head (the last layer).
Each client keeps a Personalized Representation Bias Memory (PRBM): one vector ``z_i^p`` with a
value per feature, zeros at first, added to every sample's features before the head, so the
client's model is ``head(f(x) + z_i^p)``. The whole model (extractor and head) is shared and
averaged as in FedAvg; ``z_i^p`` never leaves the client.

Client, each round, on the received global model: every mini-batch ``B`` gives the features
``z^g = f(x)`` and the running mean ``zbar <- (1 - m) zbar + m mean_B(z^g)`` (``m`` is
``feddbe-momentum``; ``zbar`` starts the round at 0, and only the current batch's term carries a
gradient). The loss is ``CE(head(z^g + z_i^p), y) + kappa MR`` with the Mean Regularization
``MR = (1/K) sum_k 1/2 (zbar_k - zbar^g_k)^2`` towards the consensual global mean ``zbar^g``
(:func:`mean_regularization`). The run's local optimizer steps the model and ``z_i^p`` together;
``z_i^p`` gets its gradient from the cross-entropy only, the MR term reaches the extractor only.
The client uploads its model and its last running mean (record ``feature-mean``).

The global mean: the authors compute it once, before training, from one extra epoch of plain
training (``CE(head(f(x)), y)``, no PRBM, no MR) on every client, whose models they then discard.
Here that pass is the first round: while the server has no global mean, a client trains as
FedAvg does (the same update, bit for bit) and uploads its running mean; after the first round's
aggregation the server fixes ``zbar^g`` as the sample-weighted average of the uploaded means and
sends it with the model from then on. The first round's training is counted and kept, and only
its sampled clients contribute (every client, at ``fraction-train = 1``, PFLlib's setting).

``personal-acc`` scores the received global model with the client's PRBM; ``global-acc`` the
global model alone. A client without a PRBM (a new client, or one that trained only in the first
round) is scored on the global model. Follows the authors' code where the paper is silent: the
running mean (with the momentum) in MR, the 1/2 and the mean over features, a PRBM at the head's
input trained at the local learning rate. ``feddbe-kappa`` = 5 keeps the authors' kappa x lr
(50 x 0.005) at this project's lr = 0.05.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pflalign.methods.fedavg import FedAvg
from pflalign.models.registry import head_of, without_head
from pflalign.server.aggregation import FlatSpec
from pflalign.server.runtime import ServerRuntime
from pflalign.settings.params import Params, log_range, param
from pflalign.training.client import ClientRuntime
from pflalign.training.corrections import Entries
from pflalign.training.objectives import ModelCall, Objective, Step, batch_mean, cross_entropy
from pflalign.training.runs import LocalRun, Rule
from pflalign.wire.messages import Payload, Received, Update, Upload
from pflalign.wire.protocol import LOCAL_STEPS, MODEL, TRAIN_LOSS, Metric
from pflalign.wire.state import ArrayState, ServerState, State

#: the server's global mean (sent) and a client's running mean (uploaded), each as ``{"mean": v}``
GLOBAL_MEAN, FEATURE_MEAN, MEAN = "global-mean", "feature-mean", "mean"
#: the PRBM, the run's extra trained tensor
BIAS = "bias"


def running_mean(previous: torch.Tensor, batch_mean: torch.Tensor,
                 momentum: float) -> torch.Tensor:
    """``(1 - m) zbar + m mean_B(z^g)``, the history detached."""
    return (1.0 - momentum) * previous.detach() + momentum * batch_mean


def mean_regularization(mean: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MR: ``(1/K) sum_k 1/2 (zbar_k - zbar^g_k)^2``."""
    return 0.5 * (mean - target).pow(2).mean()


class BiasedModel(nn.Module):
    """``head(f(x) + z^p)``: a client's FedDBE model as one module, for the evaluation loop."""

    def __init__(self, model: nn.Module, bias: torch.Tensor):
        super().__init__()
        self.model = model
        self.register_buffer("bias", bias)  # in the state dict: a saved model keeps it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with without_head(self.model):
            features = self.model(x)
        return head_of(self.model)[1](features + self.bias)


@dataclass(frozen=True)
class BiasedObjective(Objective):
    """A FedDBE client's round: ``CE(head(z^g + z_i^p), y) + kappa MR`` with the running mean
    carried from batch to batch (state ``mean``); without a global mean (``target`` empty) the
    plain cross-entropy, no PRBM, the running mean still kept (the first round's). The PRBM is
    the run's extra tensor ``bias``; MR is reported as the diagnostic ``mr``."""

    target: Entries
    features: int
    kappa: float
    momentum: float

    def initial_state(self) -> dict[str, torch.Tensor]:
        return {MEAN: torch.zeros(self.features)}

    def loss(self, model: ModelCall, params: Mapping[str, torch.Tensor], extras: Entries,
             state: Entries, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None,
             ) -> Step:
        features = model.features(params, x)
        mean = running_mean(state[MEAN], batch_mean(features, mask), self.momentum)
        biased = features + extras[BIAS] if BIAS in extras else features
        ce = cross_entropy(model.head(params, biased), y, mask)
        if not self.target:
            return Step(ce, ce, state={MEAN: mean.detach()})
        mr = mean_regularization(mean, self.target[MEAN])
        return Step(ce + self.kappa * mr, ce, {"mr": mr}, {MEAN: mean.detach()})


@dataclass(frozen=True)
class FedDBEParams(Params):
    prefix = "feddbe"

    kappa: float = param(5.0, "Weight kappa of the mean regularization towards the global mean "
                         "of the representations. The authors use 50 with SGD at lr 0.005 "
                         "(Fashion-MNIST, 4-layer CNN); 5 keeps their kappa x lr at this "
                         "project's lr = 0.05.", minimum=0.0, search=log_range(0.5, 50.0))
    momentum: float = param(1.0, "Weight of the current mini-batch in the running mean of the "
                            "representations (1: the batch's own mean, the authors' "
                            "Fashion-MNIST setting).", minimum=0.0, maximum=1.0,
                            exclusive_minimum=True)


@dataclass
class FedDBEClientState(ArrayState):
    #: the PRBM z_i^p, one value per feature (None until the client trains with a global mean)
    bias: torch.Tensor | None = None


@dataclass
class FedDBEServerState(ServerState):
    #: the consensual global mean of the representations (None until the first aggregation)
    global_mean: np.ndarray | None = None


class FedDBE(FedAvg):
    asynchronous = False  # its server update is not a plain average of uploads
    private = False
    not_private = ("its clients upload their mean representation beside the model, which the "
                   "server keeps as a global mean")
    name = "feddbe"
    feature_head = True
    summary = ("FedAvg with a personal representation bias added to the features before the head, "
               "and a regularizer pulling each client's mean representation to a global mean.")
    paper = ("Zhang et al., Eliminating Domain Bias for Federated Learning in Representation "
             "Space, NeurIPS 2023")
    Params = FedDBEParams
    ClientState = FedDBEClientState
    ServerState = FedDBEServerState
    #: MR, the regularizer's mean over the run (absent when no batch reached it)
    train_metrics = {"mr": Metric(required=False, diagnostic=True)}

    # --- client --------------------------------------------------------------------------------
    def train(self, client: ClientRuntime, received: Received, state: FedDBEClientState,
              ) -> Rule:
        p = self.params
        features = head_of(client.layout)[1].in_features
        target = received.arrays.get(GLOBAL_MEAN, {}).get(MEAN)
        extras = {}
        if target is not None:  # the regularized round; before the global mean: FedAvg's
            extras[BIAS] = (torch.zeros(features) if state.bias is None else state.bias)
        result = yield LocalRun(received.model, objective=BiasedObjective(
            {} if target is None else {MEAN: target}, features, p.kappa, p.momentum),
            extras=extras)
        metrics = {TRAIN_LOSS: result.stats.loss, LOCAL_STEPS: result.stats.steps,
                   **result.stats.metrics}
        new = state if target is None else FedDBEClientState(result.extras[BIAS])
        return Upload(result.model, metrics,
                      arrays={FEATURE_MEAN: {MEAN: result.state[MEAN]}}), new

    def scored_module(self, model: nn.Module, num_classes: int) -> nn.Module:
        return BiasedModel(model, torch.zeros(head_of(model)[1].in_features))

    def evaluate(self, client: ClientRuntime, received: Received,
                 state: FedDBEClientState) -> dict:
        model = client.new_model(received.model)
        global_result = client.test(model)
        if state.bias is None:  # scored as the global model: a zero bias changes no output
            zero = BiasedModel(model, torch.zeros(head_of(model)[1].in_features,
                                                  device=client.device))
            return client.eval_metrics(dataclasses.replace(global_result, scored=zero),
                                      global_result)
        personal = client.test(BiasedModel(model, state.bias.to(client.device)))
        return client.eval_metrics(personal, global_result)

    # --- server --------------------------------------------------------------------------------
    @staticmethod
    def _mean_spec(server: ServerRuntime) -> FlatSpec:
        features = head_of(server.template_model())[1].in_features
        return FlatSpec.of({MEAN: np.zeros(features, dtype=np.float32)})

    def init_server(self, server: ServerRuntime, model: State) -> FedDBEServerState:
        return FedDBEServerState(model=model)

    def reply_arrays(self, server: ServerRuntime) -> dict[str, FlatSpec]:
        return {FEATURE_MEAN: self._mean_spec(server)}

    def train_payload(self, server: ServerRuntime, state: FedDBEServerState, client: int,
                      server_round: int) -> Payload:
        arrays = {MODEL: server.shared_model(state)}
        if state.global_mean is not None:
            arrays[GLOBAL_MEAN] = {MEAN: state.global_mean}
        return Payload(arrays)

    def aggregate(self, server: ServerRuntime, state: FedDBEServerState, server_round: int,
                  updates: Sequence[Update]) -> tuple[FedDBEServerState, dict[str, float]]:
        weights = [u.num_examples for u in updates]
        new = server.with_model(state, server.average([u.model for u in updates], weights))
        if state.global_mean is None:  # fixed once, from the first round's running means
            mean = server.average([u.arrays[FEATURE_MEAN] for u in updates], weights,
                                  self._mean_spec(server))[MEAN]
            new = dataclasses.replace(new, global_mean=mean)
        return new, {}
