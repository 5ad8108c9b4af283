"""pFedMe (T Dinh, Tran, Nguyen, Personalized Federated Learning with Moreau Envelopes,
NeurIPS 2020, Algorithm 1).

Client: it copies the global model into its local model ``w``. For each mini-batch it solves the
inner problem ``theta = argmin f(theta; D) + lambda/2 ||theta - w||^2`` approximately with
``pfedme-k`` gradient steps at rate ``pfedme-personal-lr`` (warm-started from the previous
``theta``; the first from ``w``), then moves ``w <- w - lr lambda (w - theta)``. It uploads ``w``
and keeps ``theta``, its personalized model, which ``personal-acc`` scores. New-client procedure
(unseen clients and clients scored before their first training): the inner problem is solved
around the global model (``w`` held fixed at ``w_g``) over one epoch of the client's train split;
``theta`` is scored.

Server (line 12): ``w_g <- (1 - pfedme-beta) w_g + pfedme-beta sum_i p_i w_i`` with sample weights
``p_i`` (:func:`pfedme_server_update`); ``pfedme-beta = 1`` is FedAvg's
average. Only the sampled clients train in a round (as for every method here; the paper lets all
clients update locally and averages a sampled subset). Buffers are averaged as in FedAvg.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pflalign.methods.base import Method
from pflalign.server.runtime import ServerRuntime
from pflalign.settings.params import Params, param
from pflalign.training.client import ClientRuntime
from pflalign.training.loops import STREAM_FINETUNE, STREAM_TRAIN
from pflalign.training.optim.common import Tensors, grads_of
from pflalign.wire.messages import Received, Update, Upload
from pflalign.wire.protocol import LOCAL_STEPS, TRAIN_LOSS
from pflalign.wire.state import ArrayState, ServerState, TorchState


@torch.no_grad()
def pfedme_inner_step_(theta: Tensors, anchor: Tensors, lam: float, lr: float) -> None:
    """One gradient step on pFedMe's inner problem ``f(theta) + lambda/2 ||theta - w||^2``
    (T Dinh et al., NeurIPS 2020, eq. 7): ``theta -= lr (grad f(theta) + lambda (theta - w))``,
    with ``grad f`` in ``theta[k].grad``."""
    grads = grads_of(theta)
    torch._foreach_add_(grads, torch._foreach_sub(list(theta), list(anchor)), alpha=lam)
    torch._foreach_add_(list(theta), grads, alpha=-lr)


@torch.no_grad()
def pfedme_outer_step_(local: Tensors, theta: Tensors, lam: float, lr: float) -> None:
    """pFedMe's local-model step (Algorithm 1 line 8): ``w <- w - lr lambda (w - theta)``."""
    torch._foreach_add_(list(local), torch._foreach_sub(list(local), list(theta)),
                        alpha=-lr * lam)


def pfedme_server_update(global_: np.ndarray, average: np.ndarray, beta: float) -> np.ndarray:
    """pFedMe's server step (Algorithm 1 line 12): ``w <- (1 - beta) w + beta avg_i w_i``."""
    return (1.0 - beta) * global_ + beta * average


@dataclass(frozen=True)
class PFedMeParams(Params):
    prefix = "pfedme"

    lambda_: float = param(15.0, "Moreau-envelope weight lambda.", minimum=0.0,
                           exclusive_minimum=True, search=(5.0, 15.0, 30.0))
    k: int = param(5, "Gradient steps K on the inner problem per mini-batch.", minimum=1)
    personal_lr: float = param(0.05, "Step size of the inner (personal) steps.", minimum=0.0,
                               exclusive_minimum=True)
    beta: float = param(1.0, "Server mixing beta in (1 - beta) w + beta avg(w_i) (1 is FedAvg's "
                        "average).", minimum=0.0, exclusive_minimum=True)


@dataclass
class PFedMeClientState(ArrayState):
    #: the personalized model theta
    personal: TorchState | None = None


class PFedMe(Method):
    name = "pfedme"
    summary = ("Personal models as Moreau-envelope proximal points of the local model (K inner "
               "steps per batch); the server mixes with beta.")
    paper = ("T Dinh, Tran, Nguyen, Personalized Federated Learning with Moreau Envelopes, "
             "NeurIPS 2020")
    Params = PFedMeParams
    ClientState = PFedMeClientState
    local_optimizer = False

    def _inner_step_(self, theta: list[torch.Tensor], w: list[torch.Tensor]) -> None:
        """One step on the inner problem, ``grad f(theta)`` in ``theta[k].grad``."""
        p = self.params
        pfedme_inner_step_(theta, w, p.lambda_, p.personal_lr)

    def _solve(self, client: ClientRuntime, theta: nn.Module, local: nn.Module,
               server_round: int, stream: int, epochs: int | None, move_local: bool,
               ) -> tuple[float, int]:
        p = self.params
        th = [q for q in theta.parameters() if q.requires_grad]
        w = [q for q in local.parameters() if q.requires_grad]
        theta.train()
        loss_sum, seen, steps = 0.0, 0, 0
        for x, y in client.batches(server_round, stream, epochs):
            for _ in range(p.k):
                theta.zero_grad(set_to_none=True)
                loss = F.cross_entropy(theta(x), y)
                loss.backward()
                self._inner_step_(th, w)
            if move_local:
                pfedme_outer_step_(w, th, p.lambda_, client.training.lr)
            loss_sum += float(loss.detach()) * len(y)
            seen += len(y)
            steps += 1
        return loss_sum / max(seen, 1), steps

    def train(self, client: ClientRuntime, received: Received, state: PFedMeClientState,
              ) -> tuple[Upload, PFedMeClientState]:
        local = client.new_model(received.model)
        theta = client.new_model(received.model)
        loss, steps = self._solve(client, theta, local, received.server_round, STREAM_TRAIN,
                                  None, True)
        personal = theta.state_dict()
        local.load_state_dict({k: v for k, v in personal.items()
                               if k not in dict(local.named_parameters())}, strict=False)
        return (Upload(local.state_dict(), {TRAIN_LOSS: loss, LOCAL_STEPS: steps}),
                PFedMeClientState(personal))

    def evaluate(self, client: ClientRuntime, received: Received,
                 state: PFedMeClientState) -> dict:
        global_model = client.new_model(received.model)
        global_result = client.test(global_model)
        if state.personal is None:
            theta = client.new_model(received.model)
            self._solve(client, theta, global_model, received.server_round, STREAM_FINETUNE, 1,
                        False)
        else:
            theta = client.new_model(state.personal)
        return client.eval_metrics(client.test(theta), global_result)

    def aggregate(self, server: ServerRuntime, state: ServerState, server_round: int,
                  updates: Sequence[Update]) -> tuple[ServerState, dict[str, float]]:
        """beta-mixing of the trainable entries; buffers (batch-norm statistics) are averaged."""
        spec = server.trainable_spec
        weights = [u.num_examples for u in updates]
        average = server.combine([spec.flatten(u.model, np.float64) for u in updates], weights)
        current = spec.flatten(state.model, np.float64)
        mixed = spec.unflatten(pfedme_server_update(current, average, self.params.beta))
        return server.with_model(state, {**server.average([u.model for u in updates], weights),
                                         **mixed}), {}
