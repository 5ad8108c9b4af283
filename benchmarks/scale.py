#!/usr/bin/env python
"""Scale: clients/s, s/round, evaluation time and peak memory of each engine, at 20, 100 and 1,000
clients, for fedavg and pflalign.

Every cell is its own ``python simulate.py`` process (a fresh interpreter, a fresh Ray), on the
embedded Fashion-MNIST with Dirichlet(0.1) label skew and the default model:

=========  =================  ======================
clients    fraction-train     clients per round
=========  =================  ======================
20         0.4                8 (the default config)
100        0.2                20
1,000      0.05               50
10,000     0.01               100
=========  =================  ======================

``--rounds`` training rounds (default 3), then one evaluation of every client at the last round.
Measured, per cell:

- **clients/s**: clients trained per second of training rounds (``train-seconds``, round 1
  included: it is part of what a user waits for), and **s/round** (training rounds);
- **eval s**: the evaluations (``eval-seconds``), and **final eval s**: the last one, of every
  client (with ``--set eval-every=1 --set eval-fraction=0.05`` the earlier rounds evaluate a
  seeded 5% sample);
- **peak RSS**: the peak over the run of the summed resident memory of the process and all its
  descendants (Ray's GCS, raylet and workers), sampled every 0.2 s from /proc;
- **disk**: the peak over the run of the bytes under the cell's output folder (client state
  spilled beyond ``memory-budget-gb``, the batched workers' spill folders, checkpoints), and of
  the spilled client state alone, sampled every second;
- **GPU peak**: ``torch.cuda.max_memory_allocated`` of the in-process engines, and for the
  Flower engine the peak of ``nvidia-smi``'s used memory over the run (when a GPU is used);
- **same metrics**: whether the cell's per-round losses and accuracies equal the sequential
  engine's bit for bit (``=``), or agree to within 1e-3 relative (``~``).

The in-process engines (sequential, batched) get every core as torch threads
(``client-resources-num-cpus``); the Flower engine runs one client per core; ``batched:N`` is the
batched engine on N Ray workers (``batched-workers = N``), each with its share of the cores.
With ``--gpu`` every engine trains on the GPU (``client-resources-num-gpus``: ``--gpu-share``
per Flower client, 1 for the in-process engines, 1/N for each of N batched workers). Without Ray
(``NO_RAY=1``) the Flower engine is skipped.

    python benchmarks/scale.py                               # everything on the CPU
    python benchmarks/scale.py --clients 100 --engines flower,batched
    python benchmarks/scale.py --clients 1000 --methods pflalign --rounds 5 \
        --engines batched,batched:2,flower
    python benchmarks/scale.py --gpu --gpu-share 0.25        # on a GPU machine
    python benchmarks/scale.py --dataset synthetic --clients 1000,100000,1000000 \
        --methods pflalign --rounds 5 --engines batched,batched:2

``--dataset synthetic`` runs Synthetic(1, 1) (generated per client, so a round's cost should not
grow with the federation) with ``model = mlp`` and 100 clients a round at any number of clients,
each for 5 local steps, on lognormal device profiles with diurnal availability (a round draws
among the clients reachable when it starts), and the final evaluation of ``eval-clients``'s
default (every client up to 10,000, a seeded sample of 10,000 above), with ``save-models =
none`` (the default ``final`` would write each evaluated client's personal model: 2.2 GB for
10,000 of the MLP's). The lines after the table give each engine's seconds a round (round 1
left out: it warms up) and peak memory against its smallest size, then the output files' sizes
and the seconds to open results.json and to write report.md with its plots from it.

The table is printed and written, with every cell's numbers, to ``--out``
(``results/benchmark-scale/scale.json`` and ``scale.md``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FRACTION = {20: 0.4, 100: 0.2, 1000: 0.05, 10000: 0.01}
#: --dataset synthetic: clients trained a round, whatever the federation's size, each for the
#: same number of local steps (the clients' power-law sizes would otherwise make a round's work
#: depend on which clients it samples)
SYNTHETIC_PER_ROUND, SYNTHETIC_STEPS = 100, 5
#: spilled client state lives in folders named so (pflalign/engines/store.py)
SPILL_PREFIX = ".client-state-"
#: a child process reports its torch GPU peak here (in-process engines)
GPU_PEAK_FILE = "gpu-peak.json"


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def tree_rss(pid: int) -> int:
    """Summed resident bytes of ``pid`` and its descendants now."""
    tree, total, todo = _children(), 0, [pid]
    while todo:
        current = todo.pop()
        todo.extend(tree.get(current, []))
        try:
            with open(f"/proc/{current}/status") as handle:
                for line in handle:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
    return total


def gpu_used_bytes() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,"
                              "nounits"], capture_output=True, text=True, timeout=5, check=True)
        return int(out.stdout.split()[0]) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def disk_bytes(folder: Path) -> tuple[int, int]:
    """Bytes of the files under ``folder`` now: all of them, and those in spill folders."""
    total = spilled = 0
    for root, _, files in os.walk(folder):
        size = 0
        for name in files:
            try:
                size += os.stat(os.path.join(root, name)).st_size
            except OSError:  # removed while we looked
                continue
        total += size
        if SPILL_PREFIX in root:
            spilled += size
    return total, spilled


class Sampler(threading.Thread):
    """Samples a process tree's summed RSS (and the GPU's used memory, and the bytes under a
    folder) until stopped."""

    def __init__(self, pid: int, gpu: bool, folder: Path | None = None):
        super().__init__(daemon=True)
        self.pid, self.gpu, self.folder = pid, gpu, folder
        self.peak_rss, self.peak_gpu = 0, None
        self.peak_disk = self.peak_spilled = 0
        self.stop = threading.Event()

    def run(self) -> None:
        base = gpu_used_bytes() if self.gpu else None
        last_disk = 0.0
        while not self.stop.is_set():
            self.peak_rss = max(self.peak_rss, tree_rss(self.pid))
            if self.folder is not None and time.monotonic() - last_disk >= 1.0:
                total, spilled = disk_bytes(self.folder)
                self.peak_disk = max(self.peak_disk, total)
                self.peak_spilled = max(self.peak_spilled, spilled)
                last_disk = time.monotonic()
            if base is not None:
                used = gpu_used_bytes()
                if used is not None:
                    self.peak_gpu = max(self.peak_gpu or 0, used - base)
            self.stop.wait(0.2)


#: run inside the child, around simulate.py's main: records the torch GPU peak
CHILD = """
import json, runpy, sys, torch
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as stop:
    code = stop.code
else:
    code = 0
if torch.cuda.is_available():
    with open({peak!r}, "w") as handle:
        json.dump({{"gpu-peak": torch.cuda.max_memory_allocated()}}, handle)
sys.exit(code)
"""


def engine_settings(spec: str, cpus: int) -> dict[str, object]:
    """The settings of an engine spec: ``sequential``, ``batched``, ``flower``, or
    ``batched:N`` (the batched engine on N Ray workers, cpus // N cores each)."""
    name, _, workers = spec.partition(":")
    if name not in ("sequential", "batched", "flower") or (workers and name != "batched"):
        raise SystemExit(f"unknown engine '{spec}': sequential, batched, batched:N or flower")
    if workers:
        if not workers.isdigit() or int(workers) < 1:
            raise SystemExit(f"'{spec}': batched:N takes a whole number of workers N >= 1")
        n = int(workers)
        return {"engine": "batched", "batched-workers": n,
                "client-resources-num-cpus": max(1, cpus // n)}
    return {"engine": name, "client-resources-num-cpus": 1 if name == "flower" else cpus}


def run_cell(engine: str, clients: int, method: str, args: argparse.Namespace,
             out: Path) -> dict:
    cell = out / f"{engine.replace(':', 'x')}-{clients}-{method}"
    cell.mkdir(parents=True, exist_ok=True)
    cpus = os.cpu_count() or 1
    data = ({"dataset": "synthetic", "partition": "natural", "model": "mlp",
             "fraction-train": min(1.0, SYNTHETIC_PER_ROUND / clients),
             "local-steps": SYNTHETIC_STEPS, "device-profiles": "lognormal",
             "availability": "diurnal", "save-models": "none"}
            if args.dataset == "synthetic" else
            {"fraction-train": FRACTION[clients], "partition": "dirichlet",
             "dirichlet-alpha": 0.1})
    settings = {
        "methods": method, **engine_settings(engine, cpus), "num-clients": clients, **data,
        "rounds": args.rounds, "eval-every": args.rounds, "out-dir": str(cell),
        "client-resources-num-gpus": (args.gpu_share if engine == "flower" else
                                      1 / int(engine.partition(":")[2] or 1)) if args.gpu else 0,
        **dict(item.split("=", 1) for item in args.set)}
    command = [sys.executable, "-c", CHILD.format(peak=str(cell / GPU_PEAK_FILE)),
               str(ROOT / "simulate.py"), "--overwrite", "--quiet"]
    for key, value in settings.items():
        command += ["--set", f"{key}={value}"]
    (cell / GPU_PEAK_FILE).unlink(missing_ok=True)
    started = time.perf_counter()
    with open(cell / "log.txt", "w") as log:
        child = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        sampler = Sampler(child.pid, args.gpu, cell)
        sampler.start()
        code = child.wait()
        sampler.stop.set()
        sampler.join()
    wall = time.perf_counter() - started
    if code != 0:
        tail = (cell / "log.txt").read_text().strip().splitlines()[-3:]
        return {"engine": engine, "clients": clients, "method": method,
                "error": f"exit {code}: " + " | ".join(tail)}
    opened = time.perf_counter()
    results = json.loads((cell / "results.json").read_text())
    load_s = time.perf_counter() - opened
    sys.path.insert(0, str(ROOT))
    from pflalign.outputs.report import write_report

    started_report = time.perf_counter()
    write_report(cell / "report-again", results)  # report.md and its plots, from results.json
    report_s = time.perf_counter() - started_report
    files = {name: (cell / name).stat().st_size / 1e6
             for name in ("results.json", "results.csv", "partition.json.gz")
             if (cell / name).exists()}
    rows = results["methods"][method]["rounds"]
    train_seconds = sum(r["train-seconds"] for r in rows)
    trained = sum(r["clients-trained"] for r in rows)
    gpu = sampler.peak_gpu
    if (cell / GPU_PEAK_FILE).exists():
        gpu = json.loads((cell / GPU_PEAK_FILE).read_text())["gpu-peak"]
    return {"engine": engine, "clients": clients, "method": method, "rounds": len(rows),
            "threads": int(settings["client-resources-num-cpus"]),
            "trained": trained, "clients-per-s": trained / train_seconds,
            "s-per-round": train_seconds / len(rows),
            "s-per-round-after-first": (sum(r["train-seconds"] for r in rows[1:])
                                        / max(len(rows) - 1, 1)),
            "eval-s": sum(r.get("eval-seconds", 0.0) for r in rows),
            "final-eval-s": rows[-1].get("eval-seconds"),
            "evaluated": [r.get("evaluated") for r in rows if "evaluated" in r],
            "peak-disk-gb": sampler.peak_disk / 1e9,
            "peak-spilled-gb": sampler.peak_spilled / 1e9,
            "results-load-s": load_s, "report-s": report_s, "files-mb": files,
            "final": {k: v for k, v in results["methods"][method]["final"].items()
                      if k.startswith(("personal-acc", "eval"))},
            "peak-rss-gb": sampler.peak_rss / 1e9, "gpu-peak-gb": None if gpu is None
            else gpu / 1e9, "wall-s": wall,
            "personal-acc": results["methods"][method]["final"].get("personal-acc"),
            "metrics": [{k: r[k] for k in ("train-loss", "personal-acc", "global-acc")
                         if k in r} for r in rows]}


def same(a: list[dict], b: list[dict]) -> str:
    if a == b:
        return "="
    for x, y in zip(a, b, strict=True):
        for k in x:
            if abs(x[k] - y[k]) > 1e-3 * max(abs(x[k]), 1e-9):
                return "differ"
    return "~"


def reference_for(cell: dict, cells: list[dict]) -> tuple[str, list[dict]] | None:
    """The cell whose metrics ``cell``'s should equal: another engine's at the same clients,
    method and torch threads per client (the sequential engine's first, then Flower's)."""
    rank = {"sequential": 0, "flower": 1}
    others = [o for o in cells if o is not cell and "error" not in o
              and (o["clients"], o["method"], o.get("threads")) == (
                  cell["clients"], cell["method"], cell.get("threads"))]
    others.sort(key=lambda o: rank.get(o["engine"], 2))
    return (others[0]["engine"], others[0]["metrics"]) if others else None


def table(cells: list[dict]) -> str:
    head = (f"{'engine':<11}{'clients':>8}  {'method':<9}{'clients/s':>10}{'s/round':>9}"
            f"{'eval s':>8}{'final eval':>11}{'peak RSS GB':>13}{'disk GB':>9}{'GPU GB':>8}"
            f"{'personal':>10}  same as")
    lines = [head, "-" * (len(head) + 12)]
    for c in cells:
        if "error" in c:
            lines.append(f"{c['engine']:<11}{c['clients']:>8}  {c['method']:<9}  {c['error']}")
            continue
        ref = reference_for(c, cells)
        gpu = "-" if c["gpu-peak-gb"] is None else f"{c['gpu-peak-gb']:.2f}"
        final = c.get("final-eval-s")
        same_as = f"{same(ref[1], c['metrics'])} {ref[0]}" if ref else "-"
        lines.append(
            f"{c['engine']:<11}{c['clients']:>8}  {c['method']:<9}{c['clients-per-s']:>10.2f}"
            f"{c['s-per-round']:>9.2f}{c['eval-s']:>8.2f}"
            f"{'-' if final is None else f'{final:.2f}':>11}{c['peak-rss-gb']:>13.2f}"
            f"{c.get('peak-disk-gb', 0):>9.2f}{gpu:>8}{100 * c['personal-acc']:>9.2f}%"
            f"  {same_as}")
    return "\n".join(lines)


def ratios(cells: list[dict]) -> list[str]:
    """The batched engine (in one process, or on N workers) against the other engines, per
    (clients, method)."""
    by = {(c["engine"], c["clients"], c["method"]): c for c in cells if "error" not in c}
    out = []
    for (engine, clients, method), c in sorted(by.items()):
        if not engine.startswith("batched"):
            continue
        others = ["batched"] if engine != "batched" else []
        for other in (*others, "flower", "sequential"):
            o = by.get((other, clients, method))
            if o:
                out.append(f"{clients:>5} clients {method:<9} {engine} / {other:<10} clients/s "
                           f"{c['clients-per-s'] / o['clients-per-s']:5.2f}x   eval "
                           f"{o['eval-s'] / max(c['eval-s'], 1e-9):5.2f}x faster   peak RSS "
                           f"{c['peak-rss-gb']:.2f} vs {o['peak-rss-gb']:.2f} GB")
    return out


def growth(cells: list[dict]) -> list[str]:
    """Per engine and method: seconds a training round (round 1, which warms up, left out) and
    the peak memory at each size, against the smallest size's."""
    out = []
    keys = sorted({(c["engine"], c["method"]) for c in cells if "error" not in c})
    for engine, method in keys:
        mine = sorted((c for c in cells if "error" not in c and c["engine"] == engine
                       and c["method"] == method), key=lambda c: c["clients"])
        base = mine[0]
        for c in mine:
            out.append(f"{engine:<10} {method:<9} {c['clients']:>7} clients: "
                       f"{c['s-per-round-after-first']:.3f} s a round after the first "
                       f"({c['s-per-round-after-first'] / base['s-per-round-after-first']:.2f}x "
                       f"{base['clients']}), peak RSS {c['peak-rss-gb']:.2f} GB")
    return out


def outputs(cells: list[dict]) -> list[str]:
    """Per cell: the output files' sizes, the seconds to open results.json and to write
    report.md with its plots from it, and the final evaluation (a sample's interval)."""
    out = []
    for c in cells:
        if "error" in c or "files-mb" not in c:
            continue
        final = c.get("final", {})
        sample = (f"; evaluated {final.get('evaluated')} of {final['eval-population']}, "
                  f"personal-acc 95% interval [{100 * final['personal-acc-ci-low']:.2f}, "
                  f"{100 * final['personal-acc-ci-high']:.2f}]%"
                  if final.get("eval-population") else "")
        out.append(f"{c['engine']:<10} {c['clients']:>7} clients: " + ", ".join(
            f"{name} {mb:.2f} MB" for name, mb in c["files-mb"].items())
            + f"; results.json opens in {c['results-load-s']:.2f} s, report.md and plots in "
              f"{c['report-s']:.1f} s" + sample)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="flower,sequential,batched")
    parser.add_argument("--clients", default="20,100,1000")
    parser.add_argument("--methods", default="fedavg,pflalign")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dataset", choices=("fashion-mnist", "synthetic"),
                        default="fashion-mnist",
                        help="synthetic: Synthetic(1, 1) with model mlp, "
                             f"{SYNTHETIC_PER_ROUND} clients a round at any --clients")
    parser.add_argument("--gpu", action="store_true", help="train on the GPU")
    parser.add_argument("--gpu-share", type=float, default=0.25,
                        help="client-resources-num-gpus of each Flower client with --gpu")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a further config override for every cell")
    parser.add_argument("--out", default=str(ROOT / "results" / "benchmark-scale"))
    args = parser.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    if "flower" in engines and (os.environ.get("NO_RAY") == "1"
                                or importlib.util.find_spec("ray") is None):
        print("Ray is not available here: the flower engine is skipped.", flush=True)
        engines.remove("flower")
    sizes = [int(n) for n in args.clients.split(",")]
    if args.dataset != "synthetic" and any(n not in FRACTION for n in sizes):
        parser.error(f"--clients takes {', '.join(map(str, FRACTION))}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = []
    total = len(engines) * len(sizes) * len(args.methods.split(","))
    for spec in engines:
        engine_settings(spec, os.cpu_count() or 1)  # an unknown engine stops here, not later
    for clients in sizes:
        for method in args.methods.split(","):
            for engine in ["sequential", *[e for e in engines if e != "sequential"]] \
                    if "sequential" in engines else engines:
                print(f"[{len(cells) + 1}/{total}] {engine}, {clients} clients, {method} ...",
                      end=" ", flush=True)
                cell = run_cell(engine, clients, method, args, out)
                cells.append(cell)
                print(cell.get("error") or f"{cell['wall-s']:.0f} s, {cell['clients-per-s']:.2f} "
                      f"clients/s, peak RSS {cell['peak-rss-gb']:.2f} GB", flush=True)
                (out / "scale.json").write_text(json.dumps(
                    {"argv": sys.argv[1:], "cpus": os.cpu_count(), "cells": cells}, indent=1))
    text = (table(cells) + "\n\n" + "\n".join(ratios(cells)) + "\n\n"
            + "\n".join(growth(cells)) + "\n\n" + "\n".join(outputs(cells)))
    print("\n" + text)
    (out / "scale.md").write_text("```\n" + text + "\n```\n")
    print(f"\nWritten to {out / 'scale.json'} and {out / 'scale.md'}")


if __name__ == "__main__":
    main()
