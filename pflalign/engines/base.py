"""What every engine is to the round loop, and how the driver opens one.

An :class:`Engine` reaches a run's clients: it discovers them and delivers one exchange of
messages at a time (:class:`~pflalign.round.loop.RoundLoop` calls nothing else). An engine
that keeps something beyond a method entry (client state spilled to disk) says so in
:meth:`Engine.memory_note` and removes it in :meth:`Engine.close`.

Each engine the ``engine`` key names is registered once, in
:data:`pflalign.settings.schema.ENGINES`, by where its :data:`Session` lives: a context manager
that sets up what the engine needs for a whole run (Ray workers, a cluster's address) and gives
the driver a factory of the engine for each method entry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

from pflalign.outputs.results import Reporter
from pflalign.settings.schema import Settings
from pflalign.wire.messages import ClientInfo, Exchange, Outgoing, Reply


class Engine:
    """How a round loop reaches its clients (every method the loop calls)."""

    def discover(self) -> dict[int, ClientInfo]:
        """The run's clients by id."""
        raise NotImplementedError

    def exchange(self, action: str, messages: Sequence[Outgoing]) -> Exchange:
        """Deliver ``messages`` (``action`` is train, evaluate, query or state) and collect
        replies. A :data:`~pflalign.wire.protocol.RESTORE` record is delivered with every shape
        as it is and not counted in the bytes."""
        raise NotImplementedError

    def submit(self, action: str, messages: Sequence[Outgoing]) -> int:
        """Deliver ``messages`` without waiting for their replies (asynchronous rounds in real
        time; only an engine whose clients answer on their own time has it); returns their
        bytes."""
        raise NotImplementedError(f"{type(self).__name__} cannot run rounds in real time")

    def poll(self) -> list[tuple[int, Reply, int]]:
        """The replies to :meth:`submit`'s messages that came since the last call, as
        ``(client, reply, bytes up)``."""
        raise NotImplementedError(f"{type(self).__name__} cannot run rounds in real time")

    def memory_note(self) -> str | None:
        """What the engine keeps beyond memory (spilled client state), for the run's log; None
        when nothing."""
        return None

    def close(self) -> None:
        """Remove what the engine keeps on disk for the method entry (spilled client state)."""


#: a method entry's settings -> the engine that runs it
EngineFactory = Callable[[Settings], Engine]
#: ``session(settings, reporter, ray_address)``: what an engine needs for a run, set up once
Session = Callable[[Settings, Reporter, "str | None"], AbstractContextManager[EngineFactory]]
