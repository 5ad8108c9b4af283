"""Ditto client half (Li et al., Ditto: Fair and Robust Federated Learning Through
Personalization, ICML 2021, Algorithm 1).

Each round the client (1) trains a copy of the global model ``w`` as FedAvg does and uploads it,
and (2) trains its personal model ``v`` for ``ditto-personal-epochs`` epochs on
``F_i(v) + lambda/2 ||v - w^t||^2`` with ``w^t`` the global model received this round (rate
``lr``). ``v`` persists in the client's state; it is what ``personal-acc`` scores, and
``global-acc`` scores ``w``. A client without ``v`` (unseen, or not sampled yet) starts it from the
global model: at evaluation it fits ``v`` by the same personal step, which is Ditto's procedure
for a new client.
"""

from __future__ import annotations

from torch import nn

from clients.base import FitResult, RoundInput
from clients.fedavg import FedAvgClient
from pflalign.baselines import add_proximal_
from pflalign.train import STREAM_PERSONAL, TrainStats

PERSONAL = "personal"


class DittoClient(FedAvgClient):
    def personal_step(self, personal: nn.Module, global_model: nn.Module,
                      server_round: int) -> TrainStats:
        """Train ``v`` on the local loss plus ``lambda/2 ||v - w^t||^2``."""
        params = [p for p in personal.parameters() if p.requires_grad]
        anchor = [p.detach() for p in global_model.parameters() if p.requires_grad]
        lam = float(self.settings["ditto-lambda"])
        return self.local_train(personal, server_round, stream=STREAM_PERSONAL,
                                epochs=int(self.settings["ditto-personal-epochs"]),
                                before_step=lambda: add_proximal_(params, anchor, lam))

    def fit(self, inputs: RoundInput) -> FitResult:
        received = self.new_model(inputs.global_state)
        model = self.new_model(inputs.global_state)
        stats = self.local_train(model, inputs.server_round)
        personal = self.new_model(self.state.get_arrays(PERSONAL) or inputs.global_state)
        personal_stats = self.personal_step(personal, received, inputs.server_round)
        self.state.set_arrays(PERSONAL, personal.state_dict())
        return FitResult(model.state_dict(), {"train-loss": stats.loss, "local-steps": stats.steps,
                                              "personal-train-loss": personal_stats.loss})

    def evaluate(self, inputs: RoundInput) -> dict:
        global_model = self.new_model(inputs.global_state)
        global_result = self.test(global_model)
        stored = self.state.get_arrays(PERSONAL)
        if stored is None:
            personal = self.new_model(inputs.global_state)
            self.personal_step(personal, global_model, inputs.server_round)
        else:
            personal = self.new_model(stored)
        return self.eval_metrics(self.test(personal), global_result)
