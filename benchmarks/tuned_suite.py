#!/usr/bin/env python
"""The tuned suite of issue 36 on a 2-core machine: every default scenario, the methods below,
tuned with ``--tune`` on validation data and evaluated on five seeds, its report with the
verdict across scenarios.

One ``simulate.py`` study uses one core on the batched engine, so the scenarios are split into
``--jobs`` parts, each its own study (``OUT/part-<i>``), run at once. When every part has
finished, the full suite's plan is written in ``OUT/all``, each part's groups (``runs/``) and
tuning (``tuning/``: its runs and its Optuna storage) are copied into it, and ``simulate.py
--resume OUT/all`` keeps them all and writes one report over every scenario: the same groups,
trials and metrics a single ``simulate.py --suite`` study would have, since each scenario's
runs depend only on its own settings and seeds. Run it again after an interruption: finished
groups are kept and a part killed part-way continues (``--resume``).

    python benchmarks/tuned_suite.py --out results/suite36
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from studies import finished

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pflalign.run.cli import make_plan, parse_args  # noqa: E402
from pflalign.run.study import scenario_names  # noqa: E402

METHODS = "fedavg,fedavg-ft,local,fedrep,ditto,fedala,fedcp,pflalign"
#: the parts, balanced by the time a group takes on 2 cores (the synthetic scenarios run 100
#: rounds of 20 local epochs; the others 15 to 30 rounds of one)
PARTS = ("synthetic-1-1,dir-0.1,dir-0.5,cross-device",
         "synthetic-iid,pathological-2,quantity,rotated-unseen")


def study_arguments(args: argparse.Namespace) -> list[str]:
    return ["--methods", args.methods, "--seeds", args.seeds, "--tune", str(args.tune),
            "--tune-seeds", args.tune_seeds, "--set", f"engine={args.engine}",
            *[a for item in args.set for a in ("--set", item)]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/suite36")
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--seeds", default="0-4")
    parser.add_argument("--tune", type=int, default=6)
    parser.add_argument("--tune-seeds", default="100")
    parser.add_argument("--engine", default="batched")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every scenario (a smoke run: rounds=1)")
    args = parser.parse_args()
    out = Path(args.out)
    covered = sorted(s for part in PARTS for s in part.split(","))
    if covered != scenario_names():
        raise SystemExit(f"PARTS cover {covered}, the suite is {scenario_names()}.")
    common = study_arguments(args)
    started = time.monotonic()
    procs = []
    for i, part in enumerate(PARTS):
        folder = out / f"part-{i}"
        if finished(folder) is not None:
            continue
        command = ([sys.executable, str(ROOT / "simulate.py"), "--resume", str(folder)]
                   if folder.exists() else
                   [sys.executable, str(ROOT / "simulate.py"), "--scenario", part, *common,
                    "--out", str(folder)])
        folder.parent.mkdir(parents=True, exist_ok=True)
        log = open(out / f"part-{i}.log", "a")  # noqa: SIM115 (closed after the wait)
        print(f"[part {i}] {' '.join(command[1:])} (log: {log.name})", flush=True)
        procs.append((i, subprocess.Popen(command, cwd=ROOT, stdout=log,
                                          stderr=subprocess.STDOUT), log))
    failed = []
    for i, proc, log in procs:
        if proc.wait() != 0:
            failed.append(i)
        log.close()
    if failed:
        raise SystemExit(f"part(s) {failed} failed: see {out}/part-<i>.log")
    print(f"[parts] done in {time.monotonic() - started:.0f} s", flush=True)

    whole = out / "all"
    if finished(whole) is None:
        if not (whole / "plan.json").exists():
            plan = make_plan(parse_args(["--suite", *common, "--out", str(whole), "--quiet"]))
            plan.command = ("python benchmarks/tuned_suite.py " + " ".join(sys.argv[1:])).strip()
            whole.mkdir(parents=True, exist_ok=True)
            plan.save()
        for i in range(len(PARTS)):
            for kind in ("runs", "tuning"):
                for scenario in sorted((out / f"part-{i}" / kind).iterdir()):
                    target = whole / kind / scenario.name
                    if not target.exists():
                        shutil.copytree(scenario, target)
        subprocess.run([sys.executable, str(ROOT / "simulate.py"), "--resume", str(whole),
                        "--quiet"], cwd=ROOT, check=True)
    print(f"Report: {whole / 'report.md'}")


if __name__ == "__main__":
    main()
