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

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.nn.functional as F

from pflalign.client import ClientRuntime, Received, Upload
from pflalign.method import Method
from pflalign.params import Params, param
from pflalign.protocol import LOCAL_STEPS, TRAIN_LOSS
from pflalign.state import NoClientState
from pflalign.train import STREAM_FINETUNE, STREAM_TRAIN

if TYPE_CHECKING:
    from pflalign.cohort import Cohort

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

    def train_cohort(self, cohort: Cohort, received: Sequence[Received],
                     states: Sequence[NoClientState]) -> list[tuple[Upload, NoClientState]]:
        """:meth:`train` for every client in lockstep: one meta-step (two mini-batches, each
        client's own) per client per step."""
        alpha, beta = self.params.alpha, self.params.beta
        server_round = received[0].server_round
        names = tuple(cohort.names)
        params = cohort.stack([r.model for r in received])
        n = len(cohort)
        views = [cohort.views(params, i) for i in range(n)]
        pairs = [_pairs(list(order))
                 for order in cohort.orders(server_round, STREAM_TRAIN, None)]
        grads = cohort.grads
        loss_sum, seen = [0.0] * n, [0] * n
        cohort.module.train()
        for step in range(max(len(p) for p in pairs)):
            active = [i for i in range(n) if step < len(pairs[i])]
            first = [pairs[i][step][0] if step < len(pairs[i]) else None for i in range(n)]
            second = [pairs[i][step][1] if step < len(pairs[i]) else None for i in range(n)]
            g1, losses = grads(params, names, first, active)
            saved = {i: _adapt_(views[i], g1[i], alpha) for i in active}
            g2, _ = grads(params, names, second, active)
            for i in active:
                _meta_step_(views[i], saved[i], g2[i], beta)
                loss_sum[i] += float(losses[i]) * len(first[i])
                seen[i] += len(first[i])
        return [(Upload(cohort.state_dict(params, i, r.model),
                        {TRAIN_LOSS: loss_sum[i] / max(seen[i], 1), LOCAL_STEPS: len(pairs[i])}),
                 states[i]) for i, r in enumerate(received)]

    def personalize(self, client: ClientRuntime, received: Received) -> torch.nn.Module:
        """``perfedavg-eval-steps`` SGD steps at rate ``perfedavg-alpha`` from the global model."""
        model = client.new_model(received.model)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(params, lr=self.params.alpha)
        model.train()
        steps = self.params.eval_steps
        stream = client.batches(received.server_round, STREAM_FINETUNE, epochs=steps)
        for x, y in itertools.islice(stream, steps):
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        return model

    def personalize_cohort(self, cohort: Cohort, received: Sequence[Received],
                           ) -> dict[str, torch.Tensor]:
        """:meth:`personalize` for every client of ``cohort`` in lockstep: the adapted models,
        stacked."""
        server_round = received[0].server_round
        names = tuple(cohort.names)
        params = cohort.stack([r.model for r in received])
        n = len(cohort)
        views = [cohort.views(params, i) for i in range(n)]
        optimizers = [torch.optim.SGD(views[i], lr=self.params.alpha) for i in range(n)]
        steps = self.params.eval_steps
        orders = [itertools.islice(order, steps)
                  for order in cohort.orders(server_round, STREAM_FINETUNE, steps)]
        grads = cohort.grads
        cohort.module.train()
        for batch, active in cohort.lockstep(orders):
            g, _ = grads(params, names, batch, active)
            for i in active:
                for view, grad in zip(views[i], g[i], strict=True):
                    view.grad = grad
                optimizers[i].step()
                for view in views[i]:
                    view.grad = None
        return params

    def evaluate(self, client: ClientRuntime, received: Received, state: NoClientState) -> dict:
        global_result = client.test(client.new_model(received.model))
        return client.eval_metrics(client.test(self.personalize(client, received)), global_result)

    def evaluate_cohort(self, cohort: Cohort, received: Sequence[Received],
                        states: Sequence[NoClientState]) -> list[dict]:
        global_results = [cohort.test(cohort.model(r.model, "global"), i)
                          for i, r in enumerate(received)]
        adapted = self.personalize_cohort(cohort, received)
        return [cohort.eval_metrics(cohort.test(
            cohort.model(cohort.state_dict(adapted, i, r.model), "adapted"), i), global_results[i])
            for i, r in enumerate(received)]
