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

The adaptation and the merged model's training are each a local run
(:class:`~pflalign.training.runs.LocalRun`): the adaptation's trains only ``W`` (the run's extra
tensors, :class:`MergeObjective`) on its random subset (``sample``), with the stopping rule as
its ``until``.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pflalign.methods.base import Method
from pflalign.methods.fedavg import trained_upload
from pflalign.models.registry import head_keys
from pflalign.settings.params import Params, param
from pflalign.training.client import ClientRuntime
from pflalign.training.corrections import Entries
from pflalign.training.loops import STREAM_ADAPT
from pflalign.training.objectives import (
    ModelCall,
    Objective,
    Step,
    cross_entropy,
    prefixed,
    with_prefix,
)
from pflalign.training.optim.common import Tensors
from pflalign.training.optimizers import EntryGroup, SGDGroups
from pflalign.training.runs import LocalRun, Rule, RunResult
from pflalign.wire.messages import Received
from pflalign.wire.protocol import Metric
from pflalign.wire.state import ArrayState, TorchState

MAX_FIRST_EPOCHS = 50
#: the aggregation weights W, the adaptation run's extra tensors (``weights.<entry>``)
WEIGHTS = "weights"


def ala_merge(local: Tensors, global_: Tensors, weights: Tensors) -> list[torch.Tensor]:
    """FedALA's adaptive local aggregation (Zhang et al., AAAI 2023, eq. 4) for the higher
    layers: ``theta_hat = theta_i + (Theta - theta_i) * W``, element-wise (differentiable in
    ``W``: its gradient is ``grad_theta_hat * (Theta - theta_i)``, eq. 5's)."""
    return [theta + (big - theta) * w for theta, big, w in zip(local, global_, weights,
                                                                 strict=True)]


def ala_weight_rule(eta: float) -> SGDGroups:
    """FedALA's weight update (eq. 5): ``W <- clip(W - eta dL/dW, 0, 1)``, projected SGD."""
    return SGDGroups(eta, groups=(EntryGroup(f"{WEIGHTS}.", bounds=(0.0, 1.0)),))


def ala_converged(losses: Sequence[float], window: int, threshold: float) -> bool:
    """FedALA's stopping rule for the first adaptation: the standard deviation of the last
    ``window`` losses is below ``threshold``."""
    return len(losses) >= window and float(np.std(losses[-window:])) < threshold


@dataclass(frozen=True)
class Converged:
    """:func:`ala_converged` as a run's stopping rule (asked after each pass)."""

    window: int
    threshold: float

    def __call__(self, losses: list[float]) -> bool:
        return ala_converged(losses, self.window, self.threshold)


@dataclass(frozen=True)
class MergeObjective(Objective):
    """The adaptation's loss: the cross-entropy of the model whose higher layers are the merge
    :func:`ala_merge` of ``local`` (``theta_i``) and ``received`` (``Theta``) with the run's
    extra tensors ``W`` (``weights.<entry>``); the rest of the model is the received one."""

    local: Entries
    received: Entries

    def changes(self) -> tuple[str, ...]:
        return tuple(self.local)

    def loss(self, model: ModelCall, params: Mapping[str, torch.Tensor], extras: Entries,
             state: Entries, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None,
             ) -> Step:
        keys = list(self.local)
        weights = prefixed(extras, WEIGHTS)
        merged = ala_merge([self.local[k] for k in keys], [self.received[k] for k in keys],
                           [weights[k] for k in keys])
        value = cross_entropy(model({**params, **dict(zip(keys, merged, strict=True))}, x), y,
                              mask)
        return Step(value, value)


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
    asynchronous = True  # its server update is a sample-weighted average of uploads
    private = True  # it uploads its global model, which the server only averages
    needs_head = True
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
              saved: TorchState | None) -> Generator[LocalRun, RunResult, tuple]:
        """The merged model's state, the learned weights ``W`` and the number of passes spent
        learning them: a local run on a random ``fedala-rand-percent`` % of the train split
        (stream ``STREAM_ADAPT``) that trains only ``W``, one pass, or at the first adaptation
        (no ``saved`` weights) until :class:`Converged`. Buffers (batch-norm statistics) are the
        received model's."""
        p = self.params
        params = dict(client.layout.named_parameters())
        higher = [k for k in head_keys(client.layout, p.layers) if k in params]
        count = max(1, math.floor(client.data.num_train * p.rand_percent / 100))
        result = yield LocalRun(
            received, trainable=(), stream=STREAM_ADAPT,
            epochs=1 if saved else MAX_FIRST_EPOCHS, sample=count,
            until=None if saved else Converged(p.num_pre_loss, p.threshold),
            optimizer=ala_weight_rule(p.eta),
            objective=MergeObjective({k: own[k] for k in higher},
                                     {k: received[k] for k in higher}),
            extras=with_prefix({k: saved[k] if saved else torch.ones_like(received[k])
                                for k in higher}, WEIGHTS))
        weights = prefixed(result.extras, WEIGHTS)
        with torch.no_grad():
            merged = ala_merge([own[k] for k in higher], [received[k] for k in higher],
                               [weights[k].to(own[k].device) for k in higher])
        passes = result.stats.steps // math.ceil(count / client.training.batch_size)
        return {**received, **dict(zip(higher, merged, strict=True))}, weights, passes

    def train(self, client: ClientRuntime, received: Received, state: FedALAClientState,
              ) -> Rule:
        passes, weights, start = 0, state.weights, received.model
        if state.model is not None:  # adapt, then train as FedAvg
            start, weights, passes = yield from self.adapt(client, state.model, received.model,
                                                           state.weights)
        result = yield LocalRun(start)
        return (trained_upload(result, **{"ala-passes": passes}),
                FedALAClientState(result.model, weights))

    def evaluate(self, client: ClientRuntime, received: Received,
                 state: FedALAClientState) -> Rule:
        global_result = client.test(received.model)
        if state.model is None:
            return client.eval_metrics(global_result, global_result)
        merged, _, _ = yield from self.adapt(client, state.model, received.model,
                                             state.weights)
        return client.eval_metrics(client.test(merged), global_result)
