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

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.func import grad_and_value

from pflalign.methods.base import Method
from pflalign.settings.params import Params, log_range, param
from pflalign.training.client import ClientRuntime
from pflalign.training.corrections import Entries
from pflalign.training.loops import STREAM_FINETUNE
from pflalign.training.objectives import ModelCall, Objective, Step, cross_entropy
from pflalign.training.optimizers import PlainSGD
from pflalign.training.runs import LocalRun, Rule
from pflalign.wire.messages import Received, Upload
from pflalign.wire.protocol import LOCAL_STEPS, TRAIN_LOSS
from pflalign.wire.state import NoClientState


@dataclass(frozen=True)
class MetaObjective(Objective):
    """One first-order MAML step on a pair of batches ``(D, D')``: the loss ``f(w_tmp; D')`` at
    ``w_tmp = w - alpha sg(grad f(w; D))`` (``sg``: no gradient), whose gradient in ``w`` is
    ``grad f(w_tmp; D')``, the FO approximation; the run's optimizer (plain SGD at beta) steps
    ``w`` with it. The reported loss is ``f(w; D)``. ``trained``: the model's entries that adapt."""

    trained: tuple[str, ...]
    alpha: float

    def loss(self, model: ModelCall, params: Mapping[str, torch.Tensor], extras: Entries,
             state: Entries, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None,
             ) -> Step:
        (x1, x2), (y1, y2) = x, y
        m1, m2 = (None, None) if mask is None else mask

        def inner(adapted: dict[str, torch.Tensor]) -> torch.Tensor:
            return cross_entropy(model({**params, **adapted}, x1), y1, m1)

        grads, first = grad_and_value(inner)({k: params[k] for k in self.trained})
        adapted = {k: torch.add(params[k], grads[k].detach(), alpha=-self.alpha)
                   for k in self.trained}
        return Step(cross_entropy(model({**params, **adapted}, x2), y2, m2), first.detach())


@dataclass(frozen=True)
class PerFedAvgParams(Params):
    prefix = "perfedavg"

    alpha: float = param(0.01, "Inner (adaptation) step size alpha, also used for the "
                         "personalization steps at evaluation (README: alpha >= 0.02 drives the "
                         "meta-model itself to chance accuracy).", minimum=0.0,
                         exclusive_minimum=True, search=log_range(0.005, 0.02))
    beta: float = param(0.05, "Outer (meta) step size beta.", minimum=0.0, exclusive_minimum=True,
                        search=log_range(0.02, 0.1))
    eval_steps: int = param(1, "SGD steps of personalization from the global model before "
                            "evaluation.", minimum=1)


class PerFedAvg(Method):
    asynchronous = True  # its server update is a sample-weighted average of uploads
    private = True  # it uploads its global model, which the server only averages
    name = "perfedavg"
    summary = ("First-order MAML: the global model is trained to adapt well in one step; clients "
               "personalize by a few SGD steps from it.")
    paper = ("Fallah, Mokhtari, Ozdaglar, Personalized Federated Learning with Theoretical "
             "Guarantees: A Model-Agnostic Meta-Learning Approach, NeurIPS 2020")
    Params = PerFedAvgParams
    tuned_training = ()  # its step sizes are alpha and beta
    local_optimizer = False

    def train(self, client: ClientRuntime, received: Received, state: NoClientState) -> Rule:
        """``floor(T / 2)`` meta-steps on consecutive pairs of the ``T`` batches plain training
        would use (a client with one batch uses it twice)."""
        result = yield LocalRun(
            received.model, batches_per_step=2, optimizer=PlainSGD(self.params.beta),
            objective=MetaObjective(client.template.trainable, self.params.alpha))
        return Upload(result.model, {TRAIN_LOSS: result.stats.loss,
                                     LOCAL_STEPS: result.stats.steps}), state

    def evaluate(self, client: ClientRuntime, received: Received, state: NoClientState) -> Rule:
        """``personal-acc`` after ``perfedavg-eval-steps`` SGD steps at rate ``perfedavg-alpha``
        from the global model; ``global-acc`` of the global model."""
        global_result = client.test(received.model)
        steps = self.params.eval_steps
        adapted = yield LocalRun(received.model, stream=STREAM_FINETUNE, epochs=steps,
                                 max_steps=steps, optimizer=PlainSGD(self.params.alpha))
        return client.eval_metrics(client.test(adapted.model), global_result)
