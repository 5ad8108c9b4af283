"""Test helpers about processes: those of a session, what they listen on, stopping them all.

A test starts what it runs (``simulate.py``, a Ray head) with ``start_new_session=True``: every
process it starts then shares the session id of that first process (Ray's GCS, raylet, agents
and workers included), which finds them without touching other runs on the machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def session_processes(sid: int) -> list[int]:
    """Live processes of session ``sid`` (the run and everything it started: Ray included)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def listening_addresses(pids: list[int]) -> set[str]:
    """The local addresses the given processes listen on over TCP (from /proc)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address = fields[1].split(":")[0]
                found.add(_decode_address(address, width))
    return found


def _decode_address(hex_address: str, width: int) -> str:
    raw = bytes.fromhex(hex_address)
    # /proc/net/tcp* holds each 32-bit word in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    if width == 8:
        return ".".join(str(b) for b in words)
    if words[:12] == b"\0" * 10 + b"\xff\xff":  # an IPv4-mapped IPv6 address
        return ".".join(str(b) for b in words[12:])
    return ":".join(words[i:i + 2].hex() for i in range(0, 16, 2))


def stop_session(sid: int, grace: float = 5.0) -> list[int]:
    """SIGTERM every live process of session ``sid``, SIGKILL those left after ``grace``
    seconds; return those still alive after that (none, normally)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in session_processes(sid):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace
        while session_processes(sid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not session_processes(sid):
            return []
    return session_processes(sid)


def kill_once(proc: subprocess.Popen, ready: Callable[[], bool], log: Path,
              timeout: float = 120.0) -> None:
    """SIGKILL ``proc`` as soon as ``ready()`` holds (within ``timeout`` seconds, the process
    alive until then: else the assertion shows the end of its ``log``)."""
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
