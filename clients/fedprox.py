"""FedProx client half (Li et al., MLSys 2020): local SGD on ``F_i(w) + mu/2 ||w - w_g||^2``.

The proximal term's gradient ``mu (w - w_g)`` is added to every mini-batch gradient before the
step (:func:`pflalign.baselines.add_proximal_`), with ``w_g`` the global model received this
round. With ``fedprox-mu = 0`` the update is FedAvg's, bit for bit. The server half is FedAvg's.
"""

from __future__ import annotations

from clients.base import FitResult, RoundInput
from clients.fedavg import FedAvgClient
from pflalign.baselines import add_proximal_


class FedProxClient(FedAvgClient):
    def fit(self, inputs: RoundInput) -> FitResult:
        model = self.new_model(inputs.global_state)
        params = [p for p in model.parameters() if p.requires_grad]
        anchor = [p.detach().clone() for p in params]
        mu = float(self.settings["fedprox-mu"])
        stats = self.local_train(model, inputs.server_round,
                                 before_step=lambda: add_proximal_(params, anchor, mu))
        return FitResult(model.state_dict(), {"train-loss": stats.loss,
                                              "local-steps": stats.steps})
