"""FedAvg (McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized
Data, AISTATS 2017).

Client: train the received global model with the run's local optimizer and upload it; the
client's model is the global model. Server: ``theta_g <- sum_i n_i theta_i / sum_i n_i`` over the
round's clients (docs/algorithms.md 1.6), the :class:`~pflalign.methods.base.Method` default.
"""

from __future__ import annotations

from pflalign.methods.base import Method
from pflalign.training.client import ClientRuntime
from pflalign.training.runs import LocalRun, Rule, RunResult
from pflalign.wire.messages import Received, Upload
from pflalign.wire.protocol import LOCAL_STEPS, TRAIN_LOSS
from pflalign.wire.state import NoClientState


def trained_upload(result: RunResult, **metrics: float | int) -> Upload:
    """The upload of a client that trained ``result``'s model: the model, its training loss and
    step count, and ``metrics``."""
    return Upload(result.model, {TRAIN_LOSS: result.stats.loss, LOCAL_STEPS: result.stats.steps,
                                 **metrics})


class FedAvg(Method):
    asynchronous = True  # its server update is a sample-weighted average of uploads
    private = True  # it uploads its model, which the server only averages
    name = "fedavg"
    summary = ("Sample-weighted averaging of locally trained models; every client uses the "
               "global model.")
    paper = ("McMahan et al., Communication-Efficient Learning of Deep Networks from "
             "Decentralized Data, AISTATS 2017")

    def train(self, client: ClientRuntime, received: Received, state: NoClientState) -> Rule:
        result = yield LocalRun(received.model)
        return trained_upload(result), state

    def evaluate(self, client: ClientRuntime, received: Received, state: NoClientState) -> Rule:
        result = client.test(received.model)
        return client.eval_metrics(result, result)
