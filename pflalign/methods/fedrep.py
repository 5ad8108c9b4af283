"""FedRep (Collins et al., Exploiting Shared Representations for Personalized Federated
Learning, ICML 2021, Algorithm 1).

Each round, with the global representation (body) loaded onto the client's own head: first the
head is trained for ``fedrep-head-epochs`` epochs with the body frozen, then the body for
``local-epochs`` epochs with the head frozen; the body is uploaded and averaged. When the body
computes the same function in train and eval mode (no batch norm or dropout) the head epochs run
on the body's features computed once. See :mod:`pflalign.methods.partial` for state and new
clients.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from pflalign.methods.fedper import FedPer
from pflalign.methods.partial import HeadParams, Phase
from pflalign.settings.params import param
from pflalign.training.loops import STREAM_PERSONAL, STREAM_TRAIN


@dataclass(frozen=True)
class FedRepParams(HeadParams):
    head_epochs: int = param(10, "fedrep: epochs of head training (body frozen) before the "
                             "body's local-epochs (head frozen).", key="fedrep-head-epochs",
                             minimum=1, group="fedrep")


class FedRep(FedPer):
    name = "fedrep"
    summary = ("Shared representation (body) and personal head: the head is trained first with "
               "the body frozen, then the body with the head frozen.")
    paper = ("Collins et al., Exploiting Shared Representations for Personalized Federated "
             "Learning, ICML 2021")
    Params = FedRepParams

    def phases(self, model: nn.Module) -> list[Phase]:
        """The head for ``fedrep-head-epochs`` (body frozen), then the body for the round's
        local epochs (head frozen): its statistics are the round's."""
        head = self.personal_entries(model)
        body = tuple(n for n, p in model.named_parameters()  # a frozen base never trains
                     if p.requires_grad and n not in set(head))
        return [(head, STREAM_PERSONAL, self.params.head_epochs), (body, STREAM_TRAIN, None)]
