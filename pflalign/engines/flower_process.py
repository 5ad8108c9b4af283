"""Process environment for Flower and Ray, and the temporary folder of a simulation run.

:func:`set_flower_environment` sets Flower's and Ray's defaults before ``flwr`` is imported
(``clients`` and ``strategies`` call it on import): no telemetry, no update checks, no package
installs. A value the user has already set in the environment wins. :func:`bind_ray_to_loopback`
makes a Ray that this process starts listen on 127.0.0.1 only.

:func:`make_run_dir` creates a run's temporary folder (Flower's and Ray's working files) with the
owner's process id in it, and first removes the folders of earlier runs whose owner is gone
(a run killed with ``kill -9`` cannot remove its own).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

FLOWER_ENVIRONMENT = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    # Ray would otherwise warn on every start that it no longer overrides accelerator variables.
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
}

#: Ray's switch for multi-node clusters (named for Windows and macOS, where it is off by
#: default). Off, Ray takes 127.0.0.1 as the node's address, and its GCS, raylet, runtime-env
#: agent, driver and workers then listen on 127.0.0.1 instead of on all interfaces.
RAY_CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

#: the values set_flower_environment put in the environment (the user's own ones win)
_SET_HERE: dict[str, str] = {}

RUN_DIR_PREFIX = "pflalign-"
OWNER_FILE = "owner.json"


def set_flower_environment(run_dir: str | None = None) -> dict[str, str]:
    """Set Flower/Ray defaults (keeping the user's own values); return what is now in effect.

    With ``run_dir``, ``FLWR_HOME`` and ``RAY_TMPDIR`` default to folders inside it (a later
    run's folder replaces an earlier one's).
    """
    wanted = dict(FLOWER_ENVIRONMENT)
    if run_dir is not None:
        wanted["FLWR_HOME"] = os.path.join(run_dir, "flwr-home")
        wanted["RAY_TMPDIR"] = os.path.join(run_dir, "ray")
    for key, value in wanted.items():
        # a value set here for an earlier run (its folder is gone) follows the new run
        if key not in os.environ or os.environ[key] == _SET_HERE.get(key):
            os.environ[key] = _SET_HERE[key] = value
    return {key: os.environ[key] for key in wanted}


def bind_ray_to_loopback() -> None:
    """Make the single-node Ray that this process is about to start listen on 127.0.0.1 only
    (its child processes inherit the setting). Only for a Ray started here: a driver that joins
    a cluster must keep its routable address. The user's own value wins."""
    os.environ.setdefault(RAY_CLUSTER_SWITCH, "0")
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # read when ray was imported: follow the variable from now on
        constants.ENABLE_RAY_CLUSTER = os.environ[RAY_CLUSTER_SWITCH].lower() in ("1", "true")


# --- the run's temporary folder ----------------------------------------------------------------
def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused id apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    if started is not None and (now := _start_time(pid)) is not None:
        return now == started
    return True


def _owner(folder: Path) -> dict | None:
    """The owner record of one of our run folders, or None when it is not one (or unreadable)."""
    try:
        if not folder.is_dir() or folder.is_symlink() or folder.stat().st_uid != os.getuid():
            return None
        owner = json.loads((folder / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int):
        return None
    return owner


def remove_stale_run_dirs(parent: str | Path | None = None) -> list[Path]:
    """Remove the ``pflalign-*`` folders in ``parent`` (the temp dir) that this user owns and
    whose recorded owner process is gone; return them. Folders without an owner record (a run
    of an older version, or one that is just being created) are left alone."""
    removed = []
    for folder in sorted(Path(parent or tempfile.gettempdir()).glob(RUN_DIR_PREFIX + "*")):
        owner = _owner(folder)
        if owner is None or owner["pid"] == os.getpid():
            continue
        if _alive(owner["pid"], owner.get("started")):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            removed.append(folder)
    return removed


def _descendants(pid: int) -> list[int]:
    """The ids of ``pid``'s live descendants, from /proc (Linux; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":  # zombies are gone already
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def terminate_children(timeout: float = 2.0) -> None:
    """SIGTERM this process's descendants (a local Ray's GCS, raylet, agents and workers), then
    SIGKILL those still alive after ``timeout`` seconds: a best-effort step for exiting in a
    hurry, when there is no time for ``ray.shutdown()``. Linux only (a no-op elsewhere)."""
    pending = _descendants(os.getpid())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pending:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = set(_descendants(os.getpid()))
            pending = [pid for pid in pending if pid in alive]
        if not pending:
            return


def make_run_dir(parent: str | Path | None = None) -> str:
    """Create this run's temporary folder (``pflalign-*`` in the temp dir) with its owner's
    process id recorded in it, after removing stale folders of runs that were killed."""
    remove_stale_run_dirs(parent)
    run_dir = tempfile.mkdtemp(prefix=RUN_DIR_PREFIX, dir=parent)
    owner = {"pid": os.getpid(), "started": _start_time(os.getpid()),
             "command": " ".join(sys.argv)[:500]}
    Path(run_dir, OWNER_FILE).write_text(json.dumps(owner) + "\n")
    return run_dir
