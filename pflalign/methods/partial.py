"""What FedPer, FedRep and FedBN share: part of the model is exchanged, the rest stays personal.

The server sends only the shared entries; the personal entries (a head, or the batch-norm layers)
live in the client's state and never leave it, so the traffic is the shared part's. A client that
has no personal part yet starts it from the run's initial model (the seeded template, identical to
the server's initial state). There is no global model to score: ``global-acc`` is not reported.

New-client procedure (unseen clients, and seen clients scored before their first training): the
shared part is frozen and the personal part is fitted on the client's own train split for
``finetune-epochs`` epochs (the run's local optimizer), then the model is scored. A phase that
trains only the last layer of a model without batch norm or dropout trains it on the body's
features, computed once (:meth:`pflalign.training.client.ClientRuntime.execute`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from pflalign.methods.base import Method
from pflalign.methods.fedavg_ft import FineTuneParams
from pflalign.server.runtime import ServerRuntime
from pflalign.settings.params import param
from pflalign.training.client import ClientRuntime
from pflalign.training.loops import STREAM_FINETUNE, STREAM_TRAIN
from pflalign.training.runs import LocalRun, Rule
from pflalign.wire.messages import Received, Upload
from pflalign.wire.protocol import LOCAL_STEPS, TRAIN_LOSS
from pflalign.wire.state import ArrayState, TorchState

#: one phase of a round's local training: (trained entries, seeded stream, epochs or None)
Phase = tuple[tuple[str, ...], int, int | None]

HEAD_LAYERS_HELP = ("fedper, fedrep: number of final parameterised layers kept on the clients "
                    "(the personal head); 1 is the classifier.")


@dataclass(frozen=True)
class PartialParams(FineTuneParams):
    """The new-client fine-tuning of fedper, fedrep and fedbn: the one ``finetune-epochs`` key,
    declared by fedavg-ft."""

    group = "fedper/fedrep/fedbn"


@dataclass
class PartialClientState(ArrayState):
    #: the personal entries of the client's model
    personal: TorchState | None = None


class PartialModel(Method):
    """Shared entries from the server, personal entries from the client's state."""
    asynchronous = True  # its server update is a sample-weighted average of uploads
    private = True  # it uploads its shared entries, which the server only averages

    Params = PartialParams
    ClientState = PartialClientState
    has_global_model = False

    def personal_entries(self, model: nn.Module) -> tuple[str, ...]:
        """The personal entries of ``model`` (a model of the run)."""
        raise NotImplementedError

    def personal_keys(self, server: ServerRuntime) -> tuple[str, ...]:
        return self.personal_entries(server.template_model())

    def phases(self, model: nn.Module) -> list[Phase] | None:
        """A round's local training as phases run in order, each training only its entries;
        None (FedPer, FedBN): every parameter jointly, ``local-epochs``. ``model``: the run's
        model (its layout). The last phase's statistics are reported."""
        return None

    @staticmethod
    def _start(initial: Mapping[str, torch.Tensor], received: Received,
               state: PartialClientState) -> dict[str, torch.Tensor]:
        """A client's full model state before its action: the run's initial model, overlaid
        with its personal entries, then with the shared entries received."""
        return {**initial, **(state.personal or {}), **(received.model or {})}

    def train(self, client: ClientRuntime, received: Received, state: PartialClientState,
              ) -> Rule:
        """One round of local training: :meth:`phases` in order, each a run of its own entries,
        or (FedPer, FedBN) one run of every parameter; the shared entries are uploaded, the
        personal ones kept."""
        model = self._start(client.initial_state(), received, state)
        for keys, stream, epochs in self.phases(client.layout) or [(None, STREAM_TRAIN, None)]:
            result = yield LocalRun(model, trainable=keys, stream=stream, epochs=epochs)
            model = result.model
        personal = set(self.personal_entries(client.layout))
        upload = Upload({k: v for k, v in model.items() if k not in personal},
                        {TRAIN_LOSS: result.stats.loss, LOCAL_STEPS: result.stats.steps})
        return upload, PartialClientState({k: v for k, v in model.items() if k in personal})

    def evaluate(self, client: ClientRuntime, received: Received,
                 state: PartialClientState) -> Rule:
        model = self._start(client.initial_state(), received, state)
        if state.personal is None:  # the new-client procedure: fit the personal part
            model = (yield LocalRun(model, trainable=self.personal_entries(client.layout),
                                    stream=STREAM_FINETUNE,
                                    epochs=self.params.finetune_epochs)).model
        return client.eval_metrics(client.test(model))


@dataclass(frozen=True)
class HeadParams(PartialParams):
    head_layers: int = param(1, HEAD_LAYERS_HELP, key="head-layers", minimum=1,
                             group="fedper/fedrep")

