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

from dataclasses import dataclass

from pflalign.methods.fedavg import FedAvg, trained_upload
from pflalign.settings.params import Params, log_range, param
from pflalign.training.client import ClientRuntime
from pflalign.training.corrections import Proximal
from pflalign.training.loops import STREAM_PERSONAL
from pflalign.training.runs import LocalRun, Rule
from pflalign.wire.messages import Received
from pflalign.wire.protocol import LOSS
from pflalign.wire.state import ArrayState, TorchState


@dataclass(frozen=True)
class DittoParams(Params):
    prefix = "ditto"

    lambda_: float = param(0.1, "Weight lambda of the personal model's proximal pull lambda/2 "
                           "||v - w_global||^2.", minimum=0.0,
                           search=log_range(0.01, 1.0))
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
    #: the personal model's training loss
    train_metrics = {"personal-train-loss": LOSS}
    ClientState = DittoClientState

    def personal_run(self, received: Received, personal: TorchState) -> LocalRun:
        """``v`` trained on the local loss plus ``lambda/2 ||v - w^t||^2`` (the received global
        model as ``w^t``) for ``ditto-personal-epochs``."""
        return LocalRun(personal, stream=STREAM_PERSONAL, epochs=self.params.personal_epochs,
                        correction=Proximal(received.model, self.params.lambda_))

    def train(self, client: ClientRuntime, received: Received, state: DittoClientState) -> Rule:
        result = yield LocalRun(received.model)
        personal = yield self.personal_run(received, state.personal or received.model)
        return (trained_upload(result, **{"personal-train-loss": personal.stats.loss}),
                DittoClientState(personal.model))

    def evaluate(self, client: ClientRuntime, received: Received,
                 state: DittoClientState) -> Rule:
        global_result = client.test(received.model)
        personal = state.personal
        if personal is None:  # a new client fits v from the global model: Ditto's procedure
            personal = (yield self.personal_run(received, received.model)).model
        return client.eval_metrics(client.test(personal), global_result)
