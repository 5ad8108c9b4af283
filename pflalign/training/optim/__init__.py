"""pflalign's optimizers: ``torch.optim.Optimizer`` classes over public functional cores.

- :mod:`pflalign.training.optim.pflalign`: pFLAlign's PersonalizedLocalUpdate (:class:`PFLAlign`,
  :func:`pflalign_update`; docs/algorithms.md 1.4, 1.8, 1.11);
- :mod:`pflalign.training.optim.genie`: GENIE (:class:`GENIE`, :func:`genie_update`;
  docs/algorithms.md 2.3-2.5).

As in ``torch.optim`` (``sgd(params, grads, momentum_buffers, *, lr, ...)`` behind
``torch.optim.SGD``), each class keeps its state and calls its functional core, which takes one
client's tensors or, with ``stacked=True``, a cohort's: every tensor with a leading client
dimension, every reduction and random draw per client (:mod:`pflalign.training.runs` steps cohorts
so).
"""

from pflalign.training.optim.common import closure_loss, params_with_grad
from pflalign.training.optim.genie import (
           GENIE,
           GENIE_CLAMP,
           GENIE_FLOOR,
           TANH_ONE,
           GenieBuffers,
           genie_update,
)
from pflalign.training.optim.pflalign import GAMMA_MODES, PFLAlign, pflalign_update

__all__ = ["GAMMA_MODES", "GENIE", "GENIE_CLAMP", "GENIE_FLOOR", "TANH_ONE", "GenieBuffers",
           "PFLAlign", "closure_loss", "genie_update", "params_with_grad", "pflalign_update"]
