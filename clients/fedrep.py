"""FedRep client half (Collins et al., Exploiting Shared Representations for Personalized
Federated Learning, ICML 2021, Algorithm 1).

Each round, with the global representation (body) loaded onto the client's own head: first the
head is trained for ``fedrep-head-epochs`` epochs with the body frozen, then the body for
``local-epochs`` epochs with the head frozen; the body is uploaded and averaged. When the body
computes the same function in train and eval mode (no batch norm or dropout) the head epochs run
on the body's features computed once. See :mod:`clients.partial` for state and new clients.
"""

from __future__ import annotations

from torch import nn

from clients.partial import HeadClient
from pflalign.train import STREAM_PERSONAL, STREAM_TRAIN, TrainStats


class FedRepClient(HeadClient):
    def train_round(self, model: nn.Module, server_round: int) -> TrainStats:
        head = self.personal_keys()
        self.train_part(model, head, server_round, STREAM_PERSONAL,
                        int(self.settings["fedrep-head-epochs"]))
        body = tuple(n for n, _ in model.named_parameters() if n not in set(head))
        return self.train_part(model, body, server_round, STREAM_TRAIN, None)
