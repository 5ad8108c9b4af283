"""What FedPer, FedRep and FedBN share: part of the model is exchanged, the rest stays personal.

The server sends only the shared entries; the personal entries (a head, or the batch-norm layers)
live in the client's state and never leave it, so the traffic is the shared part's. A client that
has no personal part yet starts it from the run's initial model (the seeded template, identical to
the server's initial state). There is no global model to score: ``global-acc`` is not reported.

New-client procedure (unseen clients, and seen clients scored before their first training): the
shared part is frozen and the personal part is fitted on the client's own train split for
``finetune-epochs`` epochs (the run's local optimizer), then the model is scored.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from pflalign.client import ClientRuntime, Received, Upload
from pflalign.method import Method
from pflalign.methods.fedavg_ft import FINETUNE_HELP
from pflalign.params import Params, param
from pflalign.protocol import LOCAL_STEPS, TRAIN_LOSS
from pflalign.state import ArrayState, TorchState
from pflalign.train import STREAM_FINETUNE, TrainStats

HEAD_LAYERS_HELP = ("fedper, fedrep: number of final parameterised layers kept on the clients "
                    "(the personal head); 1 is the classifier.")


@dataclass(frozen=True)
class PartialParams(Params):
    group = "fedper/fedrep/fedbn"

    finetune_epochs: int = param(1, FINETUNE_HELP, key="finetune-epochs", minimum=1,
                                 group="fedavg-ft")


@dataclass
class PartialClientState(ArrayState):
    #: the personal entries of the client's model
    personal: TorchState | None = None


class PartialModel(Method):
    """Shared entries from the server, personal entries from the client's state."""

    Params = PartialParams
    ClientState = PartialClientState
    has_global_model = False

    def personal_entries(self, model: nn.Module) -> tuple[str, ...]:
        """The personal entries of ``model`` (a model of the run)."""
        raise NotImplementedError

    def personal_keys(self, server: object) -> tuple[str, ...]:
        return self.personal_entries(server.template_model())  # type: ignore[attr-defined]

    def _model(self, client: ClientRuntime, received: Received,
               state: PartialClientState) -> nn.Module:
        model = client.new_model()
        if state.personal:
            model.load_state_dict(state.personal, strict=False)
        if received.model:
            model.load_state_dict(received.model, strict=False)
        return model

    def train_part(self, client: ClientRuntime, model: nn.Module, keys: tuple[str, ...],
                   server_round: int, stream: int, epochs: int | None) -> TrainStats:
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
            head = client.last_layer_owning(model, keys)
            if head is not None:
                return self._train_head_on_features(client, model, head, server_round, stream,
                                                    epochs)
            return client.local_train(model, server_round, stream=stream, epochs=epochs,
                                      optimizer=client.make_optimizer(chosen, server_round,
                                                                      stream))
        finally:
            for p in frozen:
                p.requires_grad_(True)
            if kept:
                model.load_state_dict(kept, strict=False)

    @staticmethod
    def _train_head_on_features(client: ClientRuntime, model: nn.Module, head: nn.Module,
                                server_round: int, stream: int, epochs: int | None,
                                ) -> TrainStats:
        """Head-only training on the frozen body's features computed once: the same batches and
        updates as training through the frozen body, at the cost of one forward pass of it."""
        features = client.head_inputs(model, head)
        model.train()
        return client.local_train(head, server_round, stream=stream, epochs=epochs,
                                  optimizer=client.make_optimizer(head.parameters(), server_round,
                                                                  stream),
                                  features=features)

    def train_round(self, client: ClientRuntime, model: nn.Module,
                    server_round: int) -> TrainStats:
        """One round of local training (FedPer, FedBN: every parameter jointly)."""
        return client.local_train(model, server_round)

    def train(self, client: ClientRuntime, received: Received, state: PartialClientState,
              ) -> tuple[Upload, PartialClientState]:
        model = self._model(client, received, state)
        stats = self.train_round(client, model, received.server_round)
        personal = set(self.personal_entries(client.template()))
        entries = model.state_dict()
        upload = Upload({k: v for k, v in entries.items() if k not in personal},
                        {TRAIN_LOSS: stats.loss, LOCAL_STEPS: stats.steps})
        return upload, PartialClientState({k: v for k, v in entries.items() if k in personal})

    def evaluate(self, client: ClientRuntime, received: Received,
                 state: PartialClientState) -> dict:
        model = self._model(client, received, state)
        if state.personal is None:
            self.train_part(client, model, self.personal_entries(client.template()),
                            received.server_round, STREAM_FINETUNE, self.params.finetune_epochs)
        return client.eval_metrics(client.test(model))


@dataclass(frozen=True)
class HeadParams(PartialParams):
    head_layers: int = param(1, HEAD_LAYERS_HELP, key="head-layers", minimum=1,
                             group="fedper/fedrep")

