#!/usr/bin/env python
"""The methods this project shares with PFLlib, side by side on PFLlib's own Fashion-MNIST clients.

Each cell is one (side, method, seed): this project's ``simulate.py`` (``--side ours``) or
PFLlib's own ``system/main.py`` (``--side pfllib``, given a fetched checkout with ``--pfllib``),
on the same 20 clients (:mod:`pflalign.data.pfllib`, byte for byte PFLlib's), with PFLlib's
setting: its CNN, batch 10, one local epoch, SGD lr 0.005, every client every round, and each
method's hyperparameters as PFLlib's command line sets them by default (:data:`SHARED`). The
accuracy is PFLlib's: all clients' correct test predictions over all their test samples (this
project's ``personal-acc``, or the metric :data:`SHARED` names), after 10 and 25 aggregations
(and 50, for the methods run longer with ``--rounds 50``).

A finished cell is a small JSON file in ``--cells`` (default
``docs/experiments/reproduce-pfllib/cells``, kept in git), so the table is built over several
sessions and read back whole; a run's own outputs go to ``--work``. ``--report`` writes
``table.md`` beside the cells: per method and round, each side's mean with its 95% t-interval
over its runs, and the difference with its Welch interval (the runs of the two sides share no
randomness to pair: PFLlib seeds only torch, with 0, and draws its clients' order unseeded).

    python -m pflalign.data.pfllib data/pfllib-fashion-mnist.npz        # the clients (seconds)
    python benchmarks/reproduce_pfllib.py --side ours --jobs 2           # this project's cells
    python benchmarks/reproduce_pfllib.py --side pfllib --pfllib /tmp/pfllib \\
        --pfllib-path /tmp/pfl-extra --jobs 2                            # PFLlib's cells
    python benchmarks/reproduce_pfllib.py --report                       # table.md

PFLlib's side needs, beside this project's environment, ``h5py`` and ``calmsize`` on
``--pfllib-path`` (``pip install --no-deps --target /tmp/pfl-extra h5py calmsize``); its
``main.py`` imports ``cvxpy`` for FedPAC alone, so a module of that name that is empty is put
on its path. Its data files are written from the same clients into the checkout's
``dataset/FashionMNIST``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pflalign.outputs.results import source_commit  # noqa: E402
from pflalign.outputs.stats import mean_ci, t_critical  # noqa: E402

#: method -> (this project's entry at PFLlib's command-line defaults, PFLlib's ``-algo`` and its
#: extra flags, the metric of ours that PFLlib's printed accuracy is). Read from PFLlib at
#: d832e76 (system/main.py's argparse defaults; docs/experiments/reproduce-pfllib.md gives the
#: lines and every difference no key removes)
SHARED: dict[str, tuple[str, list[str], str]] = {
    "fedavg": ("fedavg", ["FedAvg"], "personal-acc"),
    "fedprox": ("fedprox(fedprox-mu=0.0)", ["FedProx"], "personal-acc"),
    "scaffold": ("scaffold(scaffold-server-lr=1.0)", ["SCAFFOLD"], "personal-acc"),
    "ditto": ("ditto(ditto-lambda=0.0,ditto-personal-epochs=1)", ["Ditto"], "personal-acc"),
    "fedper": ("fedper(head-layers=1)", ["FedPer"], "personal-acc"),
    "fedrep": ("fedrep(head-layers=1,fedrep-head-epochs=1)", ["FedRep"], "personal-acc"),
    "fedbn": ("fedbn", ["FedBN"], "personal-acc"),
    "apfl": ("apfl(apfl-alpha=1.0,apfl-alpha-lr=0.005,apfl-adaptive=true)", ["APFL"],
             "personal-acc"),
    "perfedavg": ("perfedavg(perfedavg-alpha=0.005,perfedavg-beta=0.005,perfedavg-eval-steps=1,"
                  "local-epochs=2)", ["PerAvg"], "personal-acc"),
    # PFLlib's -bt 0 keeps its global model at the initialisation; both sides mix with 1
    "pfedme": ("pfedme(pfedme-lambda=1.0,pfedme-k=5,pfedme-personal-lr=0.01,pfedme-beta=1.0)",
               ["pFedMe", "-bt", "1"], "global-acc"),
    "fedala": ("fedala(fedala-eta=1.0,fedala-rand-percent=80,fedala-layers=1)", ["FedALA"],
               "personal-acc"),
    "feddyn": ("feddyn(feddyn-alpha=1.0)", ["FedDyn"], "personal-acc"),
    "fedcp": ("fedcp(fedcp-lambda=1.0)", ["FedCP"], "personal-acc"),
    "gpfl": ("gpfl(gpfl-lambda=1.0,gpfl-mu=0.0)", ["GPFL"], "personal-acc"),
    "feddbe": ("feddbe(feddbe-kappa=0.0,feddbe-momentum=0.1)", ["FedDBE"], "personal-acc"),
}
#: PFLlib's setting, on both sides
SETTING = {"lr": 0.005, "batch-size": 10, "local-epochs": 1, "fraction-train": 1.0,
           "num-clients": 20, "model": "cnn"}
REPORTED_ROUNDS = (10, 25, 50)
DATA = ROOT / "data" / "pfllib-fashion-mnist.npz"


def eval_gap(rounds: int) -> int:
    """Evaluate every 5 rounds (rounds 10 and 25 among them), or every round when 5 does not
    divide the rounds."""
    return 5 if rounds % 5 == 0 else 1


def cell_path(cells: Path, side: str, method: str, seed: int, rounds: int = 25) -> Path:
    """A cell's file: ``ours/fedavg-seed-0.json``; a run of other than 25 rounds (the 50-round
    extension) names them: ``ours/fedavg-r50-seed-0.json``."""
    return cells / side / (f"{method}-seed-{seed}.json" if rounds == 25
                           else f"{method}-r{rounds}-seed-{seed}.json")


def commit() -> str:
    return source_commit() or "unknown"


def machine() -> str:
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in
                      Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{model or platform.processor()}, {os.cpu_count()} cores"


def run_ours(method: str, seed: int, args: argparse.Namespace) -> dict:
    entry, _, metric = SHARED[method]
    out = Path(args.work) / "ours" / method / f"rounds-{args.rounds}-seed-{seed}"
    sets = {**SETTING, "dataset": f"npz:{args.data}", "partition": "natural",
            "methods": entry, "rounds": args.rounds, "eval-every": eval_gap(args.rounds),
            "seed": seed,
            "save-models": "none", "engine": "batched", "report": False}
    command = [sys.executable, str(ROOT / "simulate.py"), "--quiet", "--overwrite", "--out",
               str(out)]
    for key, value in sets.items():  # each value as a TOML literal
        literal = (json.dumps(value) if isinstance(value, str)
                   else str(value).lower() if isinstance(value, bool) else str(value))
        command += ["--set", f"{key}={literal}"]
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"))
    if done.returncode != 0:
        raise RuntimeError(f"ours {method} seed {seed}: exit {done.returncode}\n"
                           + (done.stderr or done.stdout)[-2000:])
    results = json.loads((out / "results.json").read_text())
    rows = next(iter(results["methods"].values()))["rounds"]
    accuracy = {str(row["round"]): row[metric] for row in rows if row.get(metric) is not None}
    if str(args.rounds) not in accuracy:
        raise RuntimeError(f"ours {method} seed {seed}: no {metric} after round {args.rounds} "
                           f"in {out / 'results.json'}")
    return {"side": "ours", "method": method, "seed": seed, "metric": metric,
            "accuracy": accuracy, "seconds": round(time.monotonic() - started, 1),
            "command": " ".join(command[1:]), "commit": commit(), "machine": machine()}


def write_pfllib_data(checkout: Path, data: Path) -> None:
    """PFLlib's client files (``dataset/FashionMNIST/{train,test}/<id>.npz``, each a pickled
    dict of ``x`` and ``y``) from the npz data :mod:`pflalign.data.pfllib` wrote, unless the
    folder already holds them from the same data (its ``pflalign-source.json`` names the data
    file's SHA-256): any other partition there is replaced. Written into a new folder that then
    takes the old one's place, before any PFLlib process starts."""
    import hashlib
    import shutil

    target = checkout / "dataset" / "FashionMNIST"
    digest = hashlib.sha256(Path(data).read_bytes()).hexdigest()
    marker = target / "pflalign-source.json"
    if marker.exists() and json.loads(marker.read_text()).get("sha256") == digest:
        return
    fresh = target.with_name("FashionMNIST.pflalign-new")
    shutil.rmtree(fresh, ignore_errors=True)
    arrays = np.load(data)
    x, y, client, split = arrays["x"], arrays["y"], arrays["client"], arrays["split"]
    for side, code in (("train", 0), ("test", 1)):
        (fresh / side).mkdir(parents=True)
        for i in range(int(client.max()) + 1):
            rows = (client == i) & (split == code)
            with open(fresh / side / f"{i}.npz", "wb") as handle:
                np.savez_compressed(handle, data={"x": x[rows], "y": y[rows]})
    (fresh / "pflalign-source.json").write_text(json.dumps({"data": str(data), "sha256": digest}))
    shutil.rmtree(target, ignore_errors=True)
    fresh.rename(target)


def pfllib_accuracy(stdout: str, method: str) -> dict[str, float]:
    """Round -> the accuracy PFLlib printed in it (the last of the round's: Ditto prints the
    global model's, then the personal models')."""
    accuracy, current = {}, None
    for line in stdout.splitlines():
        if (found := re.search(r"Round number: (\d+)", line)) is not None:
            current = found.group(1)
        elif (found := re.match(r"Average[d]? Test Accuracy: ([0-9.]+|nan)", line.strip())) \
                and current is not None:  # a diverged run prints nan
            accuracy[current] = float(found.group(1))
    return accuracy


def run_pfllib(method: str, seed: int, args: argparse.Namespace) -> dict:
    _, (algo, *flags), _ = SHARED[method]
    checkout = Path(args.pfllib).resolve()
    stubs = Path(args.work).resolve() / "pfllib-stubs"
    stubs.mkdir(parents=True, exist_ok=True)
    (stubs / "cvxpy.py").write_text('"""Empty: PFLlib imports cvxpy for FedPAC alone."""\n')
    command = [sys.executable, "main.py", "-data", "FashionMNIST", "-m", "CNN", "-ncl", "10",
               "-algo", algo, *flags, "-gr", str(args.rounds), "-eg", str(eval_gap(args.rounds)),
               "-t", "1",
               "-go", f"seed{seed}", "-dev", "cpu", "-did", "0", "-nc", "20", "-jr", "1",
               "-lbs", "10", "-ls", "1", "-lr", "0.005"]
    path = os.pathsep.join(filter(None, [str(stubs), args.pfllib_path,
                                         os.environ.get("PYTHONPATH", "")]))
    started = time.monotonic()
    done = subprocess.run(command, cwd=checkout / "system", capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1",
                                   MKL_NUM_THREADS="1"))
    log = Path(args.work) / "pfllib" / f"{method}-seed-{seed}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(done.stdout + done.stderr)
    accuracy = pfllib_accuracy(done.stdout, method)
    if done.returncode != 0 or str(args.rounds) not in accuracy:
        raise RuntimeError(f"pfllib {method} run {seed}: exit {done.returncode}, see {log}\n"
                           + (done.stderr or done.stdout)[-2000:])
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    return {"side": "pfllib", "method": method, "seed": seed, "metric": "PFLlib's printed "
            "Averaged Test Accuracy", "accuracy": accuracy,
            "seconds": round(time.monotonic() - started, 1), "command": " ".join(command[1:]),
            "pfllib-commit": head or "unknown", "commit": commit(), "machine": machine()}


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """The mean and its 95% t-interval (:func:`mean_ci`); a diverged run's nan stays in the
    mean rather than being left out."""
    if not all(math.isfinite(v) for v in values):
        return math.nan, math.nan, math.nan
    return mean_ci(values)[:3]


def welch(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """The difference of means ``mean(a) - mean(b)`` with its 95% Welch interval."""
    diff = float(np.mean(a) - np.mean(b))
    if len(a) < 2 or len(b) < 2:
        return diff, math.nan, math.nan
    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    if va + vb == 0:  # every run of each side alike: no interval to give
        return diff, math.nan, math.nan
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = t_critical(df) * math.sqrt(va + vb)
    return diff, diff - half, diff + half


def report(cells: Path) -> str:
    found: dict[tuple[str, str], list[dict]] = {}
    for path in sorted(cells.glob("*/*.json")):
        cell = json.loads(path.read_text())
        found.setdefault((cell["side"], cell["method"]), []).append(cell)

    def pct(v: float) -> str:
        return "-" if math.isnan(v) else f"{100 * v:.2f}"

    lines = ["| method | round | ours (runs) | PFLlib (runs) | ours - PFLlib [95% Welch] |",
             "|---|---:|---|---|---|"]
    for method in SHARED:
        for rnd in REPORTED_ROUNDS:  # a 50-round cell gives round 50 (its 10 and 25 aside)
            sides = {side: [c["accuracy"][str(rnd)] for c in found.get((side, method), [])
                            if str(rnd) in c["accuracy"]
                            and (rnd > 25) == (max(map(int, c["accuracy"])) > 25)]
                     for side in ("ours", "pfllib")}
            if not any(sides.values()):
                continue
            text = []
            for side in ("ours", "pfllib"):
                if sides[side]:
                    m, lo, hi = t_interval(sides[side])
                    text.append(f"{pct(m)} [{pct(lo)}, {pct(hi)}] ({len(sides[side])})")
                else:
                    text.append("-")
            if sides["ours"] and sides["pfllib"]:
                d, lo, hi = welch(sides["ours"], sides["pfllib"])
                holds = not (lo <= 0 <= hi) and not math.isnan(lo)
                text.append(f"{100 * d:+.2f} [{100 * lo:+.2f}, {100 * hi:+.2f}]"
                            + (" **excludes 0**" if holds else ""))
            else:
                text.append("-")
            lines.append(f"| {method} | {rnd} | " + " | ".join(text) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", choices=["ours", "pfllib", "both"], default="ours")
    parser.add_argument("--methods", default=",".join(SHARED))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--cells", default=str(ROOT / "docs/experiments/reproduce-pfllib/cells"))
    parser.add_argument("--work", default=str(ROOT / "results/reproduce-pfllib"))
    parser.add_argument("--pfllib", help="a checkout of PFLlib (github.com/TsingZ0/PFLlib)")
    parser.add_argument("--pfllib-path", default="",
                        help="a folder with h5py and calmsize for PFLlib's main.py")
    parser.add_argument("--jobs", type=int, default=1, help="cells at a time (processes)")
    parser.add_argument("--report", action="store_true", help="write table.md from the cells")
    args = parser.parse_args()
    if args.rounds not in (25, 50):
        parser.error("--rounds is 25 (the table) or 50 (its extension)")
    args.data = str(Path(args.data).resolve())
    cells = Path(args.cells)
    if args.report:
        text = report(cells)
        (cells.parent / "table.md").write_text(text)
        print(text)
        return
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in SHARED]
    if unknown:
        parser.error(f"unknown methods {unknown}; the shared ones are {', '.join(SHARED)}")
    sides = ["ours", "pfllib"] if args.side == "both" else [args.side]
    if "pfllib" in sides and not args.pfllib:
        parser.error("--side pfllib needs --pfllib DIR, a checkout of PFLlib")
    if not Path(args.data).exists():
        from pflalign.data.pfllib import write_npz

        print(f"writing PFLlib's clients to {args.data}", flush=True)
        write_npz(args.data)
    todo = [(side, method, int(seed)) for seed in args.seeds.split(",") for method in methods
            for side in sides
            if not cell_path(cells, side, method, int(seed), args.rounds).exists()]
    print(f"{len(todo)} cells to run", flush=True)
    if any(side == "pfllib" for side, _, _ in todo):
        write_pfllib_data(Path(args.pfllib).resolve(), Path(args.data))

    def run(cell: tuple[str, str, int]) -> None:
        side, method, seed = cell
        print(f"[{side} {method} seed {seed}] started", flush=True)
        result = (run_ours if side == "ours" else run_pfllib)(method, seed, args)
        path = cell_path(cells, side, method, seed, args.rounds)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"[{side} {method} seed {seed}] {result['seconds']:.0f} s: "
              + ", ".join(f"round {r} {100 * a:.2f}" for r, a in result["accuracy"].items()
                          if int(r) in REPORTED_ROUNDS), flush=True)

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for future in [pool.submit(run, cell) for cell in todo]:
            future.result()


if __name__ == "__main__":
    main()
