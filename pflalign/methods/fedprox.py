"""FedProx (Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020).

Client: local training on ``F_i(w) + mu/2 ||w - w_g||^2``: the proximal term's gradient
``mu (w - w_g)`` is added to every mini-batch gradient before the step
(:class:`~pflalign.training.corrections.Proximal`), with ``w_g`` the global model received
this round. With ``mu = 0`` the update is FedAvg's, bit for bit. Server: FedAvg's.
"""

from __future__ import annotations

from dataclasses import dataclass

from pflalign.methods.fedavg import FedAvg, trained_upload
from pflalign.settings.params import Params, log_range, param
from pflalign.training.client import ClientRuntime
from pflalign.training.corrections import Proximal
from pflalign.training.runs import LocalRun, Rule
from pflalign.wire.messages import Received
from pflalign.wire.state import NoClientState


@dataclass(frozen=True)
class FedProxParams(Params):
    prefix = "fedprox"

    mu: float = param(0.01, "Weight mu of the proximal term mu/2 ||w - w_global||^2 (0 is "
                      "FedAvg).", minimum=0.0,
                      search=log_range(0.001, 1.0))


class FedProx(FedAvg):
    name = "fedprox"
    summary = ("FedAvg with a proximal term mu/2 ||w - w_global||^2 in each client's local "
               "objective.")
    paper = "Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020"
    Params = FedProxParams

    def train(self, client: ClientRuntime, received: Received, state: NoClientState) -> Rule:
        result = yield LocalRun(received.model,
                                correction=Proximal(received.model, self.params.mu))
        return trained_upload(result), state
