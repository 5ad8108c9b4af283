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

from pflalign.methods.base import Method
from pflalign.server.runtime import ServerRuntime
from pflalign.settings.params import Params, log_range, param
from pflalign.training.client import ClientRuntime
from pflalign.training.corrections import Proximal
from pflalign.training.loops import STREAM_FINETUNE, STREAM_TRAIN
from pflalign.training.optim.common import Tensors
from pflalign.training.optimizers import PlainSGD
from pflalign.training.runs import LocalRun, Rule
from pflalign.wire.messages import Received, Update, Upload
from pflalign.wire.protocol import LOCAL_STEPS, TRAIN_LOSS
from pflalign.wire.state import ArrayState, ServerState, TorchState


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
                           exclusive_minimum=True, search=log_range(5.0, 30.0))
    k: int = param(5, "Gradient steps K on the inner problem per mini-batch.", minimum=1)
    personal_lr: float = param(0.05, "Step size of the inner (personal) steps.", minimum=0.0,
                               exclusive_minimum=True)
    beta: float = param(1.0, "Server mixing beta in (1 - beta) w + beta avg(w_i) (1 is FedAvg's "
                        "average).", minimum=0.0, exclusive_minimum=True)


@dataclass
class PFedMeClientState(ArrayState):
    #: the personalized model theta
    personal: TorchState | None = None


@dataclass(frozen=True)
class MoreauEnvelope(Proximal):
    """pFedMe's inner problem as a correction: ``g += lambda (theta - w)`` at every inner step
    (eq. 7, the gradient of ``lambda/2 ||theta - w||^2``), and after each batch's K steps the
    local model moves, ``w <- w - lr lambda (w - theta)`` (Algorithm 1 line 8,
    :func:`pfedme_outer_step_`). ``anchor`` is ``w``; ``mu`` is ``lambda``."""

    lr: float

    def end_batch_(self, params: list[torch.Tensor], names: Sequence[str]) -> None:
        pfedme_outer_step_([self.anchor[n] for n in names], params, self.mu, self.lr)


class PFedMe(Method):
    name = "pfedme"
    summary = ("Personal models as Moreau-envelope proximal points of the local model (K inner "
               "steps per batch); the server mixes with beta.")
    paper = ("T Dinh, Tran, Nguyen, Personalized Federated Learning with Moreau Envelopes, "
             "NeurIPS 2020")
    Params = PFedMeParams
    ClientState = PFedMeClientState
    local_optimizer = False
    private = True  # its server mixes the average of the uploaded models with beta

    def _solve(self, client: ClientRuntime, received: Received, stream: int,
               epochs: int | None, correction: Proximal) -> LocalRun:
        """The inner problem solved batch by batch from the global model: ``pfedme-k`` steps of
        plain SGD at ``pfedme-personal-lr`` per batch, with the proximal pull to ``w``."""
        p = self.params
        return LocalRun(received.model, stream=stream, epochs=epochs, steps_per_batch=p.k,
                        optimizer=PlainSGD(p.personal_lr), correction=correction)

    def _anchor(self, client: ClientRuntime, received: Received) -> dict[str, torch.Tensor]:
        return {n: received.model[n] for n in client.template.trainable}

    def train(self, client: ClientRuntime, received: Received, state: PFedMeClientState,
              ) -> Rule:
        p = self.params
        envelope = MoreauEnvelope(self._anchor(client, received), p.lambda_, client.training.lr)
        result = yield self._solve(client, received, STREAM_TRAIN, None, envelope)
        personal = result.model  # theta; the local model w is the moved anchor
        local = {**personal, **result.correction.anchor}
        return (Upload(local, {TRAIN_LOSS: result.stats.loss, LOCAL_STEPS: result.stats.steps}),
                PFedMeClientState(personal))

    def evaluate(self, client: ClientRuntime, received: Received,
                 state: PFedMeClientState) -> Rule:
        global_result = client.test(received.model)
        if state.personal is None:  # a new client: theta around the global model, held fixed
            fixed = Proximal(self._anchor(client, received), self.params.lambda_)
            theta = (yield self._solve(client, received, STREAM_FINETUNE, 1, fixed)).model
        else:
            theta = state.personal
        return client.eval_metrics(client.test(theta), global_result)

    def aggregate(self, server: ServerRuntime, state: ServerState, server_round: int,
                  updates: Sequence[Update]) -> tuple[ServerState, dict[str, float]]:
        """beta-mixing of the trainable entries; buffers (batch-norm statistics) are averaged."""
        spec = server.trainable_spec
        weights = [u.num_examples for u in updates]
        average = server.combine([spec.flatten(u.model, np.float64) for u in updates], weights,
                                 spec.keys)
        current = spec.flatten(state.model, np.float64)
        mixed = spec.unflatten(pfedme_server_update(current, average, self.params.beta))
        return server.with_model(state, {**server.average([u.model for u in updates], weights),
                                         **mixed}), {}
