"""What the experiment scripts share: one setting of an experiment is one ``simulate.py`` study,
run once and kept."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def finished(path: Path) -> dict | None:
    """``PATH/results.json`` when the study (or plain run) there has finished: only then does
    it carry its ``kind`` (a plain run writes its file after every entry, without it)."""
    try:
        doc = json.loads((path / "results.json").read_text())
    except (OSError, ValueError):
        return None
    return doc if doc.get("kind") and not doc.get("interrupted") else None


def cached_study(path: Path, arguments: list[str], tag: str) -> dict:
    """The results of the study ``simulate.py ARGUMENTS --quiet --out PATH``: read from
    ``PATH/results.json`` when it has finished, continued from its plan and checkpoints when the
    folder holds a study or run killed part-way, else run."""
    if (doc := finished(path)) is not None:
        return doc
    command = [sys.executable, str(ROOT / "simulate.py"), *arguments, "--quiet", "--out",
               str(path)]
    if path.exists():
        command = [sys.executable, str(ROOT / "simulate.py"), "--resume", str(path), "--quiet"]
    started = time.monotonic()
    print(f"[{tag}] {' '.join(command[1:])}", flush=True)
    subprocess.run(command, check=True, cwd=ROOT)
    print(f"[{tag}] {time.monotonic() - started:.0f} s", flush=True)
    return json.loads((path / "results.json").read_text())
