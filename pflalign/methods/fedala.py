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

Batched engine (:mod:`pflalign.cohort`): each client's adaptation runs by itself (its own subset,
number of passes and stopping rule; :meth:`FedALA._adapt`, shared with the per-client rule, reads
the client's rows of the cohort's pooled data), then the merged models train together in
lockstep (:meth:`~pflalign.cohort.Cohort.local_train`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pflalign.baselines import ala_converged, ala_merge, ala_weight_step_, grads_of
from pflalign.client import ClientRuntime, Received, Upload
from pflalign.method import Method
from pflalign.models import head_keys
from pflalign.params import Params, param
from pflalign.protocol import LOCAL_STEPS, TRAIN_LOSS
from pflalign.state import ArrayState, TorchState
from pflalign.train import STREAM_ADAPT, batch_indices

if TYPE_CHECKING:
    from pflalign.cohort import Cohort

MAX_FIRST_EPOCHS = 50


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
    ClientState = FedALAClientState

    def adapt(self, client: ClientRuntime, own: TorchState, received: TorchState,
              saved: TorchState | None, server_round: int,
              ) -> tuple[nn.Module, dict[str, torch.Tensor], int]:
        """The merged model, the learned weights ``W`` and the number of passes spent learning
        them. Buffers (batch-norm statistics) are the received model's."""
        data = client.data
        return self._adapt(client.new_model(received), own, received, saved,
                           _TrainSplit(data.num_train,
                                       lambda rows: (data.normalize(data.train_x[rows]),
                                                     data.train_y[rows]),
                                       client.head_inputs),
                           client.generator(server_round, STREAM_ADAPT),
                           client.training.batch_size, client.device)

    def _adapt(self, model: nn.Module, own: TorchState, received: TorchState,
               saved: TorchState | None, data: _TrainSplit, generator: torch.Generator,
               batch_size: int, device: torch.device,
               ) -> tuple[nn.Module, dict[str, torch.Tensor], int]:
        """:meth:`adapt` on ``model`` (loaded with ``received``), the client's train split read
        through ``data`` (a client's runtime, or its row of a cohort)."""
        p = self.params
        higher = [k for k in head_keys(model, p.layers) if k in dict(model.named_parameters())]
        params = dict(model.named_parameters())
        top = [params[k] for k in higher]
        local = [own[k].to(device) for k in higher]
        global_ = [received[k].to(device) for k in higher]
        weights = ([saved[k].to(device) for k in higher] if saved
                   else [torch.ones_like(q) for q in top])
        for name, q in params.items():
            q.requires_grad_(name in set(higher))
        count = max(1, math.floor(data.num_train * p.rand_percent / 100))
        subset = torch.randperm(data.num_train, generator=generator)[:count].to(device)
        # lower layers are fixed while W learns
        head = ClientRuntime.last_layer_owning(model, higher)
        features = None if head is None else data.head_inputs(model, head, subset)
        losses: list[float] = []
        passes = 0
        model.train()
        while True:
            passes += 1
            for idx in batch_indices(count, batch_size, 1, 0, generator, device):
                with torch.no_grad():
                    torch._foreach_copy_(top, ala_merge(local, global_, weights))
                model.zero_grad(set_to_none=True)
                x, y = data.batch(subset[idx])
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
        for q in params.values():
            q.requires_grad_(True)
        model.load_state_dict({k: v for k, v in received.items() if k not in params},
                              strict=False)  # undo what the adaptation passes did to buffers
        return model, dict(zip(higher, weights, strict=True)), passes

    def _adapt_in_cohort(self, cohort: Cohort, i: int, own: TorchState, received: Received,
                         saved: TorchState | None,
                         ) -> tuple[nn.Module, dict[str, torch.Tensor], int]:
        """:meth:`adapt` for client ``i`` of ``cohort``: the same draws, batches and steps."""
        return self._adapt(cohort.new_model(received.model), own, received.model, saved,
                           _TrainSplit(cohort.num_train(i),
                                       lambda rows: cohort.batch(i, rows),
                                       lambda m, head, rows: cohort.head_inputs(
                                           i, m, head, rows)),
                           cohort.generator(i, received.server_round, STREAM_ADAPT),
                           cohort.training.batch_size, cohort.device)

    def train(self, client: ClientRuntime, received: Received, state: FedALAClientState,
              ) -> tuple[Upload, FedALAClientState]:
        passes, weights = 0, state.weights
        if state.model is None:
            model = client.new_model(received.model)
        else:
            model, weights, passes = self.adapt(client, state.model, received.model,
                                                state.weights, received.server_round)
        stats = client.local_train(model, received.server_round)
        trained = model.state_dict()
        upload = Upload(trained, {TRAIN_LOSS: stats.loss, LOCAL_STEPS: stats.steps,
                                  "ala-passes": passes})
        return upload, FedALAClientState(trained, weights)

    def evaluate(self, client: ClientRuntime, received: Received,
                 state: FedALAClientState) -> dict:
        global_result = client.test(client.new_model(received.model))
        if state.model is None:
            return client.eval_metrics(global_result, global_result)
        merged, _, _ = self.adapt(client, state.model, received.model, state.weights,
                                  received.server_round)
        return client.eval_metrics(client.test(merged), global_result)

    def train_cohort(self, cohort: Cohort, received: Sequence[Received],
                     states: Sequence[FedALAClientState],
                     ) -> list[tuple[Upload, FedALAClientState]]:
        server_round = received[0].server_round
        starts: list[TorchState] = []
        weights: list[TorchState | None] = []
        passes: list[int] = []
        for i, (r, state) in enumerate(zip(received, states, strict=True)):
            if state.model is None:  # the merge is the identity
                starts.append(r.model)
                weights.append(state.weights)
                passes.append(0)
            else:  # one client at a time: each its own subset, passes and stopping rule
                model, w, n = self._adapt_in_cohort(cohort, i, state.model, r, state.weights)
                starts.append(model.state_dict())
                weights.append(w)
                passes.append(n)
        params = cohort.stack(starts)
        stats = cohort.local_train(params, server_round, cohort.optimizers(params, server_round))
        out = []
        for i, s in enumerate(stats):
            trained = cohort.state_dict(params, i, starts[i])
            upload = Upload(trained, {TRAIN_LOSS: s.loss, LOCAL_STEPS: s.steps,
                                      "ala-passes": passes[i]})
            out.append((upload, FedALAClientState(trained, weights[i])))
        return out

    def evaluate_cohort(self, cohort: Cohort, received: Sequence[Received],
                        states: Sequence[FedALAClientState]) -> list[dict]:
        out = []
        for i, (r, state) in enumerate(zip(received, states, strict=True)):
            global_result = cohort.test(cohort.model(r.model, "global"), i)
            if state.model is None:
                out.append(cohort.eval_metrics(global_result, global_result))
                continue
            merged, _, _ = self._adapt_in_cohort(cohort, i, state.model, r, state.weights)
            out.append(cohort.eval_metrics(cohort.test(merged, i), global_result))
        return out


@dataclass
class _TrainSplit:
    """A client's train split as the adaptation reads it: its size, ``batch(rows)`` (normalised
    inputs and labels of those rows) and ``head_inputs(model, head, rows)`` (what the model's
    last layer receives for them, as :meth:`ClientRuntime.head_inputs` computes it)."""

    num_train: int
    batch: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    head_inputs: Callable[[nn.Module, nn.Module, torch.Tensor], torch.Tensor]

