#!/usr/bin/env python
"""PFLlib's Fashion-MNIST setting (``configs/pfllib-fmnist.toml``: 20 clients, Dirichlet(0.1), a
75/25 split, the 4-layer CNN, batch 10, one local epoch, SGD lr 0.005, every client every round),
evaluated every round as PFLlib does: seconds per round (training and evaluation) of each engine,
and of PFLlib itself when ``--pfllib`` names a prepared checkout.

Engines (each its own ``simulate.py`` process, ``--rounds`` rounds):

- ``batched:N``: the batched engine on N Ray workers (``batched-workers = N``), the cores split
  between them (one torch thread each on 2 cores);
- ``batched``: the batched engine in one process with every core as torch threads;
- ``flower``: the Flower engine on Ray, one client per core.

``--pfllib DIR``: a PFLlib checkout whose ``dataset/FashionMNIST`` its own generator has written
(``cd dataset && python generate_FashionMNIST.py noniid - dir``); its ``system/main.py`` runs with
``OMP_NUM_THREADS`` = the cores, ``--rounds`` - 1 as ``-gr`` (PFLlib runs rounds 0 .. gr), and its
per-round "time cost" lines are read. ``--pfllib-python`` is the interpreter for it (PFLlib needs
ujson, h5py, scikit-learn, calmsize and cvxpy beside torch).

``--repeats R`` runs the whole sequence of engines R times, each repeat starting one engine later
(A B C, B C A, C A B, ...), so that the machine's drift over minutes, and whatever running after
another engine does, falls on every engine alike (with R a multiple of the engines, each runs
once in every position).

``--ceiling`` adds, before each repeat's engines, this machine's ceiling for the setting's work:
a plain training loop of the ``cnn`` at batch 10 (no engine, no data loading), ``--ceiling-steps``
steps in one process with every core as torch threads, then the same steps split over one
single-thread process per core started together. The time of the second over the first is the
least any split of the work over processes can take against one process with every core, so it
bounds "N workers against one process" from below on this machine.

Printed and written to ``--out`` (``pfllib.json``, ``pfllib.md``): s/round as min-max and mean
over every round of every repeat, each engine's ratio to the first engine listed (the ratio of
the means, and with repeats the range of the ratios within each repeat, engines run minutes
apart), and whether each run gave the same metrics bit for bit as the first run of an engine
with the same torch threads per client.

    python benchmarks/pfllib_setting.py --pfllib /tmp/pfllib --pfllib-python /tmp/venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.scale import engine_settings  # noqa: E402
from scripts.compare_results import compare  # noqa: E402

PFLLIB_NAMES = {"fedavg": "FedAvg", "ditto": "Ditto"}


def run_engine(spec: str, method: str, args: argparse.Namespace, out: Path, repeat: int) -> dict:
    cell = out / f"{spec.replace(':', 'x')}-{method}" / str(repeat)
    settings = {"methods": method, **engine_settings(spec, os.cpu_count() or 1),
                "rounds": args.rounds, "eval-every": 1, "out-dir": str(cell)}
    command = [sys.executable, str(ROOT / "simulate.py"), "--config",
               str(ROOT / "configs" / "pfllib-fmnist.toml"), "--overwrite", "--quiet"]
    for key, value in settings.items():
        command += ["--set", f"{key}={value}"]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        return {"engine": spec, "method": method, "repeat": repeat,
                "error": (done.stderr or done.stdout)[-500:]}
    results = json.loads((cell / "results.json").read_text())
    rows = results["methods"][method]["rounds"]
    return {"engine": spec, "method": method, "repeat": repeat,
            "threads": settings["client-resources-num-cpus"],
            "seconds": [r["round-seconds"] for r in rows], "wall-s": wall,
            "personal-acc": results["methods"][method]["final"]["personal-acc"],
            "results": str(cell / "results.json")}


def run_pfllib(method: str, args: argparse.Namespace, out: Path, repeat: int) -> dict:
    system = Path(args.pfllib) / "system"
    cpus = str(os.cpu_count() or 1)
    command = [args.pfllib_python, "main.py", "-data", "FashionMNIST", "-m", "CNN", "-algo",
               PFLLIB_NAMES[method], "-gr", str(args.rounds - 1), "-did", "0", "-dev", "cpu",
               "-lbs", "10", "-lr", "0.005", "-nc", "20", "-jr", "1", "-ls", "1", "-eg", "1"]
    env = dict(os.environ, OMP_NUM_THREADS=cpus, MKL_NUM_THREADS=cpus)
    started = time.perf_counter()
    done = subprocess.run(command, cwd=system, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    (out / f"pfllib-{method}-{repeat}.log").write_text(done.stdout + done.stderr)
    seconds = [float(m) for m in re.findall(r"time cost -+ ([0-9.]+)", done.stdout)]
    if done.returncode != 0 or not seconds:
        return {"engine": "pfllib", "method": method, "repeat": repeat,
                "error": f"exit {done.returncode}: " + (done.stderr or done.stdout)[-500:]}
    return {"engine": "pfllib", "method": method, "repeat": repeat, "seconds": seconds,
            "wall-s": wall}


#: a plain training loop of the cnn at batch 10 for ``steps`` steps on ``threads`` torch threads;
#: prints its seconds
PLAIN_LOOP = """
import sys, time, torch
import torch.nn.functional as F
from pflalign.models.registry import build_model
steps, threads = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
torch.manual_seed(0)
model = build_model("cnn", (1, 28, 28), 10)
optimizer = torch.optim.SGD(model.parameters(), lr=0.005)
x, y = torch.randn(10, 1, 28, 28), torch.randint(0, 10, (10,))
for _ in range(20):
    optimizer.zero_grad(); F.cross_entropy(model(x), y).backward(); optimizer.step()
started = time.perf_counter()
for _ in range(steps):
    optimizer.zero_grad(); F.cross_entropy(model(x), y).backward(); optimizer.step()
print(time.perf_counter() - started)
"""


def run_ceiling(args: argparse.Namespace, repeat: int) -> dict:
    """The plain loop in one process on every core, then split over one process per core."""
    cores = os.cpu_count() or 1

    def loops(count: int, steps: int, threads: int) -> float:
        """The slowest of ``count`` loops started together (their own timing: imports aside)."""
        procs = [subprocess.Popen([sys.executable, "-c", PLAIN_LOOP, str(steps), str(threads)],
                                  cwd=ROOT, stdout=subprocess.PIPE, text=True)
                 for _ in range(count)]
        return max(float(proc.communicate()[0]) for proc in procs)

    one = loops(1, args.ceiling_steps, cores)
    split = loops(cores, args.ceiling_steps // cores, 1)
    return {"engine": "ceiling", "repeat": repeat, "cores": cores, "steps": args.ceiling_steps,
            "one-process-s": one, "split-s": split, "ratio": split / one}


def same_metrics(cells: list[dict]) -> list[str]:
    """Each run's metrics against the first run with the same method and torch threads per
    client (another engine, or the same engine's earlier repeat)."""
    lines = []
    first: dict[tuple, dict] = {}
    for cell in (c for c in cells if "results" in c):
        a = first.setdefault((cell["method"], cell["threads"]), cell)
        if a is cell:
            continue
        differences, checked = compare(json.loads(Path(a["results"]).read_text()),
                                       json.loads(Path(cell["results"]).read_text()))
        verdict = "identical" if not differences else f"{len(differences)} differ"
        lines.append(f"{cell['method']}: {a['engine']} (repeat {a['repeat']}) vs {cell['engine']} "
                     f"(repeat {cell['repeat']}), {cell['threads']} thread(s) per client: "
                     f"{checked} values, {verdict}")
    return lines


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def table(cells: list[dict], engines: list[str]) -> str:
    """s/round per method and engine over every round of every repeat; ratio: this engine's
    mean over the first engine's, and with repeats the range of that ratio within a repeat."""
    head = (f"{'method':<8}{'engine':<11}{'runs':>5}{'s/round (min-max)':>20}{'mean':>8}"
            f"{'ratio':>8}{'within a repeat':>18}")
    lines = [head, "-" * len(head)]
    for method in dict.fromkeys(c["method"] for c in cells):
        ok = [c for c in cells if c["method"] == method and "error" not in c]
        for c in cells:
            if c["method"] == method and "error" in c:
                lines.append(f"{method:<8}{c['engine']:<11}  repeat {c['repeat']}: "
                             f"{c['error'].strip().splitlines()[-1]}")
        by_repeat = {(c["engine"], c["repeat"]): mean(c["seconds"]) for c in ok}
        base_engine = next((e for e in engines if any(c["engine"] == e for c in ok)), None)
        for engine in engines:
            runs = [c for c in ok if c["engine"] == engine]
            if not runs:
                continue
            seconds = [s for c in runs for s in c["seconds"]]
            ratio = mean(seconds) / mean([s for c in ok if c["engine"] == base_engine
                                          for s in c["seconds"]])
            paired = [by_repeat[(engine, c["repeat"])] / by_repeat[(base_engine, c["repeat"])]
                      for c in runs if (base_engine, c["repeat"]) in by_repeat]
            spread = (f"{min(paired):.2f}-{max(paired):.2f}x" if len(paired) > 1 else "")
            span = f"{min(seconds):.1f}-{max(seconds):.1f}"
            lines.append(f"{method:<8}{engine:<11}{len(runs):>5}{span:>20}{mean(seconds):>8.2f}"
                         f"{ratio:>7.2f}x{spread:>18}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="batched:2,batched,flower")
    parser.add_argument("--methods", default="fedavg,ditto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the sequence of engines this many times, in turn")
    parser.add_argument("--ceiling", action="store_true",
                        help="measure the machine's ceiling before each repeat (see above)")
    parser.add_argument("--ceiling-steps", type=int, default=2000)
    parser.add_argument("--pfllib", help="a prepared PFLlib checkout (see above)")
    parser.add_argument("--pfllib-python", default=sys.executable)
    parser.add_argument("--out", default=str(ROOT / "results" / "benchmark-pfllib"))
    args = parser.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    for spec in engines:
        engine_settings(spec, os.cpu_count() or 1)  # an unknown engine stops here
    methods = [m for m in args.methods.split(",") if m]
    if args.pfllib and any(m not in PFLLIB_NAMES for m in methods):
        parser.error(f"--pfllib runs {', '.join(PFLLIB_NAMES)} only")
    if args.pfllib and not (Path(args.pfllib) / "dataset" / "FashionMNIST" / "train").is_dir():
        parser.error(f"{args.pfllib}/dataset/FashionMNIST/train does not exist: run PFLlib's "
                     "generator first (cd dataset && python generate_FashionMNIST.py noniid - dir)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = []
    order = [*engines, *(["pfllib"] if args.pfllib else [])]
    ceilings = []
    for method in methods:
        turns = [(r, order[(r + i) % len(order)]) for r in range(args.repeats)
                 for i in range(len(order))]
        for turn, (repeat, spec) in enumerate(turns):
            if args.ceiling and turn % len(order) == 0:
                ceilings.append(run_ceiling(args, repeat))
                c = ceilings[-1]
                print(f"ceiling (repeat {repeat}): {c['steps']} steps of the plain loop, one "
                      f"process {c['one-process-s']:.1f} s, {c['cores']} processes "
                      f"{c['split-s']:.1f} s: {c['ratio']:.2f}x", flush=True)
            print(f"{method} on {spec} (repeat {repeat}) ...", end=" ", flush=True)
            cell = (run_pfllib(method, args, out, repeat) if spec == "pfllib"
                    else run_engine(spec, method, args, out, repeat))
            cells.append(cell)
            print(cell.get("error", "").splitlines()[-1:] or
                  f"{cell['wall-s']:.0f} s, s/round " + ", ".join(f"{s:.1f}" for s in
                                                                  cell["seconds"]), flush=True)
            (out / "pfllib.json").write_text(json.dumps(
                {"argv": sys.argv[1:], "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                 "cells": cells, "ceilings": ceilings}, indent=1))
    text = table(cells, order) + "\n\n" + "\n".join(same_metrics(cells))
    if ceilings:
        ratios = [c["ratio"] for c in ceilings]
        text += (f"\n\nceiling: the plain loop split over {ceilings[0]['cores']} processes takes "
                 f"{min(ratios):.2f}-{max(ratios):.2f}x (mean {mean(ratios):.2f}x) the time of one "
                 f"process on every core ({len(ratios)} measurements)")
    print("\n" + text)
    (out / "pfllib.md").write_text("```\n" + text + "\n```\n")
    print(f"\nWritten to {out / 'pfllib.json'} and {out / 'pfllib.md'}")


if __name__ == "__main__":
    main()
