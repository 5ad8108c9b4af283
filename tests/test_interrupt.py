"""Stopping a run: Ctrl-C / SIGTERM write the finished entries, stop Ray, remove the run's
temporary folder and exit with 128 + the signal's number; a second signal exits at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, needs_fashion_mnist
from processes import listening_addresses, session_processes, stop_session

from pflalign.outputs.results import Reporter
from pflalign.process import interrupt
from pflalign.process.interrupt import (
    Interrupted,
    check_stop,
    handle_signals,
    reinstall_handlers,
    request_stop,
    stop_requested,
)

#: a run long enough to be interrupted (50 rounds), small enough to reach round 1 quickly
LONG_RUN = ["--set", "num-clients=4", "--set", "max-samples=2000", "--set", "rounds=50",
            "--set", "local-epochs=1", "--methods", "fedavg,local"]


@pytest.fixture(autouse=True)
def _no_stop_left_over():
    interrupt.reset()
    yield
    interrupt.reset()


def _wait_for(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


# --- the flag and the handlers ------------------------------------------------------------------
def test_the_first_signal_requests_a_stop_and_the_handlers_are_restored_afterwards():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with handle_signals():
        assert not stop_requested()
        check_stop()  # nothing requested: no exception
        os.kill(os.getpid(), signal.SIGTERM)
        assert _wait_for(stop_requested)
        assert interrupt.stop_signal() == signal.SIGTERM
        with pytest.raises(Interrupted):
            check_stop()
    assert {s: signal.getsignal(s) for s in before} == before


def test_handlers_come_back_after_a_library_replaced_them():
    with handle_signals():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as ray.init does with its own handler
        reinstall_handlers()
        os.kill(os.getpid(), signal.SIGTERM)  # would end pytest if the handler were not back
        assert _wait_for(stop_requested)


def test_exit_status_follows_the_shell_convention():
    assert interrupt.exit_status(signal.SIGINT) == 130
    assert interrupt.exit_status(signal.SIGTERM) == 143


def test_a_second_signal_exits_at_once_after_the_quick_cleanups(tmp_path):
    marker = tmp_path / "cleaned"
    code = (
        "import os, signal, time, pathlib\n"
        "from pflalign.process.interrupt import handle_signals, cleanup_on_forced_exit\n"
        f"marker = pathlib.Path({str(marker)!r})\n"
        "with handle_signals(), cleanup_on_forced_exit(lambda: marker.write_text('yes')):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(0.5)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(60)\n"
        "print('not reached')\n")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=60)
    assert result.returncode == 130, result.stderr
    assert time.monotonic() - started < 30
    assert marker.read_text() == "yes"
    assert "not reached" not in result.stdout
    assert "received again: exiting now" in result.stderr


# --- run_methods writes what finished ----------------------------------------------------------
class _StopAfter(Reporter):
    """Requests a stop once a given progress line has been printed (as a signal would)."""

    def __init__(self, line_start: str):
        super().__init__(quiet=True)
        self.line_start = line_start

    def info(self, text: str) -> None:
        if text.startswith(self.line_start):
            request_stop(signal.SIGINT)


@needs_fashion_mnist
def test_an_interrupted_run_keeps_its_finished_entries_and_rounds(tmp_path):
    from pflalign.engines.sequential import SequentialEngine
    from pflalign.run.config import build_settings
    from pflalign.run.driver import run_methods

    settings = build_settings({"num-clients": 3, "max-samples": 600, "rounds": 3, "eval-every": 1,
                         "fraction-train": 1.0, "local-steps": 2, "engine": "sequential",
                         "methods": "fedavg,local,fedprox", "out-dir": str(tmp_path)})
    with pytest.raises(Interrupted) as caught:
        run_methods(settings, SequentialEngine, _StopAfter("[local] round   2/3"))
    stop = caught.value
    assert stop.results_path == (tmp_path / "results.json").resolve()
    assert (stop.finished, stop.unfinished, stop.partial_rounds) == (
        ["fedavg"], ["local", "fedprox"], 2)
    results = json.loads(stop.results_path.read_text())
    assert results["interrupted"] is True
    assert list(results["methods"]) == ["fedavg"]
    assert [r["round"] for r in results["methods"]["fedavg"]["rounds"]] == [1, 2, 3]
    assert results["unfinished"] == ["local", "fedprox"]
    assert results["partial"]["label"] == "local"
    assert [r["round"] for r in results["partial"]["rounds"]] == [1, 2]


# --- real runs, through simulate.py -------------------------------------------------------------
def _own_run_dir(pid: int) -> Path | None:
    import tempfile

    for folder in Path(tempfile.gettempdir()).glob("pflalign-*"):
        try:
            if json.loads((folder / "owner.json").read_text())["pid"] == pid:
                return folder
        except (OSError, ValueError, KeyError):
            continue
    return None


def _start_and_interrupt(out: Path, sig: int, *extra: str) -> dict:
    """Start simulate.py in a session of its own, send ``sig`` once round 1 is printed, and
    report what happened: exit status, seconds to exit, output, the run folder, the addresses
    its processes listened on, and the processes of its session still alive afterwards."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "simulate.py"), *LONG_RUN, "--out", str(out), *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    seen = {"output": ""}
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:
            seen["output"] += line
            if "round   1/50" in line or time.monotonic() > deadline:
                break
        assert "round   1/50" in seen["output"], seen["output"][-3000:]
        seen["run_dir"] = _own_run_dir(proc.pid)
        seen["listening"] = listening_addresses(session_processes(proc.pid))
        sent = time.monotonic()
        proc.send_signal(sig)
        seen["output"] += proc.communicate(timeout=120)[0]
        seen["seconds"] = time.monotonic() - sent
        seen["status"] = proc.returncode
        _wait_for(lambda: not session_processes(proc.pid), timeout=15)
        seen["left"] = session_processes(proc.pid)
        return seen
    finally:  # never leave the run or its Ray behind, whatever failed above
        stop_session(proc.pid, grace=1.0)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@needs_fashion_mnist
def test_ctrl_c_stops_a_flower_run_cleanly(tmp_path):
    seen = _start_and_interrupt(tmp_path / "out", signal.SIGINT)
    assert seen["status"] == 130, seen["output"][-3000:]
    assert seen["seconds"] < 30
    assert not seen["left"], f"processes of the run still alive: {seen['left']}"
    assert seen["run_dir"] is not None and not seen["run_dir"].exists()
    # Ray (GCS, raylet, agents, workers) and the driver listened on the loopback only
    assert seen["listening"] and seen["listening"] <= {"127.0.0.1"}, seen["listening"]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["interrupted"] is True and results["unfinished"] == ["fedavg", "local"]
    assert results["methods"] == {}
    assert results["partial"]["label"] == "fedavg" and len(results["partial"]["rounds"]) >= 1
    lines = [line for line in seen["output"].splitlines() if line.startswith("Interrupted")]
    assert len(lines) == 1 and str(tmp_path / "out" / "results.json") in lines[0]
    assert "Traceback" not in seen["output"]


@needs_fashion_mnist
def test_sigterm_stops_a_sequential_run_cleanly(tmp_path):
    seen = _start_and_interrupt(tmp_path / "out", signal.SIGTERM, "--set", "engine=sequential")
    assert seen["status"] == 143, seen["output"][-3000:]
    assert seen["seconds"] < 30
    assert not seen["left"]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["interrupted"] is True and results["unfinished"] == ["fedavg", "local"]
    assert len(results["partial"]["rounds"]) >= 1
    assert "Interrupted (SIGTERM)" in seen["output"] and "Traceback" not in seen["output"]
