"""Per-FedAvg, first-order version (Fallah, Mokhtari, Ozdaglar, Personalized Federated Learning
with Theoretical Guarantees: A Model-Agnostic Meta-Learning Approach, NeurIPS 2020, Algorithm 1
with the FO approximation).

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

from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F

from pflalign.methods.base import Method
from pflalign.settings.params import Params, param
from pflalign.training.client import ClientRuntime
from pflalign.training.loops import STREAM_FINETUNE
from pflalign.training.optimizers import PlainSGD
from pflalign.training.runs import LocalRun, Rule
from pflalign.wire.messages import Received, Upload
from pflalign.wire.protocol import LOCAL_STEPS, TRAIN_LOSS
from pflalign.wire.state import NoClientState

T = TypeVar("T")


def _pairs(batches: list[T]) -> list[tuple[T, T]]:
    """A round's meta-steps: consecutive batches ``(D, D')``; a single batch is used twice."""
    return list(zip(batches[0::2], batches[1::2], strict=False)) or [(batches[0], batches[0])]


@torch.no_grad()
def _adapt_(params: list[torch.Tensor], grads: list[torch.Tensor], alpha: float,
            ) -> list[torch.Tensor]:
    """``w_tmp = w - alpha grad f(w; D)`` in place; returns ``w`` as it was."""
    saved = [p.detach().clone() for p in params]
    torch._foreach_add_(params, grads, alpha=-alpha)
    return saved


@torch.no_grad()
def _meta_step_(params: list[torch.Tensor], saved: list[torch.Tensor],
                grads: list[torch.Tensor], beta: float) -> None:
    """``w <- w - beta grad f(w_tmp; D')``, ``params`` holding ``w_tmp`` and ``saved`` ``w``."""
    torch._foreach_copy_(params, saved)
    torch._foreach_add_(params, grads, alpha=-beta)


@dataclass(frozen=True)
class PerFedAvgParams(Params):
    prefix = "perfedavg"

    alpha: float = param(0.01, "Inner (adaptation) step size alpha, also used for the "
                         "personalization steps at evaluation (README: alpha >= 0.02 drives the "
                         "meta-model itself to chance accuracy).", minimum=0.0,
                         exclusive_minimum=True, search=(0.005, 0.01, 0.02))
    beta: float = param(0.05, "Outer (meta) step size beta.", minimum=0.0, exclusive_minimum=True,
                        search=(0.02, 0.05, 0.1))
    eval_steps: int = param(1, "SGD steps of personalization from the global model before "
                            "evaluation.", minimum=1)


class PerFedAvg(Method):
    name = "perfedavg"
    summary = ("First-order MAML: the global model is trained to adapt well in one step; clients "
               "personalize by a few SGD steps from it.")
    paper = ("Fallah, Mokhtari, Ozdaglar, Personalized Federated Learning with Theoretical "
             "Guarantees: A Model-Agnostic Meta-Learning Approach, NeurIPS 2020")
    Params = PerFedAvgParams
    tuned_training = ()  # its step sizes are alpha and beta
    local_optimizer = False

    def train(self, client: ClientRuntime, received: Received, state: NoClientState,
              ) -> tuple[Upload, NoClientState]:
        alpha, beta = self.params.alpha, self.params.beta
        model = client.new_model(received.model)
        params = [p for p in model.parameters() if p.requires_grad]
        model.train()
        pairs = _pairs(list(client.batches(received.server_round)))
        loss_sum, seen = 0.0, 0
        for (x1, y1), (x2, y2) in pairs:
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x1), y1)
            loss.backward()
            saved = _adapt_(params, [p.grad for p in params], alpha)
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x2), y2).backward()
            _meta_step_(params, saved, [p.grad for p in params], beta)
            loss_sum += float(loss.detach()) * len(y1)
            seen += len(y1)
        return Upload(model.state_dict(), {TRAIN_LOSS: loss_sum / max(seen, 1),
                                           LOCAL_STEPS: len(pairs)}), state

    def evaluate(self, client: ClientRuntime, received: Received, state: NoClientState) -> Rule:
        """``personal-acc`` after ``perfedavg-eval-steps`` SGD steps at rate ``perfedavg-alpha``
        from the global model; ``global-acc`` of the global model."""
        global_result = client.test(received.model)
        steps = self.params.eval_steps
        adapted = yield LocalRun(received.model, stream=STREAM_FINETUNE, epochs=steps,
                                 max_steps=steps, optimizer=PlainSGD(self.params.alpha))
        return client.eval_metrics(client.test(adapted.model), global_result)
