"""pFedMe client half (T Dinh, Tran, Nguyen, Personalized Federated Learning with Moreau
Envelopes, NeurIPS 2020, Algorithm 1).

The client copies the global model into its local model ``w``. For each mini-batch it solves the
inner problem ``theta = argmin f(theta; D) + lambda/2 ||theta - w||^2`` approximately with
``pfedme-k`` gradient steps at rate ``pfedme-personal-lr`` (warm-started from the previous
``theta``; the first from ``w``), then moves ``w <- w - lr lambda (w - theta)``. It uploads ``w``
and keeps ``theta``, its personalized model, which ``personal-acc`` scores. The server mixes
``w_g <- (1 - pfedme-beta) w_g + pfedme-beta avg_i w_i``.

New-client procedure (unseen clients and clients scored before their first training): the inner
problem is solved around the global model (``w`` held fixed at ``w_g``) over one epoch of the
client's train split; ``theta`` is scored.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from clients.base import ClientMethod, FitResult, RoundInput
from pflalign.baselines import pfedme_inner_step_, pfedme_outer_step_
from pflalign.train import STREAM_FINETUNE, STREAM_TRAIN

PERSONAL = "personal"


class PFedMeClient(ClientMethod):
    def _solve(self, theta: nn.Module, local: nn.Module, server_round: int, stream: int,
               epochs: int | None, move_local: bool) -> tuple[float, int]:
        s = self.settings
        lam, k = float(s["pfedme-lambda"]), int(s["pfedme-k"])
        personal_lr, lr = float(s["pfedme-personal-lr"]), float(s["lr"])
        th = [p for p in theta.parameters() if p.requires_grad]
        w = [p for p in local.parameters() if p.requires_grad]
        theta.train()
        loss_sum, seen, steps = 0.0, 0, 0
        for x, y in self.batches(server_round, stream, epochs):
            for _ in range(k):
                theta.zero_grad(set_to_none=True)
                loss = F.cross_entropy(theta(x), y)
                loss.backward()
                pfedme_inner_step_(th, w, lam, personal_lr)
            if move_local:
                pfedme_outer_step_(w, th, lam, lr)
            loss_sum += float(loss.detach()) * len(y)
            seen += len(y)
            steps += 1
        return loss_sum / max(seen, 1), steps

    def fit(self, inputs: RoundInput) -> FitResult:
        local = self.new_model(inputs.global_state)
        theta = self.new_model(inputs.global_state)
        loss, steps = self._solve(theta, local, inputs.server_round, STREAM_TRAIN, None, True)
        self.state.set_arrays(PERSONAL, theta.state_dict())
        local.load_state_dict({k: v for k, v in theta.state_dict().items()
                               if k not in dict(local.named_parameters())}, strict=False)
        return FitResult(local.state_dict(), {"train-loss": loss, "local-steps": steps})

    def evaluate(self, inputs: RoundInput) -> dict:
        global_model = self.new_model(inputs.global_state)
        global_result = self.test(global_model)
        stored = self.state.get_arrays(PERSONAL)
        if stored is None:
            theta = self.new_model(inputs.global_state)
            self._solve(theta, global_model, inputs.server_round, STREAM_FINETUNE, 1, False)
        else:
            theta = self.new_model(stored)
        return self.eval_metrics(self.test(theta), global_result)
