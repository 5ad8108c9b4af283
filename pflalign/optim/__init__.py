"""Deprecated: the optimizers moved to :mod:`pflalign.training.optim` (and ``from pflalign import
PFLAlign, GENIE``). This alias keeps ``from pflalign.optim import ...`` working for one release,
with a DeprecationWarning."""

import warnings

from pflalign.training.optim import (
    GAMMA_MODES,
    GENIE,
    GENIE_CLAMP,
    GENIE_FLOOR,
    TANH_ONE,
    GenieBuffers,
    PFLAlign,
    closure_loss,
    genie_update,
    params_with_grad,
    pflalign_update,
)

warnings.warn("pflalign.optim is deprecated: import the optimizers from pflalign (from pflalign "
              "import PFLAlign, GENIE) or pflalign.training.optim; this alias will be removed in "
              "the next release.", DeprecationWarning, stacklevel=2)

__all__ = ["GAMMA_MODES", "GENIE", "GENIE_CLAMP", "GENIE_FLOOR", "TANH_ONE", "GenieBuffers",
           "PFLAlign", "closure_loss", "genie_update", "params_with_grad", "pflalign_update"]
