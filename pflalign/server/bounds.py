"""Bounds across a round's updates: the update-norm bound and the update clip.

Each client's update is compared with a reference drawn from the others' (the round's median of
three or more, else the median of the norms accepted in the last :data:`NORM_HISTORY` rounds,
else the smaller of two): :meth:`NormBounds.bound_updates` drops an update whose every part is
not within ``update-norm-bound`` times its reference, and :meth:`NormBounds.clip_updates` scales
the trainable part down to ``update-clip`` times it (Sun et al., "Can You Really Backdoor
Federated Learning?", 2019). The round features that apply them are
:mod:`pflalign.round.features.robustness`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from pflalign.server.aggregation import update_norms
from pflalign.server.runtime import ServerRuntime
from pflalign.server.validation import float_spec
from pflalign.wire.messages import Update
from pflalign.wire.state import State

#: rounds of accepted update norms the update-norm bound keeps (its reference for rounds with
#: fewer than three uploads)
NORM_HISTORY = 5


class NormBounds:
    """The update-norm bound and the update clip of one method entry's server; ``warn`` names
    each dropped update's client."""

    def __init__(self, server: ServerRuntime, warn: Callable[[str], None]):
        self.server = server
        self.warn = warn
        #: per part, the update norms accepted in each of the last NORM_HISTORY rounds (the
        #: bound's reference in a round of fewer than three uploads; checkpointed)
        self.norm_history: dict[str, list[list[float]]] = {}
        self.lone_upload_noted = False
        self.largest_ratio: float | None = None

    def bound_updates(self, updates: list[Update], global_model: State,
                      ) -> tuple[list[Update], int]:
        """The updates whose every part is at most ``update-norm-bound`` times its reference;
        the others are warned about by client id and dropped. The parts: the update of the
        trainable exchanged entries (uploaded minus global), that of the other floating-point
        entries (batch-norm statistics), and the norm of every further record (SCAFFOLD's
        control-variate change, FedCP's policy network). The reference (:meth:`reference`) is the
        round's median with three uploads or more, else the median of the norms accepted in the
        last :data:`NORM_HISTORY` rounds. Returns the kept updates and how many were not."""
        bound = self.server.settings.run.update_norm_bound
        self.largest_ratio = None
        if bound <= 0 or not updates:
            return updates, 0
        parts: dict[str, list[float]] = {}
        if all(u.model is not None for u in updates):
            for part, spec in (("update", self.server.trainable_shared),
                               ("buffer update", self.server.buffer_spec)):
                if spec.size:
                    parts[part] = list(update_norms([u.model for u in updates], global_model,
                                                    spec))
        for name in sorted(set.intersection(*(set(u.arrays) for u in updates))):
            spec = float_spec(updates[0].arrays[name])
            if spec.size:
                parts[f"'{name}' record"] = [float(np.linalg.norm(spec.flatten(
                    u.arrays[name], np.float64))) for u in updates]
        refused: dict[int, str] = {}
        references: dict[str, float] = {}
        for part, norms in parts.items():
            reference, what = self.reference(part, norms)
            if reference is None or reference <= 0:  # nothing to compare with
                continue
            references[part] = reference
            for update, norm in zip(updates, norms, strict=True):
                if update.client not in refused and norm > bound * reference:
                    refused[update.client] = (
                        f"client {update.client}'s {part} norm {norm:.4g} is "
                        f"{norm / reference:.3g}x {what} {reference:.4g} "
                        f"(update-norm-bound = {bound:g}); the reply is skipped.")
        for text in refused.values():
            self.warn(text)
        #: the largest ratio of a kept update's part to its reference (how close honest
        #: clients come to the bound; None: nothing was compared)
        self.largest_ratio = max(
            (norm / references[part] for part, norms in parts.items() if part in references
             for update, norm in zip(updates, norms, strict=True)
             if update.client not in refused), default=None)
        for part, norms in parts.items():
            kept = [n for u, n in zip(updates, norms, strict=True) if u.client not in refused]
            self.norm_history[part] = [*self.norm_history.get(part, []), kept][-NORM_HISTORY:]
        return [u for u in updates if u.client not in refused], len(refused)

    def clip_updates(self, updates: list[Update], global_model: State, factor: float,
                     ) -> tuple[list[Update], int]:
        """Norm bounding (``update-clip``; Sun et al., "Can You Really Backdoor Federated
        Learning?", 2019): each update of the trainable exchanged entries (uploaded minus
        global) scaled down to at most ``factor`` times the round's :meth:`reference` norm, so
        that no client moves the model more than an honest one would, and nobody is rejected.
        Returns the updates and how many were clipped."""
        spec = self.server.trainable_shared
        if factor <= 0 or not updates or not spec.size or any(u.model is None for u in updates):
            return updates, 0
        base = spec.flatten(global_model, np.float64)
        vectors = [spec.flatten(u.model, np.float64) - base for u in updates]
        norms = [float(np.linalg.norm(v)) for v in vectors]
        reference, _ = self.reference("update", norms)
        if reference is None or reference <= 0:
            return updates, 0
        bound = factor * reference
        kept: list[Update] = []
        for update, vector, norm in zip(updates, vectors, norms, strict=True):
            if norm > bound:
                update = replace(update, model={**update.model,
                                                **spec.unflatten(base + vector * (bound / norm))})
            kept.append(update)
        return kept, sum(norm > bound for norm in norms)

    def reference(self, part: str, norms: Sequence[float]) -> tuple[float | None, str]:
        """What ``norms`` (one round's, of ``part``) are bounded against, and its name: the
        round's median of three or more; else the median of the norms accepted in the last
        :data:`NORM_HISTORY` rounds, when they are three or more; else, of two uploads, the
        smaller (a median of two would be dragged half-way by the larger); else None."""
        if len(norms) >= 3:
            return float(np.median(norms)), "the round's median"
        earlier = [n for kept in self.norm_history.get(part, []) for n in kept]
        if len(earlier) >= 3:
            return float(np.median(earlier)), (
                f"the median of the {len(earlier)} norms accepted in the last "
                f"{len(self.norm_history[part])} rounds")
        if len(norms) == 2:
            return min(norms), "the other upload's"
        if not self.lone_upload_noted:
            self.lone_upload_noted = True
            self.warn("a round has a single upload and no earlier accepted updates to compare "
                      "it with: the update-norm bound cannot act on it (it does from the next "
                      "round on).")
        return None, ""
