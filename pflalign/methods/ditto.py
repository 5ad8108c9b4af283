"""Ditto (Li et al., Ditto: Fair and Robust Federated Learning Through Personalization, ICML
2021, Algorithm 1).

Client, each round: (1) train a copy of the global model ``w`` as FedAvg does and upload it;
(2) train the personal model ``v`` for ``ditto-personal-epochs`` epochs on
``F_i(v) + lambda/2 ||v - w^t||^2`` with ``w^t`` the global model received this round (rate
``lr``). ``v`` persists in the client's state; it is what ``personal-acc`` scores, and
``global-acc`` scores ``w``. A client without ``v`` (unseen, or not sampled yet) starts it from the
global model: at evaluation it fits ``v`` by the same personal step, which is Ditto's procedure
for a new client. Server: FedAvg's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from pflalign.baselines import add_proximal_
from pflalign.client import ClientRuntime, Received, Upload
from pflalign.methods.fedavg import FedAvg
from pflalign.params import Params, param
from pflalign.protocol import LOCAL_STEPS, TRAIN_LOSS
from pflalign.state import ArrayState, TorchState
from pflalign.train import STREAM_PERSONAL, TrainStats

if TYPE_CHECKING:
    from pflalign.cohort import Cohort


@dataclass(frozen=True)
class DittoParams(Params):
    prefix = "ditto"

    lambda_: float = param(0.1, "Weight lambda of the personal model's proximal pull lambda/2 "
                           "||v - w_global||^2.", minimum=0.0,
                           search=(0.01, 0.1, 1.0))
    personal_epochs: int = param(1, "Local epochs of the personal model per round.", minimum=1)


@dataclass
class DittoClientState(ArrayState):
    #: the personal model v
    personal: TorchState | None = None


class Ditto(FedAvg):
    name = "ditto"
    summary = ("FedAvg for the global model, plus a personal model per client trained with a "
               "proximal pull lambda/2 ||v - w_global||^2.")
    paper = ("Li et al., Ditto: Fair and Robust Federated Learning Through Personalization, "
             "ICML 2021")
    Params = DittoParams
    ClientState = DittoClientState

    def personal_step(self, client: ClientRuntime, personal: nn.Module, global_model: nn.Module,
                      server_round: int) -> TrainStats:
        """Train ``v`` on the local loss plus ``lambda/2 ||v - w^t||^2``."""
        params = [p for p in personal.parameters() if p.requires_grad]
        anchor = [p.detach() for p in global_model.parameters() if p.requires_grad]
        lam = self.params.lambda_
        return client.local_train(personal, server_round, stream=STREAM_PERSONAL,
                                  epochs=self.params.personal_epochs,
                                  before_step=lambda: add_proximal_(params, anchor, lam))

    def train(self, client: ClientRuntime, received: Received, state: DittoClientState,
              ) -> tuple[Upload, DittoClientState]:
        global_model = client.new_model(received.model)
        model = client.new_model(received.model)
        stats = client.local_train(model, received.server_round)
        personal = client.new_model(state.personal or received.model)
        personal_stats = self.personal_step(client, personal, global_model, received.server_round)
        upload = Upload(model.state_dict(), {TRAIN_LOSS: stats.loss, LOCAL_STEPS: stats.steps,
                                             "personal-train-loss": personal_stats.loss})
        return upload, DittoClientState(personal.state_dict())

    def personal_step_cohort(self, cohort: Cohort, personal: dict[str, torch.Tensor],
                             anchors: dict[str, torch.Tensor], server_round: int,
                             ) -> list[TrainStats]:
        """:meth:`personal_step` for every client of ``cohort``: ``personal`` and ``anchors``
        stacked."""
        optimizers = cohort.optimizers(personal, server_round, STREAM_PERSONAL)
        views = [cohort.optimized(opt) for opt in optimizers]
        lam = self.params.lambda_
        return cohort.local_train(
            personal, server_round, optimizers, stream=STREAM_PERSONAL,
            epochs=self.params.personal_epochs,
            before_step=lambda i: add_proximal_(views[i], cohort.views(anchors, i), lam))

    def train_cohort(self, cohort: Cohort, received: Sequence[Received],
                     states: Sequence[DittoClientState],
                     ) -> list[tuple[Upload, DittoClientState]]:
        server_round = received[0].server_round
        anchors = cohort.stack([r.model for r in received])
        params = {n: p.clone() for n, p in anchors.items()}
        stats = cohort.local_train(params, server_round, cohort.optimizers(params, server_round))
        starts = [s.personal or r.model for r, s in zip(received, states, strict=True)]
        personal = cohort.stack(starts)
        personal_stats = self.personal_step_cohort(cohort, personal, anchors, server_round)
        return [(Upload(cohort.state_dict(params, i, r.model),
                        {TRAIN_LOSS: stats[i].loss, LOCAL_STEPS: stats[i].steps,
                         "personal-train-loss": personal_stats[i].loss}),
                 DittoClientState(cohort.state_dict(personal, i, starts[i])))
                for i, r in enumerate(received)]

    def evaluate_cohort(self, cohort: Cohort, received: Sequence[Received],
                        states: Sequence[DittoClientState]) -> list[dict]:
        global_results = [cohort.test(cohort.model(r.model, "global"), i)
                          for i, r in enumerate(received)]
        # a client without v fits it from the global model, as in evaluate
        personal = cohort.personal_models(
            {i: s.personal for i, s in enumerate(states) if s.personal is not None}, received,
            lambda part, v, anchors: self.personal_step_cohort(part, v, anchors,
                                                               received[0].server_round))
        return [cohort.eval_metrics(cohort.test(cohort.model(personal[i], "personal"), i),
                                    global_results[i]) for i in range(len(cohort))]

    def evaluate(self, client: ClientRuntime, received: Received,
                 state: DittoClientState) -> dict:
        global_model = client.new_model(received.model)
        global_result = client.test(global_model)
        if state.personal is None:
            personal = client.new_model(received.model)
            self.personal_step(client, personal, global_model, received.server_round)
        else:
            personal = client.new_model(state.personal)
        return client.eval_metrics(client.test(personal), global_result)
