"""What every engine is to the round loop, and how the driver opens one.

An :class:`Engine` reaches a run's clients: it discovers them and delivers one exchange of
messages at a time (:class:`~pflalign.round.loop.RoundLoop` calls nothing else). An engine
that keeps something beyond a method entry (client state spilled to disk) says so in
:meth:`Engine.memory_note` and removes it in :meth:`Engine.close`.

Each engine the ``engine`` key names (:data:`pflalign.settings.schema.ENGINES` declares them)
registers how it runs when its module is imported (:func:`register_engine`): its
:data:`Session`, a context manager that sets up what the engine needs for a whole run (Ray
workers, a cluster's address) and gives the driver a factory of the engine for each method
entry; or, for an engine whose framework runs the round loop in a process of its own (Flower's
ServerApp, in the app layer: ``strategies/simulation.py``), a runner of a whole config. The
driver imports the in-process engines' modules, and the Flower engine's only when a run uses it
(:func:`pflalign.run.driver.flower_engine`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from pflalign.outputs.results import Reporter
from pflalign.settings.schema import ENGINES, Settings
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
#: ``runner(settings, reporter, *, resume, ray_address, verbose, client_app)``: a whole config
#: run by an engine whose framework runs the round loop itself; returns the results
Runner = Callable[..., dict]


@dataclass(frozen=True)
class EngineRun:
    """How a registered engine runs a config: its :data:`Session`, or its :data:`Runner`."""

    session: Session | None = None
    runner: Runner | None = None


#: each registered engine, by the name the ``engine`` key takes
ENGINE_RUNS: dict[str, EngineRun] = {}


def register_engine(name: str, *, session: Session | None = None,
                    runner: Runner | None = None) -> None:
    """Register how the engine ``name`` (declared in :data:`~pflalign.settings.schema.ENGINES`)
    runs: one of ``session`` and ``runner``. Each engine's module calls it once, when imported."""
    if name not in ENGINES or (session is None) == (runner is None):
        raise ValueError(f"register_engine({name!r}): the engine must be declared in ENGINES "
                         "and given one of session and runner.")
    ENGINE_RUNS[name] = EngineRun(session, runner)
