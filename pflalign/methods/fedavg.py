"""FedAvg (McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized
Data, AISTATS 2017).

Client: train the received global model with the run's local optimizer and upload it; the
client's model is the global model. Server: ``theta_g <- sum_i n_i theta_i / sum_i n_i`` over the
round's clients (ALGORITHMS.md 1.6), the :class:`~pflalign.method.Method` default.
"""

from __future__ import annotations

from pflalign.client import ClientRuntime, Received, Upload
from pflalign.method import Method
from pflalign.protocol import LOCAL_STEPS, TRAIN_LOSS
from pflalign.state import NoClientState


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
