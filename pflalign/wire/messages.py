"""The message types between the round loop, the engines and the methods' rules.

Server side (NumPy): what a server rule sends a client (:class:`Payload`), one message as an
engine delivers it (:class:`Outgoing`), a client's reply as it comes back (:class:`Reply`), one
round's replies and bytes (:class:`Exchange`), a client as discovered (:class:`ClientInfo`) and a
validated training reply as a server rule sees it (:class:`Update`). Client side (torch): what a
client rule receives (:class:`Received`) and what its training returns (:class:`Upload`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from pflalign.settings.options import Value
from pflalign.wire.protocol import MODEL
from pflalign.wire.state import State, TorchState


@dataclass
class Payload:
    """What the server sends one client for one action: named array records (NumPy state dicts;
    :data:`~pflalign.wire.protocol.MODEL` is the model) and per-client config entries."""

    arrays: dict[str, State] = field(default_factory=dict)
    config: dict[str, Value] = field(default_factory=dict)


@dataclass
class Update:
    """A validated training reply, as the server rule sees it."""

    client: int
    num_examples: float
    metrics: dict[str, float]
    #: the uploaded model (its shared entries), None when the method uploads none
    model: State | None
    #: further validated array records (e.g. SCAFFOLD's control-variate change)
    arrays: dict[str, State] = field(default_factory=dict)
    #: under ``mode = async``, an update that trained from an older global model: ``model``
    #: is then its upload rebased onto the current model (:func:`pflalign.server.buffered.rebase`)
    #: and this holds what it was rebased from; None for an update from the current model
    stale: Stale | None = None


@dataclass(frozen=True)
class Stale:
    """What an asynchronous update was rebased from: the client's own upload, the global model
    (its exchanged entries) it trained from, how many aggregations happened since it was
    dispatched, and the weight its change got."""

    upload: State
    base: State
    staleness: int
    weight: float


@dataclass(frozen=True, slots=True)
class ClientInfo:
    """A client as discovered at start: its stable id, its split sizes, whether it is unseen
    (slotted: 72 bytes, not 188, for each of a million clients)."""

    id: int
    num_train: int
    num_test: int
    unseen: bool


@dataclass
class Outgoing:
    """One message to one client: its payload and the message config (method, label, round and
    the rule's own entries)."""

    client: int
    payload: Payload
    config: dict[str, Value]
    #: the most bytes each array record of the reply may hold, by record name (a record not
    #: named is refused); None: no per-record limit (the Flower engine refuses, unread, a reply
    #: over them)
    limits: dict[str, int] | None = None


@dataclass
class Reply:
    """One client's answer as an engine delivers it: metrics and array records, or an error.

    ``sender`` is the client the engine knows sent it (None when it cannot tell), ``who`` names
    it in messages, and ``error`` completes the sentence "<who> ..." when the reply is unusable."""

    sender: int | None
    who: str
    metrics: dict[str, object] = field(default_factory=dict)
    arrays: dict[str, State] = field(default_factory=dict)
    error: str | None = None
    #: no reply came before ``round-timeout`` (``error`` says so)
    timed_out: bool = False
    #: the engine refused it unread (larger than any honest reply can be): a rejected reply,
    #: not a failed client (``error`` says why)
    refused: bool = False


@dataclass
class Exchange:
    """The replies to one round of messages, and the array bytes that went each way."""

    replies: list[Reply]
    bytes_down: int
    bytes_up: int


@dataclass
class Received:
    """What the server sent a client for one action: named array records (torch state dicts;
    :data:`~pflalign.wire.protocol.MODEL` is the model) and the message's config."""

    server_round: int
    arrays: dict[str, TorchState] = field(default_factory=dict)
    config: dict[str, Value] = field(default_factory=dict)

    @property
    def model(self) -> TorchState | None:
        """The global model (or what the server rule sends in its place); None when not sent."""
        return self.arrays.get(MODEL)


@dataclass
class Upload:
    """What a client's training returns: its model (None when nothing is uploaded), its metrics,
    and further array records uploaded beside the model (SCAFFOLD's control-variate change)."""

    model: Mapping[str, torch.Tensor] | None
    metrics: dict[str, float | int] = field(default_factory=dict)
    arrays: dict[str, Mapping[str, torch.Tensor]] = field(default_factory=dict)
