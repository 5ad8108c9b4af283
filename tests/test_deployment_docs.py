"""docs/deployment.md's manual steps, run as written: its bash blocks, in order, in one shell.

The blocks of "The steps by hand" (environment, certificates, partition files, a SuperLink with
TLS and SuperNode authentication, the CLI's connection, three registered keys, three SuperNodes,
a 2-round `flwr run`, and the stop by PID) are extracted from the page and run from the
repository root on 127.0.0.1, so the page cannot rot. Two things are changed, each a whole-word
substitution checked to occur: the work directory (a temporary one, not ``./deploy-by-hand``)
and the ports (free ones, not 39400 and 39410-39412). The run must write results.json with both
rounds, and step 7 must leave no process of it running. About a minute on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest
from conftest import ROOT, needs_fashion_mnist
from test_deployment import _environment, _free_ports, _processes_mentioning

PAGE = ROOT / "docs" / "deployment.md"



def manual_steps(text: str) -> list[str]:
    """The bash blocks between "## The steps by hand" and the next section, in order."""
    section = text.split("## The steps by hand", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


@needs_fashion_mnist
@pytest.mark.deployment
@pytest.mark.slow
def test_the_manual_steps_run_word_for_word(tmp_path):
    blocks = manual_steps(PAGE.read_text())
    assert len(blocks) == 9, [b.splitlines()[0] for b in blocks]
    script = "set -euo pipefail\n" + "\n".join(blocks)
    work = tmp_path / "by-hand"
    port = _free_ports(4)
    replacements = {"W=$PWD/deploy-by-hand": f"W={work}", "39400": str(port),
                    "39410": str(port + 1)}
    for old, new in replacements.items():
        assert old in script, f"the page no longer has {old!r}"
        script = script.replace(old, new)
    (tmp_path / "steps.sh").write_text(script)
    log_path = tmp_path / "steps.log"
    started = time.monotonic()
    try:
        with open(log_path, "w") as log:
            done = subprocess.run(["bash", str(tmp_path / "steps.sh")], stdout=log,
                                  stderr=subprocess.STDOUT, cwd=ROOT, env=_environment(),
                                  timeout=600, start_new_session=True)
        text = log_path.read_text(errors="ignore")
        assert done.returncode == 0, text[-4000:]
        results = json.loads((work / "out" / "results.json").read_text())
        rounds = results["methods"]["pflalign"]["rounds"]
        assert [r["round"] for r in rounds] == [1, 2], rounds
        assert results["methods"]["pflalign"]["final"]["evaluated"] == 3
        print(f"manual steps: {time.monotonic() - started:.0f} s")
    finally:  # whatever step failed, stop what the steps started, by the PIDs they recorded
        for pid_file in (work / "pids").glob("*.pid"):
            try:
                os.killpg(int(pid_file.read_text()), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass
    deadline = time.monotonic() + 20
    while (left := _processes_mentioning(str(work))) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left


def test_the_page_has_no_bracketed_options_in_runnable_blocks():
    """A block pasted into a shell must run: no ``[--option ...]`` placeholders."""
    for block in manual_steps(PAGE.read_text()):
        assert not re.search(r"\[--", block), block
        assert "<" not in block.replace("<<", "").replace("3<>", ""), block
