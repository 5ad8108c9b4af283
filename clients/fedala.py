"""FedALA client half (Zhang et al., FedALA: Adaptive Local Aggregation for Personalized
Federated Learning, AAAI 2023, Algorithm 1).

Before local training the client merges the received global model ``Theta`` into its own model
``theta_i`` (from its last round, in its state): lower layers take ``Theta``; the top
``fedala-layers`` parameterised layers become ``theta_i + (Theta - theta_i) * W`` with element-wise
weights ``W`` in [0, 1] (initialised to 1, kept in the state). ``W`` is learned on a random
``fedala-rand-percent`` % of the client's train split (drawn per round) by
``W <- clip(W - fedala-eta grad * (Theta - theta_i), 0, 1)`` with the lower layers frozen. At the
client's first adaptation this repeats until the standard deviation of the last
``fedala-num-pre-loss`` losses falls below ``fedala-threshold`` (at most ``MAX_FIRST_EPOCHS``
passes); afterwards it is one pass per round. When only the last layer is adapted and the model
has no batch norm or dropout, the lower layers' outputs are computed once per round and reused.
The merged model is trained as in FedAvg, kept as ``theta_i`` and uploaded.

A client without ``theta_i`` (its first round, or an unseen client) takes ``Theta`` as is: the
merge is the identity. ``personal-acc`` scores what the client would start its next round from,
the merge of the current ``Theta`` into its ``theta_i`` (as in the reference implementation, where
every client adapts the new global model before evaluation; here the evaluation's adaptation is
not stored); for clients that never trained that is ``Theta``. ``global-acc`` scores ``Theta``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from clients.base import ClientMethod, FitResult, RoundInput
from pflalign.baselines import ala_converged, ala_merge, ala_weight_step_, grads_of
from pflalign.models import head_keys
from pflalign.train import STREAM_ADAPT, batch_indices, make_generator

MODEL, WEIGHTS = "model", "ala-weights"
MAX_FIRST_EPOCHS = 50


class FedALAClient(ClientMethod):
    def adapt(self, own: dict[str, torch.Tensor], received: dict[str, torch.Tensor],
              server_round: int, save: bool = True) -> tuple[nn.Module, int]:
        """The merged model and the number of passes spent learning ``W`` (kept in the state
        when ``save``). Buffers (batch-norm statistics) are the received model's."""
        s = self.settings
        model = self.new_model(received)
        higher = [k for k in head_keys(model, int(s["fedala-layers"]))
                  if k in dict(model.named_parameters())]
        params = dict(model.named_parameters())
        top = [params[k] for k in higher]
        local = [own[k].to(self.device) for k in higher]
        global_ = [received[k].to(self.device) for k in higher]
        saved = self.state.get_arrays(WEIGHTS)
        weights = ([saved[k].to(self.device) for k in higher] if saved
                   else [torch.ones_like(p) for p in top])
        for name, p in params.items():
            p.requires_grad_(name in set(higher))
        data = self.data
        generator = make_generator(int(s["seed"]), server_round, self.client_id, STREAM_ADAPT)
        count = max(1, math.floor(data.num_train * float(s["fedala-rand-percent"]) / 100))
        subset = torch.randperm(data.num_train, generator=generator)[:count].to(self.device)
        head = self.last_layer_owning(model, higher)  # lower layers are fixed while W learns
        features = None if head is None else self.head_inputs(model, head, subset)
        window, threshold = int(s["fedala-num-pre-loss"]), float(s["fedala-threshold"])
        eta = float(s["fedala-eta"])
        losses: list[float] = []
        passes = 0
        model.train()
        while True:
            passes += 1
            for idx in batch_indices(count, int(s["batch-size"]), 1, 0, generator, self.device):
                with torch.no_grad():
                    torch._foreach_copy_(top, ala_merge(local, global_, weights))
                model.zero_grad(set_to_none=True)
                chosen = subset[idx]
                outputs = (model(data.normalize(data.train_x[chosen])) if features is None
                           else head(features[idx]))
                loss = F.cross_entropy(outputs, data.train_y[chosen])
                loss.backward()
                ala_weight_step_(weights, grads_of(top), local, global_, eta)
                losses.append(float(loss.detach()))
            if saved or passes >= MAX_FIRST_EPOCHS or ala_converged(losses, window, threshold):
                break
        with torch.no_grad():
            torch._foreach_copy_(top, ala_merge(local, global_, weights))
        for p in params.values():
            p.requires_grad_(True)
        model.load_state_dict({k: v for k, v in received.items() if k not in params},
                              strict=False)  # undo what the adaptation passes did to buffers
        if save:
            self.state.set_arrays(WEIGHTS, dict(zip(higher, weights, strict=True)))
        return model, passes

    def fit(self, inputs: RoundInput) -> FitResult:
        own = self.state.get_arrays(MODEL)
        passes = 0
        if own is None:
            model = self.new_model(inputs.global_state)
        else:
            model, passes = self.adapt(own, inputs.global_state, inputs.server_round)
        stats = self.local_train(model, inputs.server_round)
        self.state.set_arrays(MODEL, model.state_dict())
        return FitResult(model.state_dict(), {"train-loss": stats.loss, "local-steps": stats.steps,
                                              "ala-passes": passes})

    def evaluate(self, inputs: RoundInput) -> dict:
        global_result = self.test(self.new_model(inputs.global_state))
        own = self.state.get_arrays(MODEL)
        if own is None:
            return self.eval_metrics(global_result, global_result)
        merged, _ = self.adapt(own, inputs.global_state, inputs.server_round, save=False)
        return self.eval_metrics(self.test(merged), global_result)
