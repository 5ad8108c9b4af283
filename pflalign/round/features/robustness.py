"""The update-norm bound and the update clip, as a round feature.

``update-norm-bound`` drops an update whose norm (any part: the trainable exchanged entries,
the other floating-point entries, each further record) exceeds that factor of its reference;
``update-clip`` scales the trainable part down to that factor of it (norm bounding, Sun et al.
2019) and rejects nobody. The reference, the round's median of three or more, else the recent
rounds' accepted norms, is :class:`~pflalign.server.bounds.NormBounds`'; its history is what a
checkpoint keeps. Under central DP the clip ``dp-clip`` bounds every update instead (and a
reference drawn from the other clients' norms would make one client's acceptance depend on their
data), so the norm bound is off there. The robust aggregation rules (``aggregation``: trimmed
mean, median) replace the method's average itself, in
:meth:`~pflalign.server.runtime.ServerRuntime.average`.
"""

from __future__ import annotations

from collections.abc import Mapping

from pflalign.methods.base import Method
from pflalign.round.feature import RoundFeature, register
from pflalign.server.bounds import NormBounds
from pflalign.settings.schema import Settings
from pflalign.wire.messages import Update


def central_dp(settings: Settings, method: Method) -> bool:
    """Whether the entry releases its updates through central DP's clip and noise."""
    return settings.run.dp == "central" and method.uploads_model


@register
class UpdateBounds(RoundFeature):
    """``update-norm-bound`` (without central DP) and ``update-clip``."""

    name = "update-bounds"

    @classmethod
    def wanted(cls, settings: Settings, method: Method) -> bool:
        return ((settings.run.update_norm_bound > 0 and not central_dp(settings, method)
                 and settings.run.secure_aggregation == "off") or settings.run.update_clip > 0)

    def __init__(self, loop):
        run = loop.server.settings.run
        self.norms = NormBounds(loop.server, loop.warn)
        self.bounded = (run.update_norm_bound > 0 and run.secure_aggregation == "off"
                        and not central_dp(loop.server.settings, loop.method))
        self.clip = run.update_clip

    def bound(self, loop, server_round: int, updates: list[Update], row: dict,
              ) -> list[Update]:
        if self.bounded:
            updates, too_large = self.norms.bound_updates(updates, loop.state.model)
            row["rejected"] = row.get("rejected", 0) + too_large
        if self.clip > 0:
            updates, row["clipped"] = self.norms.clip_updates(updates, loop.state.model,
                                                              self.clip)
        if self.norms.largest_ratio is not None:  # how close the kept updates came
            row["norm-ratio-max"] = float(self.norms.largest_ratio)
        return updates

    def state_dict(self) -> dict:
        return {"norms": {part: [list(kept) for kept in rounds]
                          for part, rounds in self.norms.norm_history.items()}}

    def load_state_dict(self, state: Mapping) -> None:
        self.norms.norm_history = {part: [[float(n) for n in kept] for kept in rounds]
                                   for part, rounds in state.get("norms", {}).items()}
