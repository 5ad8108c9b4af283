"""Client halves that share part of the model and keep the rest: FedPer, FedRep, FedBN.

The server sends only the shared entries; the personal entries (a head, or the batch-norm layers)
live in the client's state and never leave it. A client that has no personal part yet starts it
from the run's initial model (the seeded template, identical to the server's initial state).

New-client procedure (unseen clients, and seen clients scored before their first training): the
shared part is frozen and the personal part is fitted on the client's own train split for
``finetune-epochs`` epochs (SGD at ``lr``), then the model is scored.
"""

from __future__ import annotations

import torch
from torch import nn

from clients.base import ClientMethod, FitResult, RoundInput
from pflalign.models import batch_norm_keys, head_keys
from pflalign.train import STREAM_FINETUNE, TrainStats

PERSONAL = "personal"


class PartialModelClient(ClientMethod):
    """Shared entries from the server, personal entries from the client's state."""

    def personal_keys(self) -> tuple[str, ...]:
        raise NotImplementedError

    def _model(self, inputs: RoundInput) -> tuple[nn.Module, bool]:
        """The client's model and whether it already had a personal part."""
        model = self.new_model()
        own = self.state.get_arrays(PERSONAL)
        if own:
            model.load_state_dict(own, strict=False)
        shared = inputs.global_state
        if shared:
            model.load_state_dict(shared, strict=False)
        return model, own is not None

    def _save(self, model: nn.Module) -> None:
        keys = set(self.personal_keys())
        self.state.set_arrays(PERSONAL, {k: v for k, v in model.state_dict().items() if k in keys})

    def shared_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        keys = set(self.personal_keys())
        return {k: v for k, v in model.state_dict().items() if k not in keys}

    def train_part(self, model: nn.Module, keys: tuple[str, ...], server_round: int, stream: int,
                   epochs: int | None) -> TrainStats:
        """Train only the parameters named in ``keys``; the others are frozen, and so are the
        buffers (batch-norm statistics) of layers with no trained parameter. ``epochs=None`` is
        the round's local training (``local-epochs`` capped at ``local-steps``)."""
        wanted = set(keys)
        named = [(n, p) for n, p in model.named_parameters()]
        chosen = [p for n, p in named if n in wanted]
        frozen = [p for n, p in named if n not in wanted and p.requires_grad]
        kept = {}  # buffers of layers none of whose parameters are trained
        for module_name, module in model.named_modules():
            prefix = f"{module_name}." if module_name else ""
            if not any(prefix + n in wanted for n, _ in module.named_parameters(recurse=False)):
                kept.update({prefix + n: b.clone()
                             for n, b in module.named_buffers(recurse=False)})
        for p in frozen:
            p.requires_grad_(False)
        try:
            head = self.last_layer_owning(model, keys)
            if head is not None:
                return self._train_head_on_features(model, head, server_round, stream, epochs)
            return self.local_train(model, server_round, stream=stream, epochs=epochs,
                                    optimizer=self.make_optimizer(chosen, server_round, stream))
        finally:
            for p in frozen:
                p.requires_grad_(True)
            if kept:
                model.load_state_dict(kept, strict=False)

    def _train_head_on_features(self, model: nn.Module, head: nn.Module, server_round: int,
                                stream: int, epochs: int | None) -> TrainStats:
        """Head-only training on the frozen body's features computed once: the same batches and
        updates as training through the frozen body, at the cost of one forward pass of it."""
        features = self.head_inputs(model, head)
        model.train()
        return self.local_train(head, server_round, stream=stream, epochs=epochs,
                                optimizer=self.make_optimizer(head.parameters(), server_round,
                                                              stream),
                                features=features)

    def fit_personal(self, model: nn.Module, server_round: int) -> TrainStats:
        """The new-client procedure: fit the personal part with the shared part frozen."""
        return self.train_part(model, self.personal_keys(), server_round, STREAM_FINETUNE,
                               int(self.settings["finetune-epochs"]))

    def train_round(self, model: nn.Module, server_round: int) -> TrainStats:
        """One round of local training (FedPer, FedBN: every parameter jointly)."""
        return self.local_train(model, server_round)

    def fit(self, inputs: RoundInput) -> FitResult:
        model, _ = self._model(inputs)
        stats = self.train_round(model, inputs.server_round)
        self._save(model)
        return FitResult(self.shared_state(model),
                         {"train-loss": stats.loss, "local-steps": stats.steps})

    def evaluate(self, inputs: RoundInput) -> dict:
        model, has_personal = self._model(inputs)
        if not has_personal:
            self.fit_personal(model, inputs.server_round)
        return self.eval_metrics(self.test(model))


class HeadClient(PartialModelClient):
    """The personal part is the head: the last ``head-layers`` parameterised layers."""

    def personal_keys(self) -> tuple[str, ...]:
        return head_keys(self.template(), int(self.settings["head-layers"]))


class BatchNormClient(PartialModelClient):
    """The personal part is every batch-norm layer (affine parameters and statistics)."""

    def personal_keys(self) -> tuple[str, ...]:
        return batch_norm_keys(self.template())
