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

Printed and written to ``--out`` (``pfllib.json``, ``pfllib.md``): s/round as min-max and mean
over the rounds, each engine's ratio to the first engine listed, and whether two engines with the
same torch threads per client gave the same metrics bit for bit.

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


def run_engine(spec: str, method: str, args: argparse.Namespace, out: Path) -> dict:
    cell = out / f"{spec.replace(':', 'x')}-{method}"
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
        return {"engine": spec, "method": method, "error": (done.stderr or done.stdout)[-500:]}
    results = json.loads((cell / "results.json").read_text())
    rows = results["methods"][method]["rounds"]
    return {"engine": spec, "method": method, "threads": settings["client-resources-num-cpus"],
            "seconds": [r["round-seconds"] for r in rows], "wall-s": wall,
            "personal-acc": results["methods"][method]["final"]["personal-acc"],
            "results": str(cell / "results.json")}


def run_pfllib(method: str, args: argparse.Namespace, out: Path) -> dict:
    system = Path(args.pfllib) / "system"
    cpus = str(os.cpu_count() or 1)
    command = [args.pfllib_python, "main.py", "-data", "FashionMNIST", "-m", "CNN", "-algo",
               PFLLIB_NAMES[method], "-gr", str(args.rounds - 1), "-did", "0", "-dev", "cpu",
               "-lbs", "10", "-lr", "0.005", "-nc", "20", "-jr", "1", "-ls", "1", "-eg", "1"]
    env = dict(os.environ, OMP_NUM_THREADS=cpus, MKL_NUM_THREADS=cpus)
    started = time.perf_counter()
    done = subprocess.run(command, cwd=system, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    (out / f"pfllib-{method}.log").write_text(done.stdout + done.stderr)
    seconds = [float(m) for m in re.findall(r"time cost -+ ([0-9.]+)", done.stdout)]
    if done.returncode != 0 or not seconds:
        return {"engine": "pfllib", "method": method,
                "error": f"exit {done.returncode}: " + (done.stderr or done.stdout)[-500:]}
    return {"engine": "pfllib", "method": method, "seconds": seconds, "wall-s": wall}


def same_metrics(cells: list[dict]) -> list[str]:
    """Pairs of engines with one torch thread count per client: their metrics compared."""
    lines = []
    ours = [c for c in cells if "results" in c]
    for i, a in enumerate(ours):
        for b in ours[i + 1:]:
            if (a["method"], a["threads"]) == (b["method"], b["threads"]):
                differences, checked = compare(json.loads(Path(a["results"]).read_text()),
                                               json.loads(Path(b["results"]).read_text()))
                verdict = "identical" if not differences else f"{len(differences)} differ"
                lines.append(f"{a['method']}: {a['engine']} vs {b['engine']} ({a['threads']} "
                             f"thread(s) per client): {checked} values, {verdict}")
    return lines


def table(cells: list[dict]) -> str:
    head = f"{'method':<8}{'engine':<11}{'s/round (min-max)':>20}{'mean':>8}{'ratio':>8}"
    lines = [head, "-" * len(head)]
    first: dict[str, float] = {}
    for c in cells:
        if "error" in c:
            lines.append(f"{c['method']:<8}{c['engine']:<11}  {c['error'].splitlines()[-1]}")
            continue
        mean = sum(c["seconds"]) / len(c["seconds"])
        base = first.setdefault(c["method"], mean)
        span = f"{min(c['seconds']):.1f}-{max(c['seconds']):.1f}"
        lines.append(f"{c['method']:<8}{c['engine']:<11}{span:>20}{mean:>8.2f}"
                     f"{mean / base:>7.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="batched:2,batched,flower")
    parser.add_argument("--methods", default="fedavg,ditto")
    parser.add_argument("--rounds", type=int, default=3)
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
    for method in methods:
        for spec in [*engines, *(["pfllib"] if args.pfllib else [])]:
            print(f"{method} on {spec} ...", end=" ", flush=True)
            cell = (run_pfllib(method, args, out) if spec == "pfllib"
                    else run_engine(spec, method, args, out))
            cells.append(cell)
            print(cell.get("error", "").splitlines()[-1:] or
                  f"{cell['wall-s']:.0f} s, s/round " + ", ".join(f"{s:.1f}" for s in
                                                                  cell["seconds"]), flush=True)
            (out / "pfllib.json").write_text(json.dumps(
                {"argv": sys.argv[1:], "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                 "cells": cells}, indent=1))
    text = table(cells) + "\n\n" + "\n".join(same_metrics(cells))
    print("\n" + text)
    (out / "pfllib.md").write_text("```\n" + text + "\n```\n")
    print(f"\nWritten to {out / 'pfllib.json'} and {out / 'pfllib.md'}")


if __name__ == "__main__":
    main()
