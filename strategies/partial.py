"""Server half of FedPer, FedRep (personal head) and FedBN (personal batch norm).

Only the shared entries are sent, uploaded, validated and averaged (FedAvg by sample count); the
personal entries never leave the clients, so the traffic is the shared part's. There is no global
model to score: ``global-acc`` is not reported, and unseen clients follow the client half's
new-client procedure (:mod:`clients.partial`).
"""

from __future__ import annotations

from pflalign.models import batch_norm_keys, head_keys
from strategies.base import PFLStrategy


class HeadStrategy(PFLStrategy):
    """FedPer and FedRep: the last ``head-layers`` parameterised layers are personal."""

    def personal_keys(self) -> tuple[str, ...]:
        return head_keys(self.template_model(), int(self.settings["head-layers"]))


class BatchNormStrategy(PFLStrategy):
    """FedBN: every batch-norm layer is personal."""

    def personal_keys(self) -> tuple[str, ...]:
        keys = batch_norm_keys(self.template_model())
        if not keys:
            raise ValueError(f"fedbn needs a model with batch norm; model "
                             f"'{self.settings['model']}' has none (use cnn-bn or resnet18).")
        return keys
