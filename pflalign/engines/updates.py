"""A client's update as the attacks and secure aggregation see it: the floating-point entries of
the model it trained, minus those of the model it received, flattened in one order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch


def float_keys(received: Mapping[str, torch.Tensor], model: Mapping[str, torch.Tensor],
               ) -> list[str]:
    """The model entries an update covers: the floating-point ones the client received."""
    return [k for k, v in model.items() if k in received and torch.is_floating_point(v)]


def flat_update(model: Mapping[str, torch.Tensor], received: Mapping[str, torch.Tensor],
                keys: Sequence[str]) -> np.ndarray:
    """``model - received`` over ``keys``, in their order, as one float64 vector."""
    return np.concatenate([(model[k].detach().double() - received[k].double()).reshape(-1).numpy()
                           for k in keys])
