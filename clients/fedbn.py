"""FedBN client half (Li et al., FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization, ICLR 2021).

Every batch-norm layer (its affine weight and bias and its running statistics) stays on the
client; all other layers are trained jointly and averaged as in FedAvg. The model must have
batch norm (the runner uses ``cnn-bn`` in place of ``cnn``). See :mod:`clients.partial` for state
and the new-client procedure (the client's batch-norm layers fitted with the rest frozen).
"""

from __future__ import annotations

from clients.partial import BatchNormClient


class FedBNClient(BatchNormClient):
    """Joint training; the batch-norm entries are the personal part."""
