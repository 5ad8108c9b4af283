"""FedAvg client half: train the received global model; the personal model IS the global model."""

from __future__ import annotations

from clients.base import ClientMethod, FitResult, RoundInput


class FedAvgClient(ClientMethod):
    def fit(self, inputs: RoundInput) -> FitResult:
        model = self.new_model(inputs.global_state)
        stats = self.local_train(model, inputs.server_round)
        return FitResult(model.state_dict(), {"train-loss": stats.loss, "local-steps": stats.steps})

    def evaluate(self, inputs: RoundInput) -> dict:
        result = self.test(self.new_model(inputs.global_state))
        return self.eval_metrics(result, result)
