#!/usr/bin/env python
"""How much does the Flower/Ray simulation cost over a plain PyTorch loop doing the same work?

(a) FedAvg through the real simulation (``simulate``: Flower's simulation engine, Ray actors,
    Messages), and (b) the same clients, the same local steps and the same seeds as a plain
    sequential loop in this process, with torch using all the cores (``--threads``, default: all).
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
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pflalign.aggregation import FlatSpec, fedavg  # noqa: E402
from pflalign.config import resolve  # noqa: E402
from pflalign.federation import federated_dataset  # noqa: E402
from pflalign.models import build_model  # noqa: E402
from pflalign.results import Reporter  # noqa: E402
from pflalign.sampling import sample_clients  # noqa: E402
from pflalign.train import STREAM_TRAIN, make_generator, make_sgd, train_local  # noqa: E402


def plain_loop(settings, rounds: int) -> tuple[list[float], list[float]]:
    """Sequential FedAvg in one process: per-round seconds and sample-weighted train losses."""
    fed = federated_dataset(settings)
    part, ds = fed.partition, fed.dataset
    seed = int(settings["seed"])
    global_model = build_model(str(settings["model"]), ds.input_shape, ds.num_classes, seed=seed)
    state = {k: v.numpy().copy() for k, v in global_model.state_dict().items()}
    spec = FlatSpec.of(state)
    clients = {c: fed.client_data(c) for c in range(part.num_train_clients)}
    seconds, losses = [], []
    for rnd in range(1, rounds + 1):
        started = time.perf_counter()
        sampled = sample_clients(range(part.num_train_clients), float(settings["fraction-train"]),
                                 seed, rnd)
        states, sizes, round_losses = [], [], []
        for cid in sampled:
            data = clients[cid]
            model = build_model(str(settings["model"]), ds.input_shape, ds.num_classes)
            model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
            stats = train_local(
                model, data.train_x, data.train_y, data.normalize,
                optimizer=make_sgd(model.parameters(), settings),
                batch_size=int(settings["batch-size"]), epochs=int(settings["local-epochs"]),
                max_steps=int(settings["local-steps"]),
                generator=make_generator(seed, rnd, cid, STREAM_TRAIN))
            states.append({k: v.detach().numpy().copy() for k, v in model.state_dict().items()})
            sizes.append(data.num_train)
            round_losses.append(stats.loss)
        state = fedavg(states, sizes, spec)
        seconds.append(time.perf_counter() - started)
        losses.append(float(np.average(round_losses, weights=sizes)))
        print(f"  plain loop round {rnd}: {seconds[-1]:.2f}s  loss {losses[-1]:.4f}", flush=True)
    return seconds, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.toml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads for the plain loop (default: every core)")
    args = parser.parse_args()
    settings = resolve(args.config, args.overrides, {
        "methods": "fedavg", "rounds": args.rounds, "eval-every": args.rounds,
        "out-dir": str(ROOT / "results" / "benchmark-overhead")})

    print(f"(a) Flower simulation on Ray: {settings['num-clients']} clients, "
          f"fraction-train {settings['fraction-train']}, {args.rounds} rounds", flush=True)
    from strategies.simulation import simulate

    results = simulate(settings, Reporter())
    rows = results["methods"]["fedavg"]["rounds"]
    sim_seconds = [r["train-seconds"] for r in rows]
    sim_losses = [r["train-loss"] for r in rows]
    workers = max(1, int((os.cpu_count() or 1) // float(settings["client-resources-num-cpus"])))
    packing = [r["train-seconds"] / (r["client-seconds"] / workers) for r in rows[1:]]

    torch.set_num_threads(args.threads)
    print(f"(b) plain sequential PyTorch loop, {args.threads} torch thread(s)", flush=True)
    plain_seconds, plain_losses = plain_loop(settings, args.rounds)

    sim, plain = np.mean(sim_seconds[1:]), np.mean(plain_seconds[1:])
    print("\nseconds per training round (rounds 2.., round 1 is warm-up):")
    print(f"  simulation  {sim:7.2f}s   (round 1: {sim_seconds[0]:.2f}s)")
    print(f"  plain loop  {plain:7.2f}s   (round 1: {plain_seconds[0]:.2f}s)")
    print(f"  ratio simulation / plain = {sim / plain:.2f}  (goal: <= 1.2)")
    print(f"  simulation round time / (summed client compute / {workers} workers) = "
          f"{np.mean(packing):.2f}  (1.00 = no engine overhead, no idle worker)")
    gap = max(abs(a - b) for a, b in zip(sim_losses, plain_losses, strict=True))
    print(f"  same computation: max |train-loss difference| over rounds = {gap:.2e}")


if __name__ == "__main__":
    main()
