"""FedAvg + local fine-tuning (e.g. Wang et al., Federated Evaluation of On-device
Personalization, 2019).

Training is FedAvg's. At evaluation the client scores the global model (global-acc), then trains a
copy on its own train split for ``finetune-epochs`` (seeded stream STREAM_FINETUNE) and scores that
copy (personal-acc). Unseen clients follow the same procedure: it is how a new client would adopt
the global model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pflalign.client import ClientRuntime, Received
from pflalign.methods.fedavg import FedAvg
from pflalign.params import Params, param
from pflalign.state import NoClientState
from pflalign.train import STREAM_FINETUNE

if TYPE_CHECKING:
    from pflalign.cohort import Cohort

FINETUNE_HELP = ("Local epochs of fine-tuning before evaluation (fedavg-ft: of the global model; "
                 "fedper, fedrep, fedbn: of a new client's personal part).")


@dataclass(frozen=True)
class FineTuneParams(Params):
    group = "fedavg-ft"

    finetune_epochs: int = param(1, FINETUNE_HELP, key="finetune-epochs", minimum=1)


class FedAvgFineTune(FedAvg):
    name = "fedavg-ft"
    summary = ("FedAvg, and each client's model is the global model fine-tuned locally for "
               "finetune-epochs before evaluation.")
    paper = ("FedAvg + local fine-tuning (e.g. Wang et al., Federated Evaluation of On-device "
             "Personalization, 2019)")
    Params = FineTuneParams

    def evaluate(self, client: ClientRuntime, received: Received, state: NoClientState) -> dict:
        model = client.new_model(received.model)
        global_result = client.test(model)
        client.local_train(model, received.server_round, stream=STREAM_FINETUNE,
                           epochs=self.params.finetune_epochs)
        return client.eval_metrics(client.test(model), global_result)

    def evaluate_cohort(self, cohort: Cohort, received: Sequence[Received],
                        states: Sequence[NoClientState]) -> list[dict]:
        server_round = received[0].server_round
        global_results = [cohort.test(cohort.model(r.model), i) for i, r in enumerate(received)]
        params = cohort.stack([r.model for r in received])
        cohort.local_train(params, server_round,
                           cohort.optimizers(params, server_round, STREAM_FINETUNE),
                           stream=STREAM_FINETUNE, epochs=self.params.finetune_epochs)
        return [cohort.eval_metrics(cohort.test(
            cohort.model(cohort.state_dict(params, i, r.model), "tuned"), i), global_results[i])
            for i, r in enumerate(received)]
