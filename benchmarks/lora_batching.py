#!/usr/bin/env python
"""Multi-adapter batching against client by client: seconds per training round of the batched
engine with ``batched-backend = vmap`` (a cohort's LoRA adapters trained through one shared,
frozen base model, one forward pass per step, each sample with its own client's adapters) and
with ``batched-backend = loop`` (one client at a time, the sequential engine's computation), on
``configs/scenarios/language/lora-shakespeare.toml`` (SmolLM2-135M, LoRA rank 8 on q_proj and
v_proj) with a cohort of ``--clients`` roles, all training every round.

Each cell is its own ``python simulate.py`` process; the cells alternate (loop, vmap, loop, ...)
``--repeats`` times, so that the machine's drift falls on both. Measured per cell: the mean
``train-seconds`` of rounds 2.. (round 1 includes the first step's set-up), and whether the two
backends' losses agree (vmap rounds differently in the last bits).

    python benchmarks/lora_batching.py                         # 8 clients, fedavg and pflalign
    python benchmarks/lora_batching.py --clients 8 --rounds 3 --repeats 2 --gpu

The table is printed and written to ``--out`` (``results/benchmark-lora-batching/``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8, help="the cohort (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="training rounds (default 3)")
    parser.add_argument("--local-steps", type=int, default=5)
    parser.add_argument("--methods", default="fedavg,pflalign")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--gpu", action="store_true", help="train on the GPU")
    parser.add_argument("--config", default=str(ROOT / "configs" / "scenarios" / "language"
                                                / "lora-shakespeare.toml"))
    parser.add_argument("--out", default=str(ROOT / "results" / "benchmark-lora-batching"))
    return parser.parse_args(argv)


def cell(args: argparse.Namespace, backend: str, repeat: int) -> dict:
    out = Path(args.out) / f"{backend}-{repeat}"
    sets = {"methods": args.methods, "engine": "batched", "batched-backend": backend,
            "num-clients": args.clients, "fraction-train": 1.0, "cohort-size": args.clients,
            "rounds": args.rounds, "local-steps": args.local_steps,
            "eval-every": args.rounds, "client-resources-num-gpus": 1 if args.gpu else 0}
    command = [sys.executable, str(ROOT / "simulate.py"), "--config", args.config, "--quiet",
               "--overwrite", "--out", str(out)]
    for key, value in sets.items():
        command += ["--set", f"{key}={value}"]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{backend} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    results = json.loads((out / "results.json").read_text())
    cells = {}
    for label, entry in results["methods"].items():
        rows = entry["rounds"]
        steady = [r["train-seconds"] for r in rows[1:]] or [rows[0]["train-seconds"]]
        cells[label] = {"s-per-round": statistics.mean(steady),
                        "train-loss": [r["train-loss"] for r in rows],
                        "personal-ppl": entry["final"].get("personal-ppl")}
    return {"backend": backend, "repeat": repeat, "wall-s": time.perf_counter() - started,
            "methods": cells, "language-model": results.get("language-model")}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    runs = [cell(args, backend, r) for r in range(args.repeats) for backend in ("loop", "vmap")]
    lines = [f"cohort of {args.clients} clients, {args.rounds} rounds of {args.local_steps} "
             "steps, seconds per training round (rounds 2..):",
             f"{'method':<10} {'loop':>8} {'vmap':>8} {'loop/vmap':>10} {'max rel. loss diff':>19}"]
    table = {}
    for label in runs[0]["methods"]:
        loop = [r["methods"][label]["s-per-round"] for r in runs if r["backend"] == "loop"]
        vmap = [r["methods"][label]["s-per-round"] for r in runs if r["backend"] == "vmap"]
        losses = [(a, b) for r_loop, r_vmap in zip(runs[::2], runs[1::2], strict=True)
                  for a, b in zip(r_loop["methods"][label]["train-loss"],
                                  r_vmap["methods"][label]["train-loss"], strict=True)]
        diff = max(abs(a - b) / abs(a) for a, b in losses)
        ratio = statistics.median(loop) / statistics.median(vmap)
        table[label] = {"loop-s": loop, "vmap-s": vmap, "ratio": ratio, "loss-rel-diff": diff}
        lines.append(f"{label:<10} {statistics.median(loop):8.2f} {statistics.median(vmap):8.2f} "
                     f"{ratio:10.2f} {diff:19.1e}")
    text = "\n".join(lines)
    print(text)
    (Path(args.out) / "lora-batching.json").write_text(json.dumps(
        {"args": vars(args), "table": table, "runs": runs}, indent=2))
    (Path(args.out) / "lora-batching.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
