"""Local-only client half: the client's own model, trained only on its own data.

The model persists across rounds in the node's state (``local.model``). A client that has not
trained yet starts from the run's common initial model, which the server sends only then.
"""

from __future__ import annotations

from clients.base import ClientMethod, FitResult, TorchState


class LocalClient(ClientMethod):
    def _model(self, initial_state: TorchState | None):
        return self.new_model(self.state.get_arrays("model") or initial_state)

    def fit(self, global_state: TorchState | None, server_round: int) -> FitResult:
        model = self._model(global_state)
        stats = self.local_train(model, server_round)
        self.state.set_arrays("model", model.state_dict())
        return FitResult(None, {"train-loss": stats.loss, "local-steps": stats.steps})

    def evaluate(self, global_state: TorchState | None, server_round: int) -> dict:
        return self.eval_metrics(self.test(self._model(global_state)))
