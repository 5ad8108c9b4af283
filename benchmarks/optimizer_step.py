#!/usr/bin/env python
"""Optimizer step time on the ``cnn`` model: GENIE against torch's Adam (foreach), SGD, PFLAlign.

Each optimizer steps on fixed gradients of one batch (the step alone is timed, not the forward or
backward pass), after warm-up steps; the median over ``--repeats`` blocks of ``--steps`` steps is
reported, in milliseconds per step, with the ratio to Adam.

    python benchmarks/optimizer_step.py                 # 1 thread (a simulated client's share)
    python benchmarks/optimizer_step.py --threads 2 --model cnn
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pflalign.models import build_model  # noqa: E402
from pflalign.optim import GENIE, PFLAlign  # noqa: E402


def time_steps(optimizer: torch.optim.Optimizer, steps: int, repeats: int) -> float:
    for _ in range(5):
        optimizer.step()
    blocks = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(steps):
            optimizer.step()
        blocks.append((time.perf_counter() - started) / steps * 1000)
    return statistics.median(blocks)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model(args.model, (1, 28, 28), 10, seed=0)
    x = torch.randn(32, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    y = torch.arange(32) % 10
    F.cross_entropy(model(x), y).backward()
    params = list(model.parameters())
    count = sum(p.numel() for p in params)
    makers = {
        "adam (foreach)": lambda: torch.optim.Adam(params, lr=1e-3, foreach=True),
        "sgd": lambda: torch.optim.SGD(params, lr=1e-3),
        "genie (foreach)": lambda: GENIE(params, lr=1e-3,
                                         generator=torch.Generator().manual_seed(0)),
        "genie (single tensor)": lambda: GENIE(params, lr=1e-3, foreach=False,
                                               generator=torch.Generator().manual_seed(0)),
        "genie, no mask/noise": lambda: GENIE(params, lr=1e-3, mask=False, noise=False),
        "pflalign (foreach)": lambda: PFLAlign(params, lr=1e-3),
    }
    print(f"{args.model}: {count:,} parameters in {len(params)} tensors, "
          f"{args.threads} thread(s), median of {args.repeats} x {args.steps} steps")
    results = {}
    for name, make in makers.items():
        results[name] = time_steps(make(), args.steps, args.repeats)
    adam = results["adam (foreach)"]
    for name, ms in results.items():
        print(f"  {name:<24} {ms:7.3f} ms/step   {ms / adam:5.2f} x adam")


if __name__ == "__main__":
    main()
