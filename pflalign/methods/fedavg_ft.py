"""FedAvg + local fine-tuning (e.g. Wang et al., Federated Evaluation of On-device
Personalization, 2019).

Training is FedAvg's. At evaluation the client scores the global model (global-acc), then trains a
copy on its own train split for ``finetune-epochs`` (seeded stream STREAM_FINETUNE) and scores that
copy (personal-acc). Unseen clients follow the same procedure: it is how a new client would adopt
the global model.
"""

from __future__ import annotations

from dataclasses import dataclass

from pflalign.methods.fedavg import FedAvg
from pflalign.settings.params import Params, param
from pflalign.training.client import ClientRuntime
from pflalign.training.loops import STREAM_FINETUNE
from pflalign.training.runs import LocalRun, Rule
from pflalign.wire.messages import Received
from pflalign.wire.state import NoClientState

FINETUNE_HELP = ("Local epochs of fine-tuning before evaluation (fedavg-ft: of the global model; "
                 "fedper, fedrep, fedbn: of a new client's personal part).")


@dataclass(frozen=True)
class FineTuneParams(Params):
    group = "fedavg-ft"

    finetune_epochs: int = param(1, FINETUNE_HELP, key="finetune-epochs", minimum=1,
                                 group="fedavg-ft")


class FedAvgFineTune(FedAvg):
    name = "fedavg-ft"
    summary = ("FedAvg, and each client's model is the global model fine-tuned locally for "
               "finetune-epochs before evaluation.")
    paper = ("FedAvg + local fine-tuning (e.g. Wang et al., Federated Evaluation of On-device "
             "Personalization, 2019)")
    Params = FineTuneParams

    def evaluate(self, client: ClientRuntime, received: Received, state: NoClientState) -> Rule:
        global_result = client.test(received.model)
        tuned = yield LocalRun(received.model, stream=STREAM_FINETUNE,
                               epochs=self.params.finetune_epochs)
        return client.eval_metrics(client.test(tuned.model), global_result)
