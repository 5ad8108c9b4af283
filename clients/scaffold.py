"""SCAFFOLD client half (Karimireddy et al., ICML 2020, Algorithm 1, option II).

Each step uses the corrected gradient ``g(y) - c_i + c`` (plain SGD at rate ``lr``). After ``K``
steps the client's control variate becomes ``c_i+ = c_i - c + (x - y) / (K lr)``; the client keeps
``c_i+`` in its state and uploads its model ``y`` with ``dc = c_i+ - c_i`` (record
``control-delta``). The server's control variate ``c`` arrives as the record ``control``; a client
that has not trained yet has ``c_i = 0``, and before the server has any ``c`` it is 0 too.

Option II's estimate assumes plain SGD: with ``momentum`` or ``weight-decay`` the step is no longer
``lr g``, so the client refuses them (a clear error, not a silently wrong variate).
"""

from __future__ import annotations

import torch

from clients.base import FitResult, RoundInput
from clients.fedavg import FedAvgClient
from pflalign.baselines import add_control_variates_, scaffold_client_control

CONTROL, CONTROL_DELTA = "control", "control-delta"


class ScaffoldClient(FedAvgClient):
    def fit(self, inputs: RoundInput) -> FitResult:
        s = self.settings
        if float(s["momentum"]) or float(s["weight-decay"]):
            raise ValueError("scaffold's control variates (option II) assume plain SGD; set "
                             "momentum = 0 and weight-decay = 0 for it.")
        model = self.new_model(inputs.global_state)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        start = [p.detach().clone() for p in params]
        zeros = [torch.zeros_like(p) for p in params]
        server = inputs.records.get(CONTROL)
        own = self.state.get_arrays(CONTROL)
        c = [server[n].to(self.device) for n, _ in named] if server else zeros
        c_i = [own[n].to(self.device) for n, _ in named] if own else zeros
        stats = self.local_train(model, inputs.server_round,
                                 before_step=lambda: add_control_variates_(params, c, c_i))
        new_c_i = scaffold_client_control(c_i, c, start, params, stats.steps, float(s["lr"]))
        names = [n for n, _ in named]
        self.state.set_arrays(CONTROL, dict(zip(names, new_c_i, strict=True)))
        delta = torch._foreach_sub(new_c_i, c_i)
        return FitResult(model.state_dict(), {"train-loss": stats.loss, "local-steps": stats.steps},
                         records={CONTROL_DELTA: dict(zip(names, delta, strict=True))})
