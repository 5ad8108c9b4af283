"""FedAvg (McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized
Data, AISTATS 2017).

Client: train the received global model with the run's local optimizer and upload it; the
client's model is the global model. Server: ``theta_g <- sum_i n_i theta_i / sum_i n_i`` over the
round's clients (ALGORITHMS.md 1.6), the :class:`~pflalign.method.Method` default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pflalign.client import ClientRuntime, Received, Upload
from pflalign.method import Method
from pflalign.protocol import LOCAL_STEPS, TRAIN_LOSS
from pflalign.state import NoClientState

if TYPE_CHECKING:
    from pflalign.cohort import Cohort


class FedAvg(Method):
    name = "fedavg"
    summary = ("Sample-weighted averaging of locally trained models; every client uses the "
               "global model.")
    paper = ("McMahan et al., Communication-Efficient Learning of Deep Networks from "
             "Decentralized Data, AISTATS 2017")

    def train(self, client: ClientRuntime, received: Received, state: NoClientState,
              ) -> tuple[Upload, NoClientState]:
        model = client.new_model(received.model)
        stats = client.local_train(model, received.server_round)
        return Upload(model.state_dict(), {TRAIN_LOSS: stats.loss, LOCAL_STEPS: stats.steps}), state

    def evaluate(self, client: ClientRuntime, received: Received, state: NoClientState) -> dict:
        result = client.test(client.new_model(received.model))
        return client.eval_metrics(result, result)

    def train_cohort(self, cohort: Cohort, received: Sequence[Received],
                     states: Sequence[NoClientState]) -> list[tuple[Upload, NoClientState]]:
        server_round = received[0].server_round
        params = cohort.stack([r.model for r in received])
        stats = cohort.local_train(params, server_round, cohort.optimizers(params, server_round))
        return [(Upload(cohort.state_dict(params, i, r.model),
                        {TRAIN_LOSS: s.loss, LOCAL_STEPS: s.steps}), state)
                for i, (r, s, state) in enumerate(zip(received, stats, states, strict=True))]

    def evaluate_cohort(self, cohort: Cohort, received: Sequence[Received],
                        states: Sequence[NoClientState]) -> list[dict]:
        results = [cohort.test(cohort.model(r.model), i) for i, r in enumerate(received)]
        return [cohort.eval_metrics(result, result) for result in results]
