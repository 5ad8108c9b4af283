"""FedAvg + fine-tuning client half: evaluation fine-tunes the global model locally first.

Training is FedAvg's. At evaluation the client scores the global model (global-acc), then trains a
copy on its own train split for ``finetune-epochs`` (seeded stream STREAM_FINETUNE) and scores that
copy (personal-acc). Unseen clients follow the same procedure: it is how a new client would adopt
the global model.
"""

from __future__ import annotations

from clients.base import RoundInput
from clients.fedavg import FedAvgClient
from pflalign.train import STREAM_FINETUNE


class FedAvgFineTuneClient(FedAvgClient):
    def evaluate(self, inputs: RoundInput) -> dict:
        model = self.new_model(inputs.global_state)
        global_result = self.test(model)
        self.local_train(model, inputs.server_round, stream=STREAM_FINETUNE,
                         epochs=int(self.settings["finetune-epochs"]))
        return self.eval_metrics(self.test(model), global_result)
