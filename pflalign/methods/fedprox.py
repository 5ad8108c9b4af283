"""FedProx (Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020).

Client: local training on ``F_i(w) + mu/2 ||w - w_g||^2``: the proximal term's gradient
``mu (w - w_g)`` is added to every mini-batch gradient before the step
(:func:`pflalign.baselines.add_proximal_`), with ``w_g`` the global model received this round.
With ``mu = 0`` the update is FedAvg's, bit for bit. Server: FedAvg's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pflalign.baselines import add_proximal_
from pflalign.client import ClientRuntime, Received, Upload
from pflalign.methods.fedavg import FedAvg
from pflalign.params import Params, param
from pflalign.protocol import LOCAL_STEPS, TRAIN_LOSS
from pflalign.state import NoClientState

if TYPE_CHECKING:
    from pflalign.cohort import Cohort


@dataclass(frozen=True)
class FedProxParams(Params):
    prefix = "fedprox"

    mu: float = param(0.01, "Weight mu of the proximal term mu/2 ||w - w_global||^2 (0 is "
                      "FedAvg).", minimum=0.0,
                      search=(0.001, 0.01, 0.1, 1.0))


class FedProx(FedAvg):
    name = "fedprox"
    summary = ("FedAvg with a proximal term mu/2 ||w - w_global||^2 in each client's local "
               "objective.")
    paper = "Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020"
    Params = FedProxParams

    def train(self, client: ClientRuntime, received: Received, state: NoClientState,
              ) -> tuple[Upload, NoClientState]:
        model = client.new_model(received.model)
        params = [p for p in model.parameters() if p.requires_grad]
        anchor = [p.detach().clone() for p in params]
        mu = self.params.mu
        stats = client.local_train(model, received.server_round,
                                   before_step=lambda: add_proximal_(params, anchor, mu))
        return Upload(model.state_dict(), {TRAIN_LOSS: stats.loss, LOCAL_STEPS: stats.steps}), state

    def train_cohort(self, cohort: Cohort, received: Sequence[Received],
                     states: Sequence[NoClientState]) -> list[tuple[Upload, NoClientState]]:
        server_round = received[0].server_round
        params = cohort.stack([r.model for r in received])
        anchors = {n: p.clone() for n, p in params.items()}
        optimizers = cohort.optimizers(params, server_round)
        views = [cohort.optimized(opt) for opt in optimizers]
        mu = self.params.mu
        stats = cohort.local_train(params, server_round, optimizers, before_step=lambda i:
                                   add_proximal_(views[i], cohort.views(anchors, i), mu))
        return [(Upload(cohort.state_dict(params, i, r.model),
                        {TRAIN_LOSS: s.loss, LOCAL_STEPS: s.steps}), state)
                for i, (r, s, state) in enumerate(zip(received, stats, states, strict=True))]
