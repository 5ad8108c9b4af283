"""FedAvg client half: train the received global model; the personal model IS the global model."""

from __future__ import annotations

from clients.base import ClientMethod, FitResult, TorchState


class FedAvgClient(ClientMethod):
    def fit(self, global_state: TorchState | None, server_round: int) -> FitResult:
        model = self.new_model(global_state)
        stats = self.local_train(model, server_round)
        return FitResult(model.state_dict(), {"train-loss": stats.loss, "local-steps": stats.steps})

    def evaluate(self, global_state: TorchState | None, server_round: int) -> dict:
        result = self.test(self.new_model(global_state))
        return self.eval_metrics(result, result)
