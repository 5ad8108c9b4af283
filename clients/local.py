"""Local-only client half: the client's own model, trained only on its own data.

The model persists across rounds in the node's state (``local.model``). A client that has not
trained yet starts from the run's common initial model, which the server sends only then.
"""

from __future__ import annotations

from torch import nn

from clients.base import ClientMethod, FitResult, RoundInput


class LocalClient(ClientMethod):
    def _model(self, inputs: RoundInput) -> nn.Module:
        return self.new_model(self.state.get_arrays("model") or inputs.global_state)

    def fit(self, inputs: RoundInput) -> FitResult:
        model = self._model(inputs)
        stats = self.local_train(model, inputs.server_round)
        self.state.set_arrays("model", model.state_dict())
        return FitResult(None, {"train-loss": stats.loss, "local-steps": stats.steps})

    def evaluate(self, inputs: RoundInput) -> dict:
        return self.eval_metrics(self.test(self._model(inputs)))
