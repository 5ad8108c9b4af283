"""FedALA (Zhang et al., FedALA: Adaptive Local Aggregation for Personalized Federated Learning,
AAAI 2023, Algorithm 1).

Before local training the client merges the received global model ``Theta`` into its own model
``theta_i`` (from its last round, in its state): lower layers take ``Theta``; the top
``fedala-layers`` parameterised layers become ``theta_i + (Theta - theta_i) * W`` with element-wise
weights ``W`` in [0, 1] (initialised to 1, kept in the state). ``W`` is learned on a random
``fedala-rand-percent`` % of the client's train split (drawn per round) by
``W <- clip(W - fedala-eta grad * (Theta - theta_i), 0, 1)`` with the lower layers frozen. At the
client's first adaptation this repeats until the standard deviation of the last
``fedala-num-pre-loss`` losses falls below ``fedala-threshold`` (at most ``MAX_FIRST_EPOCHS``
passes); afterwards it is one pass per round. When only the last layer is adapted and the model
has no batch norm or dropout, the lower layers' outputs are computed once per round and reused.
The merged model is trained as in FedAvg, kept as ``theta_i`` and uploaded. Server: FedAvg's.

A client without ``theta_i`` (its first round, or an unseen client) takes ``Theta`` as is: the
merge is the identity. ``personal-acc`` scores what the client would start its next round from,
the merge of the current ``Theta`` into its ``theta_i`` (as in the reference implementation, where
every client adapts the new global model before evaluation; here the evaluation's adaptation is
not stored); for clients that never trained that is ``Theta``. ``global-acc`` scores ``Theta``.

The adaptation is a loop of the client's own (its subset, number of passes and stopping rule);
the merged model's training is a local run (:class:`~pflalign.training.runs.LocalRun`), which the
batched engine can run with other clients'.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pflalign.methods.base import Method
from pflalign.methods.fedavg import trained_upload
from pflalign.models.registry import head_keys
from pflalign.settings.params import Params, param
from pflalign.training.client import ClientRuntime
from pflalign.training.loops import STREAM_ADAPT, batch_indices
from pflalign.training.optim.common import Tensors, grads_of
from pflalign.training.runs import LocalRun, Rule
from pflalign.wire.messages import Received
from pflalign.wire.protocol import Metric
from pflalign.wire.state import ArrayState, TorchState

MAX_FIRST_EPOCHS = 50


@torch.no_grad()
def ala_merge(local: Tensors, global_: Tensors, weights: Tensors) -> list[torch.Tensor]:
    """FedALA's adaptive local aggregation (Zhang et al., AAAI 2023, eq. 4) for the higher
    layers: ``theta_hat = theta_i + (Theta - theta_i) * W``, element-wise."""
    diff = torch._foreach_sub(list(global_), list(local))
    return torch._foreach_add(list(local), torch._foreach_mul(diff, list(weights)))


@torch.no_grad()
def ala_weight_step_(weights: Tensors, grads: Tensors, local: Tensors, global_: Tensors,
                     eta: float) -> None:
    """FedALA's weight update (eq. 5): ``W <- clip(W - eta grad_theta_hat * (Theta - theta_i),
    0, 1)``; by the chain rule ``grad_theta_hat * (Theta - theta_i)`` is ``dL/dW``."""
    diff = torch._foreach_sub(list(global_), list(local))
    torch._foreach_add_(list(weights), torch._foreach_mul(list(grads), diff), alpha=-eta)
    torch._foreach_clamp_min_(list(weights), 0.0)
    torch._foreach_clamp_max_(list(weights), 1.0)


def ala_converged(losses: Sequence[float], window: int, threshold: float) -> bool:
    """FedALA's stopping rule for the first adaptation: the standard deviation of the last
    ``window`` losses is below ``threshold``."""
    return len(losses) >= window and float(np.std(losses[-window:])) < threshold


@dataclass(frozen=True)
class FedALAParams(Params):
    prefix = "fedala"

    eta: float = param(1.0, "Step size of the aggregation weights W.", minimum=0.0,
                       exclusive_minimum=True)
    rand_percent: int = param(80, "Percent of the client's train split used to learn W each "
                              "round.", minimum=1, maximum=100)
    layers: int = param(1, "Number of final parameterised layers merged with learned weights "
                        "(lower layers take the global model).", minimum=1)
    threshold: float = param(0.1, "The first adaptation stops when the std of the last "
                             "fedala-num-pre-loss losses is below this.", minimum=0.0,
                             exclusive_minimum=True)
    num_pre_loss: int = param(10, "Number of recent losses in the stopping rule.", minimum=2)


@dataclass
class FedALAClientState(ArrayState):
    #: theta_i, the client's model from its last round
    model: TorchState | None = None
    #: the element-wise aggregation weights W of the top layers
    weights: TorchState | None = None


class FedALA(Method):
    name = "fedala"
    summary = ("Adaptive local aggregation: element-wise learned weights merge the global model "
               "into each client's model (top layers) before local training.")
    paper = ("Zhang et al., FedALA: Adaptive Local Aggregation for Personalized Federated "
             "Learning, AAAI 2023")
    Params = FedALAParams
    #: how many passes the adaptive local aggregation took
    train_metrics = {"ala-passes": Metric(integer=True)}
    ClientState = FedALAClientState

    def adapt(self, client: ClientRuntime, own: TorchState, received: TorchState,
              saved: TorchState | None, server_round: int,
              ) -> tuple[nn.Module, dict[str, torch.Tensor], int]:
        """The merged model, the learned weights ``W`` and the number of passes spent learning
        them. Buffers (batch-norm statistics) are the received model's."""
        p = self.params
        model = client.new_model(received)
        data, device = client.data, client.device
        generator = client.generator(server_round, STREAM_ADAPT)
        higher = [k for k in head_keys(model, p.layers) if k in dict(model.named_parameters())]
        params = dict(model.named_parameters())
        top = [params[k] for k in higher]
        local = [own[k].to(device) for k in higher]
        global_ = [received[k].to(device) for k in higher]
        weights = ([saved[k].to(device) for k in higher] if saved
                   else [torch.ones_like(q) for q in top])
        trained_before = {name: q.requires_grad for name, q in params.items()}
        for name, q in params.items():
            q.requires_grad_(name in set(higher))
        count = max(1, math.floor(data.num_train * p.rand_percent / 100))
        subset = torch.randperm(data.num_train, generator=generator)[:count].to(device)
        # lower layers are fixed while W learns
        head = ClientRuntime.last_layer_owning(model, higher)
        features = None if head is None else client.head_inputs(model, head, subset)
        losses: list[float] = []
        passes = 0
        model.train()
        while True:
            passes += 1
            for idx in batch_indices(count, client.training.batch_size, 1, 0, generator, device):
                with torch.no_grad():
                    torch._foreach_copy_(top, ala_merge(local, global_, weights))
                model.zero_grad(set_to_none=True)
                rows = subset[idx]
                x, y = data.normalize(data.train_x[rows]), data.train_y[rows]
                outputs = model(x) if features is None else head(features[idx])
                loss = F.cross_entropy(outputs, y)
                loss.backward()
                ala_weight_step_(weights, grads_of(top), local, global_, p.eta)
                losses.append(float(loss.detach()))
            if (saved or passes >= MAX_FIRST_EPOCHS
                    or ala_converged(losses, p.num_pre_loss, p.threshold)):
                break
        with torch.no_grad():
            torch._foreach_copy_(top, ala_merge(local, global_, weights))
        for name, q in params.items():  # as it was: a frozen tensor (shared) stays frozen
            q.requires_grad_(trained_before[name])
        model.load_state_dict({k: v for k, v in received.items() if k not in params},
                              strict=False)  # undo what the adaptation passes did to buffers
        return model, dict(zip(higher, weights, strict=True)), passes

    def train(self, client: ClientRuntime, received: Received, state: FedALAClientState,
              ) -> Rule:
        passes, weights, start = 0, state.weights, received.model
        if state.model is not None:  # the client's own loop: adapt, then train as FedAvg
            model, weights, passes = self.adapt(client, state.model, received.model,
                                                state.weights, received.server_round)
            start = model.state_dict()
        result = yield LocalRun(start)
        return (trained_upload(result, **{"ala-passes": passes}),
                FedALAClientState(result.model, weights))

    def evaluate(self, client: ClientRuntime, received: Received,
                 state: FedALAClientState) -> Rule:
        global_result = client.test(received.model)
        if state.model is None:
            return client.eval_metrics(global_result, global_result)
        merged, _, _ = self.adapt(client, state.model, received.model, state.weights,
                                  received.server_round)
        return client.eval_metrics(client.test(merged), global_result)
