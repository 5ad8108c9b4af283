"""Fingerprints of settings: equal exactly when two configs compute the same thing.

Checkpoints (:mod:`pflalign.round.checkpoint`) and a run's saved models
(:mod:`pflalign.outputs.models`) both name the config that wrote them by a hash of its settings
without the keys that change nothing a run computes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from pflalign.settings.schema import ADDED_KEYS, NON_RUN_KEYS


def digest(payload: object) -> str:
    """The SHA-256 of ``payload`` as sorted JSON, in hex."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def comparable(settings: Mapping[str, object]) -> dict[str, object]:
    """``settings`` without the keys that change nothing a run computes (:data:`NON_RUN_KEYS`),
    nor the keys added later at the value that computes what runs did before them
    (:data:`ADDED_KEYS`)."""
    return {k: v for k, v in settings.items() if k not in NON_RUN_KEYS
            and not (k in ADDED_KEYS and v == ADDED_KEYS[k])}


def entry_fingerprint(settings: Mapping[str, object], label: str) -> str:
    """A hash of a method entry's own settings (its overrides applied, ``methods`` naming just
    this entry), without :data:`NON_RUN_KEYS`: equal exactly when the entry would compute the
    same thing."""
    return digest({**comparable(settings), "methods": label, "label": label})[:24]
