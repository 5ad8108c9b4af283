"""FedBN (Li et al., FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization, ICLR 2021).

Every batch-norm layer (its affine weight and bias and its running statistics) stays on the
client; all other layers are trained jointly and averaged as in FedAvg. The model must have
batch norm: the runner uses ``cnn-bn`` in place of ``cnn``. See :mod:`pflalign.methods.partial`
for state and the new-client procedure (the client's batch-norm layers fitted with the rest
frozen).
"""

from __future__ import annotations

from torch import nn

from pflalign.methods.partial import PartialModel
from pflalign.models.registry import batch_norm_keys
from pflalign.settings.options import ConfigError


class FedBN(PartialModel):
    name = "fedbn"
    summary = ("FedAvg of every layer except batch norm, which stays local to each client (runs "
               "on cnn-bn when the model is cnn).")
    paper = ("Li et al., FedBN: Federated Learning on Non-IID Features via Local Batch "
             "Normalization, ICLR 2021")
    needs_batch_norm = True

    def personal_entries(self, model: nn.Module) -> tuple[str, ...]:
        keys = batch_norm_keys(model)
        if not keys:
            raise ConfigError("fedbn needs a model with batch norm; this run's model has none "
                              "(use cnn-bn, resnet18, or a model of your own with batch norm).")
        return keys
