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
``p_i`` (:func:`pflalign.baselines.pfedme_server_update`); ``pfedme-beta = 1`` is FedAvg's average.
Only the sampled clients train in a round (as for every method here; the paper lets all clients
update locally and averages a sampled subset). Buffers are averaged as in FedAvg.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pflalign.baselines import pfedme_inner_step_, pfedme_outer_step_, pfedme_server_update
from pflalign.client import ClientRuntime, Received, Upload
from pflalign.method import Method, Update
from pflalign.params import Params, param
from pflalign.protocol import LOCAL_STEPS, TRAIN_LOSS
from pflalign.server import ServerRuntime
from pflalign.state import ArrayState, ServerState, TorchState
from pflalign.train import STREAM_FINETUNE, STREAM_TRAIN

if TYPE_CHECKING:
    from pflalign.cohort import Cohort, Stacked


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

    def _solve_cohort(self, cohort: Cohort, theta: Stacked, local: Stacked, server_round: int,
                      stream: int, epochs: int | None, move_local: bool,
                      ) -> list[tuple[float, int]]:
        """:meth:`_solve` for every client of ``cohort`` in lockstep (``theta`` and ``local``
        stacked): each step, every client's own next mini-batch and its ``pfedme-k`` inner
        steps."""
        p = self.params
        names = tuple(cohort.names)
        n = len(cohort)
        th = [cohort.views(theta, i) for i in range(n)]
        w = [cohort.views(local, i) for i in range(n)]
        grads = cohort.grads
        orders = cohort.orders(server_round, stream, epochs)
        loss_sum, seen, steps = [0.0] * n, [0] * n, [0] * n
        cohort.module.train()
        for batch, active in cohort.lockstep(orders):
            for _ in range(p.k):
                g, losses = grads(theta, names, batch, active)
                for i in active:
                    for view, grad in zip(th[i], g[i], strict=True):
                        view.grad = grad
                    self._inner_step_(th[i], w[i])
                    for view in th[i]:
                        view.grad = None
            for i in active:
                if move_local:
                    pfedme_outer_step_(w[i], th[i], p.lambda_, cohort.training.lr)
                loss_sum[i] += float(losses[i]) * len(batch[i])
                seen[i] += len(batch[i])
                steps[i] += 1
        return [(loss_sum[i] / max(seen[i], 1), steps[i]) for i in range(n)]

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

    def train_cohort(self, cohort: Cohort, received: Sequence[Received],
                     states: Sequence[PFedMeClientState],
                     ) -> list[tuple[Upload, PFedMeClientState]]:
        # the cohort's models have no batch norm: theta's buffers are the received model's
        local = cohort.stack([r.model for r in received])
        theta = {n: q.clone() for n, q in local.items()}
        solved = self._solve_cohort(cohort, theta, local, received[0].server_round, STREAM_TRAIN,
                                    None, True)
        return [(Upload(cohort.state_dict(local, i, r.model),
                        {TRAIN_LOSS: solved[i][0], LOCAL_STEPS: solved[i][1]}),
                 PFedMeClientState(cohort.state_dict(theta, i, r.model)))
                for i, r in enumerate(received)]

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

    def evaluate_cohort(self, cohort: Cohort, received: Sequence[Received],
                        states: Sequence[PFedMeClientState]) -> list[dict]:
        global_results = [cohort.test(cohort.model(r.model, "global"), i)
                          for i, r in enumerate(received)]
        # the new-client procedure: theta solved around the global model
        personal = cohort.personal_models(
            {i: s.personal for i, s in enumerate(states) if s.personal is not None}, received,
            lambda part, theta, anchors: self._solve_cohort(
                part, theta, anchors, received[0].server_round, STREAM_FINETUNE, 1, False))
        return [cohort.eval_metrics(cohort.test(cohort.model(personal[i], "personal"), i),
                                    global_results[i]) for i in range(len(cohort))]

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
