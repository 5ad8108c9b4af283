#!/usr/bin/env python
"""Optimizer step time on the ``cnn`` model: GENIE against torch's Adam (foreach), SGD, PFLAlign.

Each optimizer steps on its own copy of the parameters with precomputed gradients (the step alone
is timed, not the forward or backward pass), after warm-up steps: first one fixed gradient, then
the gradients of ``--batches`` random mini-batches in turn (so GENIE sees a real gradient variance
and its confidence gate works). The median over ``--repeats`` interleaved blocks of ``--steps``
steps is reported, in milliseconds per step, with the ratio to Adam.

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

from pflalign.models.registry import build_model  # noqa: E402
from pflalign.training.optim import GENIE, PFLAlign  # noqa: E402


class Subject:
    """One optimizer over its own copy of the model's parameters, fed the gradients of
    ``batches`` in turn (assigned, not copied, so feeding costs every optimizer the same)."""

    def __init__(self, make, init: list[torch.Tensor], batches: list[list[torch.Tensor]]):
        self.params = [t.clone().requires_grad_(True) for t in init]
        self.batches = batches
        self.optimizer = make(self.params)
        self.count = 0

    def step(self) -> None:
        for p, g in zip(self.params, self.batches[self.count % len(self.batches)], strict=True):
            p.grad = g
        self.count += 1
        self.optimizer.step()


def time_steps(subjects: dict[str, Subject], steps: int, repeats: int) -> dict[str, float]:
    """Median ms per step of each optimizer; the blocks of the optimizers are interleaved
    (repeat 1 of each, then repeat 2 of each, ...) so that a drift in the machine's speed touches
    all of them alike."""
    for subject in subjects.values():
        for _ in range(10):
            subject.step()
    blocks: dict[str, list[float]] = {name: [] for name in subjects}
    for _ in range(repeats):
        for name, subject in subjects.items():
            started = time.perf_counter()
            for _ in range(steps):
                subject.step()
            blocks[name].append((time.perf_counter() - started) / steps * 1000)
    return {name: statistics.median(times) for name, times in blocks.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--batches", type=int, default=8,
                        help="distinct mini-batch gradients cycled through in the second run")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model(args.model, (1, 28, 28), 10, seed=0)
    init = [p.detach().clone() for p in model.parameters()]
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.batches):  # gradients of random mini-batches of 32
        model.zero_grad()
        x = torch.randn(32, 1, 28, 28, generator=gen)
        y = torch.randint(0, 10, (32,), generator=gen)
        F.cross_entropy(model(x), y).backward()
        batches.append([p.grad.detach().clone() for p in model.parameters()])
    count = sum(t.numel() for t in init)
    makers = {
        "adam (foreach)": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3),
        "genie (flat, foreach)": lambda ps: GENIE(ps, lr=1e-3,
                                                  generator=torch.Generator().manual_seed(0)),
        "genie (single tensor)": lambda ps: GENIE(ps, lr=1e-3, foreach=False,
                                                  generator=torch.Generator().manual_seed(0)),
        "genie, no mask/noise": lambda ps: GENIE(ps, lr=1e-3, mask=False, noise=False),
        "pflalign (foreach)": lambda ps: PFLAlign(ps, lr=1e-3),
    }
    print(f"{args.model}: {count:,} parameters in {len(init)} tensors, {args.threads} "
          f"thread(s), median of {args.repeats} interleaved blocks of {args.steps} steps")
    for title, feed in (("one fixed gradient", batches[:1]),
                        (f"{args.batches} mini-batch gradients in turn", batches)):
        results = time_steps({name: Subject(make, init, feed) for name, make in makers.items()},
                             args.steps, args.repeats)
        adam = results["adam (foreach)"]
        print(f" {title}:")
        for name, ms in results.items():
            print(f"  {name:<24} {ms:7.3f} ms/step   {ms / adam:5.2f} x adam")


if __name__ == "__main__":
    main()
