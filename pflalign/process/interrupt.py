"""Stopping a run cleanly: a stop flag that signal handlers set and the round loop checks.

``simulate.py`` runs inside :func:`handle_signals`: the first Ctrl-C (SIGINT) or SIGTERM only
calls :func:`request_stop`, and the code that runs rounds calls :func:`check_stop` at safe points
(the start of every round and of every method entry, and while waiting for replies), which raises
:class:`Interrupted`. :func:`pflalign.run.driver.run_methods` then writes what has finished and
re-raises, so that the engine can stop Ray and remove its temporary folder. A second signal
exits at once (exit status 128 + the signal's number) after at most a few seconds of quick
clean-ups (:func:`cleanup_on_forced_exit`: the Flower engine stops Ray's processes and removes
its temporary folder); whatever those miss, the next run removes
(:func:`pflalign.engines.flower_process.make_run_dir`).

The flag is process-wide and thread-safe: a Flower simulation runs the round loop in a
thread of its own, while signal handlers always run in the main thread.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

_STOP = threading.Event()
_REASON: list[int] = []  # the number of the signal that asked for the stop, if one did
#: the handlers :func:`handle_signals` installed (signal number -> handler), while it is active
_INSTALLED: dict[int, Callable] = {}
#: quick clean-ups for a forced exit (:func:`cleanup_on_forced_exit`)
_CLEANUPS: list[Callable[[], None]] = []
#: the longest a second signal waits for those clean-ups before the process exits
FORCED_CLEANUP_SECONDS = 3.0

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """The run was asked to stop (Ctrl-C or SIGTERM).

    :func:`pflalign.run.driver.run_methods` sets :attr:`results_path` (where it wrote the finished
    entries), :attr:`finished` and :attr:`unfinished` (method entry labels) and
    :attr:`partial_rounds` before re-raising.
    """

    def __init__(self, message: str = "the run was interrupted"):
        super().__init__(message)
        self.results_path: Path | None = None
        self.finished: list[str] = []
        self.unfinished: list[str] = []
        #: rounds finished by the entry that was running (kept under 'partial')
        self.partial_rounds = 0


def request_stop(signum: int | None = None) -> None:
    """Ask the run to stop at its next :func:`check_stop` (``signum``: the signal that asked)."""
    if signum is not None and not _REASON:
        _REASON.append(signum)
    _STOP.set()


def stop_requested() -> bool:
    return _STOP.is_set()


def stop_signal() -> int | None:
    """The number of the signal that requested the stop (None: none did, or no stop)."""
    return _REASON[0] if _REASON and _STOP.is_set() else None


def check_stop() -> None:
    """Raise :class:`Interrupted` when a stop was requested."""
    if _STOP.is_set():
        raise Interrupted("the run was interrupted")


def reset() -> None:
    """Forget a stop request (a new run in the same process starts unstopped)."""
    _STOP.clear()
    _REASON.clear()


def exit_status(signum: int | None) -> int:
    """The shell's convention for a run ended by signal ``signum``: 128 + its number
    (130 for SIGINT, 143 for SIGTERM); 130 when no signal is known."""
    return 128 + (signum if signum is not None else signal.SIGINT)


def signal_name(signum: int | None) -> str:
    if signum is None:
        return "stop requested"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _say(text: str) -> None:
    # os.write, not print: a handler may interrupt a print to the same stream in the main thread
    try:
        os.write(2, text.encode())
    except OSError:
        pass


def _handler(signum: int, _frame: object) -> None:
    if not _STOP.is_set():
        request_stop(signum)
        _say(f"\n{signal_name(signum)} received: stopping after the clients' current work and "
             "writing the finished results (send it again to exit at once).\n")
        return
    _say(f"\n{signal_name(signum)} received again: exiting now.\n")
    _forced_exit(exit_status(stop_signal() or signum))


def _forced_exit(status: int) -> None:
    """Run the registered quick clean-ups (in a thread, for at most
    :data:`FORCED_CLEANUP_SECONDS`: the main thread may hold a lock they need), then exit."""
    logging.disable(logging.CRITICAL)  # the clean-ups make in-flight work fail: no tracebacks

    def work() -> None:
        for cleanup in reversed(list(_CLEANUPS)):
            try:
                cleanup()
            except Exception:  # exiting anyway: nothing to report it to
                pass

    worker = threading.Thread(target=work, name="forced-exit-cleanup", daemon=True)
    worker.start()
    worker.join(FORCED_CLEANUP_SECONDS)
    os._exit(status)


@contextmanager
def cleanup_on_forced_exit(cleanup: Callable[[], None]) -> Iterator[None]:
    """Within this block, a second signal (which exits at once) first calls ``cleanup``: a
    quick, best-effort step such as stopping child processes or removing a temporary folder."""
    _CLEANUPS.append(cleanup)
    try:
        yield
    finally:
        _CLEANUPS.remove(cleanup)


@contextmanager
def handle_signals(signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[None]:
    """Within this block, SIGINT and SIGTERM request a stop (:func:`request_stop`) instead of
    raising KeyboardInterrupt or ending the process; a second one exits at once. The previous
    handlers come back afterwards. Outside the main thread (where Python cannot set signal
    handlers) this does nothing but reset the flag.

    Handlers are installed even where the signal was ignored (a background job of a
    non-interactive shell starts with SIGINT ignored), so that ``kill -INT`` always stops a run.
    """
    reset()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    try:
        for signum in signals:
            previous[signum] = signal.signal(signum, _handler)
            _INSTALLED[signum] = _handler
        yield
    finally:
        for signum, handler in previous.items():
            # None: a handler not set from Python; the default is the closest
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
            _INSTALLED.pop(signum, None)


def reinstall_handlers() -> None:
    """Install :func:`handle_signals`' handlers again, if it is active: for after a library
    (``ray.init`` does, for SIGTERM) has replaced them with its own."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, handler in _INSTALLED.items():
        if signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)
