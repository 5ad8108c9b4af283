#!/usr/bin/env python
"""How much does the Flower/Ray simulation cost over a plain PyTorch loop doing the same work?

(a) FedAvg through the real simulation (the Flower engine: Flower's simulation engine, Ray actors,
    Messages), and (b) the same method on the sequential engine (``engine = sequential``): the
    same clients, local steps and seeds called one after another in this process, with torch using
    all the cores (``--threads``, default: all).
Both run on the default config (``--config``/``--set`` as in simulate.py); evaluation is left
out of the timing (training rounds only: local training, transfer and aggregation). Round 1 is
warm-up (data loading in the workers) and is reported but not averaged.

    python benchmarks/overhead.py                 # default config, 4 rounds
    python benchmarks/overhead.py --rounds 3 --set fraction-train=1.0
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pflalign.outputs.results import Reporter  # noqa: E402
from pflalign.run.config import resolve  # noqa: E402
from pflalign.run.driver import simulate as simulate_run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.toml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads for the sequential engine (default: every core)")
    args = parser.parse_args()
    settings = resolve(args.config, args.overrides, {
        "methods": "fedavg", "rounds": args.rounds, "eval-every": args.rounds,
        "out-dir": str(ROOT / "results" / "benchmark-overhead")})

    print(f"(a) Flower simulation on Ray: {settings.run.num_clients} clients, "
          f"fraction-train {settings.run.fraction_train}, {args.rounds} rounds", flush=True)
    results = simulate_run(settings, Reporter())
    rows = results["methods"]["fedavg"]["rounds"]
    sim_seconds = [r["train-seconds"] for r in rows]
    sim_losses = [r["train-loss"] for r in rows]
    workers = max(1, int((os.cpu_count() or 1) // settings.run.client_resources_num_cpus))
    packing = [r["train-seconds"] / (r["client-seconds"] / workers) for r in rows[1:]]

    print(f"(b) the sequential engine, {args.threads} torch thread(s)", flush=True)
    sequential = simulate_run(settings.replace({
        "engine": "sequential", "client-resources-num-cpus": args.threads,
        "out-dir": str(ROOT / "results" / "benchmark-overhead" / "sequential")}), Reporter())
    plain_rows = sequential["methods"]["fedavg"]["rounds"]
    plain_seconds = [r["train-seconds"] for r in plain_rows]
    plain_losses = [r["train-loss"] for r in plain_rows]

    sim, plain = float(np.mean(sim_seconds[1:])), float(np.mean(plain_seconds[1:]))
    print("\nseconds per training round (rounds 2.., round 1 is warm-up):")
    print(f"  simulation  {sim:7.2f}s   (round 1: {sim_seconds[0]:.2f}s)")
    print(f"  sequential  {plain:7.2f}s   (round 1: {plain_seconds[0]:.2f}s)")
    print(f"  ratio simulation / sequential = {sim / plain:.2f}  (goal: <= 1.2)")
    print(f"  simulation round time / (summed client compute / {workers} workers) = "
          f"{np.mean(packing):.2f}  (1.00 = no engine overhead, no idle worker)")
    gap = max(abs(a - b) for a, b in zip(sim_losses, plain_losses, strict=True))
    print(f"  same computation: max |train-loss difference| over rounds = {gap:.2e}")


if __name__ == "__main__":
    main()
