"""Deprecated: the round loop moved to :mod:`pflalign.round.loop` (its features to
:mod:`pflalign.round.features`). This alias keeps ``from pflalign.run.rounds import RoundLoop``
working for one release, with a DeprecationWarning."""

import warnings

from pflalign.round.loop import RoundLoop

warnings.warn("pflalign.run.rounds is deprecated: import RoundLoop from pflalign.round.loop; this "
              "alias will be removed in the next release.", DeprecationWarning, stacklevel=2)

__all__ = ["RoundLoop"]
