"""The temporary folders of Flower runs: owned by a process id, removed by a later run once that
process is gone (a run killed with kill -9 cannot remove its own)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from conftest import ROOT

from pflalign.engines.flower_process import OWNER_FILE, make_run_dir, remove_stale_run_dirs


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _folder(parent, name: str, owner: dict | None):
    folder = parent / f"pflalign-{name}"
    (folder / "ray").mkdir(parents=True)
    if owner is not None:
        (folder / OWNER_FILE).write_text(json.dumps(owner))
    return folder


def test_a_run_folder_records_its_owner(tmp_path):
    folder = make_run_dir(tmp_path)
    owner = json.loads((tmp_path / os.path.basename(folder) / OWNER_FILE).read_text())
    assert owner["pid"] == os.getpid() and owner["started"]


def test_only_folders_of_gone_owners_are_removed(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = _folder(tmp_path, "dead", {"pid": _dead_pid()})
        alive = _folder(tmp_path, "alive", {"pid": sleeper.pid})
        mine = _folder(tmp_path, "mine", {"pid": os.getpid()})
        legacy = _folder(tmp_path, "legacy", None)  # no owner record: left alone
        garbled = _folder(tmp_path, "garbled", None)
        (garbled / OWNER_FILE).write_text("not json")
        other = tmp_path / "unrelated-dead"
        other.mkdir()
        (other / OWNER_FILE).write_text(json.dumps({"pid": _dead_pid()}))
        # the id is alive, but it is another process than the one that made the folder
        reused = _folder(tmp_path, "reused", {"pid": sleeper.pid, "started": "1"})
        removed = remove_stale_run_dirs(tmp_path)
        assert sorted(removed) == sorted([dead, reused])
        assert not dead.exists() and not reused.exists()
        assert alive.exists() and mine.exists() and legacy.exists() and garbled.exists()
        assert other.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_folder_of_a_killed_run_is_removed_by_the_next_run(tmp_path):
    # a real process makes its run folder, then dies by SIGKILL, as `kill -9` on a run does
    code = ("import os, signal, sys\n"
            "from pflalign.engines.flower_process import make_run_dir\n"
            "print(make_run_dir(sys.argv[1]), flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    killed = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                            text=True, cwd=ROOT, timeout=60)
    assert killed.returncode == -signal.SIGKILL
    left = killed.stdout.strip()
    assert os.path.isdir(left)
    new = make_run_dir(tmp_path)  # what the next run does first
    assert not os.path.exists(left)
    assert os.path.isdir(new)
