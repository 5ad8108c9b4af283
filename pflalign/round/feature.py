"""Round features: what a run adds to every round, one module each, behind one small interface.

A :class:`RoundFeature` is a cross-cutting step of a method entry's rounds: central DP, the
update-norm bound and the update clip, the audits, the simulated clock, upload recording,
telemetry, GGA's warm start. The round loop (:class:`~pflalign.round.loop.RoundLoop`) and its
schedulers call every feature the config turned on, in the order of :data:`FEATURES`, at these
points of a round:

====================  =======================================================================
hook                  when, and what it may do
====================  =======================================================================
``start``             once, after the server state exists: check the config against the run,
                      say what it does
``select``            a synchronous round picks its clients (one feature may choose them)
``before_training``   before the round's training: change the server state, add row entries
                      and bytes (GGA)
``sending``           the training messages are built, not yet sent
``received``          the training replies came back, unchecked (it may drop some: a deadline)
``checked``           the replies passed validation: it may reject more (an audit)
``bound``             the round's updates before aggregation: drop or scale them
``release``           the updates the method's rule aggregates: replace them (central DP)
``trained``           the training round's row is complete: add entries (epsilon)
``evaluating``        an evaluation's messages are built, not yet sent (save-models flags them)
``evaluated``         an evaluation's replies passed validation: it may reject some
``accepted``          metrics of replies that were used (training or evaluation)
``final``             the run's final metrics: add entries
``result``            the run's result: add entries beside rounds and metrics
====================  =======================================================================

Every hook has a default that does nothing, so a feature writes only the ones it needs. Each hook
gets the round loop (``loop``) first: its server runtime, method, state, settings and reporter,
and its calls for messages and exchanges. A
feature that keeps state between rounds gives it to checkpoints with :meth:`state_dict` (JSON)
and takes it back with :meth:`load_state_dict`; the checkpoint keeps it under the feature's
:attr:`~RoundFeature.name`.

A new feature is one module with one class and one :func:`register` call (docs/design.md shows a
worked example); :func:`compose` builds, for a method entry, the features whose
:meth:`~RoundFeature.wanted` says the entry's settings turn them on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from pflalign.methods.base import Method
from pflalign.server.validation import Collected
from pflalign.settings.schema import Settings
from pflalign.wire.messages import Exchange, Outgoing, Update

#: a hook's row entries, bytes down and bytes up
Traffic = tuple[dict[str, float], int, int]


@dataclass
class Selection:
    """A synchronous round's clients as a feature chose them: the clients asked, how many
    replies the round wants, and the row's entries."""

    clients: list[int]
    wanted: int
    entries: dict = field(default_factory=dict)


@dataclass
class TrainingRound:
    """One synchronous training round as features see it: its number, the messages sent, how
    many replies it uses, the exchange that came back (a feature may replace it with the
    replies it keeps), its row so far, and the replies features rejected beyond validation
    (added to the row's ``rejected``)."""

    number: int
    messages: list[Outgoing]
    #: how many replies the round uses (at most; over-selection asks more clients)
    wanted: int = 0
    exchange: Exchange | None = None
    row: dict = field(default_factory=dict)
    rejected: int = 0
    #: the bytes of a feature's own exchanges after training (SecAgg+'s unmasking)
    bytes_down: int = 0
    bytes_up: int = 0


class RoundFeature:
    """Base of every round feature: each hook does nothing (see the module docstring)."""

    #: the feature's name: its key in checkpoints and its entry in :data:`FEATURES`
    name: ClassVar[str] = ""
    #: a feature under which a round's aggregation is never rolled back for the clients' losses
    #: (central DP: the losses are not privatized, so one client could tip the majority)
    forbids_rollback: ClassVar[bool] = False
    #: a feature whose ``release`` gives an update even when a round drew no client (central
    #: DP's noise)
    releases_without_updates: ClassVar[bool] = False

    @classmethod
    def wanted(cls, settings: Settings, method: Method) -> bool:
        """Whether a method entry with ``settings`` runs with this feature."""
        return False

    def start(self, loop) -> None:
        """The run begins (the server state exists, no round has run)."""

    def select(self, loop, server_round: int, wanted: int) -> Selection | None:
        """The clients of a synchronous training round that wants ``wanted`` replies (None:
        the server's own draw)."""
        return None

    def before_training(self, loop, server_round: int) -> Traffic:
        """Before the round's training: its row entries, bytes down and bytes up."""
        return {}, 0, 0

    def sending(self, loop, training: TrainingRound) -> None:
        """The round's training messages are built and about to be sent."""

    def received(self, loop, training: TrainingRound) -> None:
        """The round's training replies came back (``training.exchange``), not yet checked."""

    def checked(self, loop, training: TrainingRound, collected: Collected,
                ) -> Collected:
        """The round's validated replies; returns those that stand."""
        return collected

    def bound(self, loop, server_round: int, updates: list[Update], row: dict,
              ) -> list[Update]:
        """The round's updates before aggregation; returns those kept (bounded)."""
        return updates

    def release(self, loop, server_round: int, updates: Sequence[Update],
                row: dict) -> Sequence[Update]:
        """What the method's rule aggregates in place of ``updates``."""
        return updates

    def trained(self, loop, server_round: int, row: dict) -> None:
        """The training round's row is complete (``row``, to add entries to)."""

    def evaluating(self, loop, messages: list[Outgoing], server_round: int) -> list[Outgoing]:
        """An evaluation's messages, built and not yet sent; returns those to send."""
        return messages

    def evaluated(self, loop, server_round: int, messages: Sequence[Outgoing],
                  collected: Collected, metrics: dict) -> Collected:
        """An evaluation's validated replies (answers to ``messages``); returns those that
        stand, adding the feature's entries to ``metrics``."""
        return collected

    def accepted(self, loop, metrics: Iterable[Mapping[str, float]]) -> None:
        """The metrics of replies the round used."""

    def final(self, loop, final: dict) -> None:
        """The run's final metrics (``final``, to add entries to)."""

    def result(self, loop) -> dict:
        """Entries of the run's result beside its rounds and final metrics."""
        return {}

    def checkpoint_refusal(self, loop, server_round: int) -> str | None:
        """Why no checkpoint may be written after ``server_round`` (None: it may)."""
        return None

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the feature (JSON-able; default: nothing)."""
        return {}

    def load_state_dict(self, state: Mapping) -> None:
        """Continue from a checkpoint's :meth:`state_dict`."""


#: the registered features by name, in the order their hooks run
FEATURES: dict[str, type[RoundFeature]] = {}


def register(feature: type[RoundFeature]) -> type[RoundFeature]:
    """Register a feature class (used as a class decorator); its hooks run after those of the
    features registered before it."""
    if not feature.name or feature.name in FEATURES:
        raise ValueError(f"A round feature needs a name of its own, got {feature.name!r}.")
    FEATURES[feature.name] = feature
    return feature


def compose(loop) -> list[RoundFeature]:
    """The features a method entry's settings turn on, built for ``loop``, in registry order."""
    settings, method = loop.server.settings, loop.method
    return [cls(loop) for cls in FEATURES.values() if cls.wanted(settings, method)]
