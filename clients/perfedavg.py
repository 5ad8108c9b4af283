"""Per-FedAvg client half, first-order version (Fallah, Mokhtari, Ozdaglar, Personalized
Federated Learning with Theoretical Guarantees: A Model-Agnostic Meta-Learning Approach,
NeurIPS 2020, Algorithm 1 with the FO approximation).

Each local step takes two mini-batches ``D``, ``D'`` from the shuffled stream:
``w_tmp = w - alpha grad f(w; D)``, then ``w <- w - beta grad f(w_tmp; D')`` (the gradient at the
adapted point, applied to the meta-parameters). A round has ``floor(T / 2)`` such steps for the
``T`` batches plain training would use (at least one; a client with a single batch uses it twice).
The meta-model is uploaded and averaged as in FedAvg.

Personalization (also for unseen clients): from the global model, ``perfedavg-eval-steps`` steps
of SGD at rate ``perfedavg-alpha`` on mini-batches of the client's train split; ``personal-acc``
scores the adapted model, ``global-acc`` the meta-model.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from clients.base import ClientMethod, FitResult, RoundInput
from pflalign.train import STREAM_FINETUNE


class PerFedAvgClient(ClientMethod):
    def fit(self, inputs: RoundInput) -> FitResult:
        s = self.settings
        alpha, beta = float(s["perfedavg-alpha"]), float(s["perfedavg-beta"])
        model = self.new_model(inputs.global_state)
        params = [p for p in model.parameters() if p.requires_grad]
        model.train()
        batches = list(self.batches(inputs.server_round))
        pairs = list(zip(batches[0::2], batches[1::2], strict=False)) or [(batches[0],
                                                                            batches[0])]
        loss_sum, seen = 0.0, 0
        for (x1, y1), (x2, y2) in pairs:
            saved = [p.detach().clone() for p in params]
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x1), y1)
            loss.backward()
            with torch.no_grad():
                torch._foreach_add_(params, [p.grad for p in params], alpha=-alpha)
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x2), y2).backward()
            with torch.no_grad():
                torch._foreach_copy_(params, saved)
                torch._foreach_add_(params, [p.grad for p in params], alpha=-beta)
            loss_sum += float(loss.detach()) * len(y1)
            seen += len(y1)
        return FitResult(model.state_dict(), {"train-loss": loss_sum / max(seen, 1),
                                              "local-steps": len(pairs)})

    def personalize(self, inputs: RoundInput) -> torch.nn.Module:
        """``perfedavg-eval-steps`` SGD steps at rate ``perfedavg-alpha`` from the global model."""
        s = self.settings
        model = self.new_model(inputs.global_state)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(params, lr=float(s["perfedavg-alpha"]))
        model.train()
        steps = int(s["perfedavg-eval-steps"])
        stream = self.batches(inputs.server_round, STREAM_FINETUNE, epochs=steps)
        for x, y in itertools.islice(stream, steps):
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        return model

    def evaluate(self, inputs: RoundInput) -> dict:
        global_result = self.test(self.new_model(inputs.global_state))
        return self.eval_metrics(self.test(self.personalize(inputs)), global_result)
