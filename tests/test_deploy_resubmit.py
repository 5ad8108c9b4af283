"""``deploy_local.sh run``: what it does when a run's ServerApp fails, with ``flwr`` replaced.

Flower 1.42's ServerApp gives up on any error of its first request to the SuperLink whose text
mentions TLS (``flwr.supercore.retry.http_retry``), transient ones included: on a loaded machine a
ServerApp once died at its first request with ``[SSL: UNEXPECTED_EOF_WHILE_READING]`` before it
had logged a line (the deployment test in CI; that run's ``flwr run`` output and ``flwr ls``
status are replayed below). ``run`` then submits the run again, at most ``--retries`` times; any
other failure ends it with the run's status and details from ``flwr ls``.

The real script runs from a copy of the repository's layout whose ``.venv/bin`` holds only a
stand-in ``flwr`` (the script puts ``ROOT/.venv/bin`` first on PATH): ``flwr run`` prints what a
scripted attempt printed and, when that attempt completed, writes its results.json; ``flwr ls``
reports that attempt's status. Everything else (the config, the completeness check) is real.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

SSL_EOF = ("ServerApp failed with exception: [SSL: UNEXPECTED_EOF_WHILE_READING] EOF occurred "
           "in violation of protocol (_ssl.c:1006)")
STARTED = ["Using SuperLink: pflalign-local (127.0.0.1:45330)", "Successfully started run {id}",
           "INFO :      Starting logstream for run_id `{id}`"]
DIED_AT_START = {"lines": STARTED, "status": "finished:failed", "details": SSL_EOF}
COMPLETED = {"lines": [*STARTED, "INFO :      Start `flwr-serverapp` process",
                       "[pflalign] 1 rounds, 3 clients (+0 unseen)"],
             "status": "finished:completed", "details": "", "results": True}

FAKE_FLWR = r'''#!{python}
"""A stand-in for the flwr CLI: replays the attempts in scenario.json, one per `flwr run`."""
import json, sys, tomllib
from pathlib import Path

here = Path(__file__).parent
scenario = json.loads((here / "scenario.json").read_text())
counter = here / "attempts"
args = sys.argv[1:]
if args[0] == "run":
    n = int(counter.read_text()) if counter.exists() else 0
    counter.write_text(str(n + 1))
    attempt = scenario[n]
    for line in attempt["lines"]:
        print(line.format(id=1000 + n), flush=True)
    if attempt.get("results"):
        config = tomllib.loads(Path(args[args.index("--run-config") + 1]).read_text())
        rounds = [{{"round": r}} for r in range(1, int(config["rounds"]) + 1)]
        results = {{"methods": {{m.strip(): {{"rounds": rounds}}
                                 for m in str(config["methods"]).split(",")}}}}
        (Path(config["out-dir"]) / "results.json").write_text(json.dumps(results))
elif args[0] == "ls":
    run_id = int(args[args.index("--run-id") + 1])
    attempt = scenario[run_id - 1000]
    print(json.dumps({{"success": True, "runs": [{{
        "run-id": str(run_id), "status": attempt["status"],
        "status-details": attempt["details"]}}]}}))
else:
    sys.exit(f"the stand-in flwr has no {{args[0]!r}}")
'''


def _run(tmp_path: Path, scenario: list[dict], *extra: str) -> tuple[subprocess.CompletedProcess,
                                                                       Path]:
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "deploy_local.sh", root / "scripts")
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    flwr = bin_dir / "flwr"
    flwr.write_text(FAKE_FLWR.format(python=sys.executable))
    flwr.chmod(0o755)
    (bin_dir / "scenario.json").write_text(json.dumps(scenario))
    work = tmp_path / "deploy"
    (work / "pids").mkdir(parents=True)
    # a live process that `alive` takes for the SuperLink (its command line names flower-)
    superlink = subprocess.Popen(["bash", "-c", "exec -a flower-superlink sleep 120"])
    try:
        (work / "pids" / "superlink.pid").write_text(str(superlink.pid))
        env = dict(os.environ,
                   PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
        result = subprocess.run(
            ["bash", str(root / "scripts" / "deploy_local.sh"), "run", "--workdir", str(work),
             "--rounds", "1", "--methods", "fedavg", "--set", "num-clients=3", "--out",
             str(tmp_path / "out"), *extra],
            capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    finally:
        superlink.kill()
        superlink.wait()
    return result, bin_dir / "attempts"


def test_a_serverapp_that_died_at_its_first_request_is_submitted_again(tmp_path):
    result, attempts = _run(tmp_path, [DIED_AT_START, COMPLETED])
    assert result.returncode == 0, result.stdout + result.stderr
    assert attempts.read_text() == "2"
    assert (f"the ServerApp failed before it started (no complete results.json: [Errno 2] No such "
            f"file or directory: '{tmp_path / 'out' / 'results.json'}'; flwr run exit status 0, "
            f"run 1000 finished:failed: {SSL_EOF}); submitting the run again (attempt 2 of 2)"
            ) in result.stdout
    assert f"results: {tmp_path / 'out' / 'results.json'}" in result.stdout
    # both attempts' output is in the run's log, and the terminal saw each line once
    (log,) = (tmp_path / "deploy" / "runs").glob("*/flwr-run.log")
    assert log.read_text().count("Starting logstream") == 2
    assert result.stdout.count("Successfully started run 1000") == 1
    assert result.stdout.count("Successfully started run 1001") == 1


def test_resubmissions_stop_at_retries(tmp_path):
    result, attempts = _run(tmp_path, [DIED_AT_START, DIED_AT_START, COMPLETED], "--retries", "1")
    assert result.returncode == 1
    assert attempts.read_text() == "2"
    assert "the run failed (no complete results.json" in result.stderr
    assert f"run 1001 finished:failed: {SSL_EOF}); see " in result.stderr

    result, attempts = _run(tmp_path / "none", [DIED_AT_START, COMPLETED], "--retries", "0")
    assert result.returncode == 1 and attempts.read_text() == "1"
    assert f"run 1000 finished:failed: {SSL_EOF}); see " in result.stderr


def test_a_serverapp_that_had_started_is_not_submitted_again(tmp_path):
    """A TLS error after the ServerApp logged (it may have sent messages), or any other failure
    at the start, ends the run with its details: only a run that did nothing is repeated."""
    logged = {**DIED_AT_START, "lines": [*STARTED, "[pflalign] 1 rounds, 3 clients (+0 unseen)"]}
    config_error = {**DIED_AT_START, "details": "ServerApp failed with exception: rounds must be "
                    "positive"}
    for name, first in (("logged", logged), ("config", config_error)):
        result, attempts = _run(tmp_path / name, [first, COMPLETED])
        assert result.returncode == 1, result.stdout
        assert attempts.read_text() == "1"
        assert f"run 1000 finished:failed: {first['details']}); see " in result.stderr
        assert "submitting the run again" not in result.stdout
