#!/usr/bin/env python
"""Accuracy under attack: each attack of ``attack`` against fedavg and pflalign, with the mean and
with a robust aggregation, on one config; prints a Markdown table.

    python scripts/attack_table.py --out results/attacks                   # configs/default.toml
    python scripts/attack_table.py --out DIR --seeds 0,1,2 --set rounds=5 --robust trimmed-mean

One ``simulate.py`` run per seed and attack (and one clean run per seed) goes to
``DIR/seed-<s>/<attack>/``; a finished run (its results.json exists and is not marked
interrupted) is not repeated, so an interrupted table resumes. Each seed draws its own partition,
initial model, sampling and malicious clients; the table gives the mean and the standard
deviation over the seeds. Accuracy is reported over
the honest clients only (the malicious clients' own test sets are left out, so that fake-eval
and hang cannot move it by skipping themselves), from the per-client results of the last
evaluation: their test-size-weighted personal accuracy. (The global model's accuracy is recorded
only over all evaluated clients, so it is not shown.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pflalign.engines.faults import malicious_clients  # noqa: E402
from pflalign.run.config import build_settings  # noqa: E402

#: attack -> attack-scale used for it (the factor is unused by signflip, labelflip and hang)
ATTACKS = {"signflip": 1.0, "scale": 100.0, "noise": 10.0, "labelflip": 1.0,
           "inflate-count": 1e6, "fake-eval": 1e6, "hang": 1.0}


def run(out: Path, config: str, extra: list[str], attack: str | None, malicious: int,
        methods: str, seed: int) -> dict:
    path = out / f"seed-{seed}" / (attack or "clean") / "results.json"
    if not path.exists() or json.loads(path.read_text()).get("interrupted"):
        args = [sys.executable, str(ROOT / "simulate.py"), "--config", config, *extra,
                "--set", f"seed={seed}", "--methods", methods, "--out", str(path.parent),
                "--quiet", "--overwrite"]
        if attack:
            args += ["--set", f"malicious-clients={malicious}", "--set", f"attack={attack}",
                     "--set", f"attack-scale={ATTACKS[attack]:g}"]
        print(" ".join(args[1:]), flush=True)
        subprocess.run(args, check=True, cwd=ROOT)
    return json.loads(path.read_text())


def honest_accuracy(result: dict, bad: frozenset[int]) -> float:
    clients = [c for c in result["clients"] if not c["unseen"] and c["id"] not in bad]
    correct = sum(round(c["personal-acc"] * c["num-test"]) for c in clients)
    return correct / sum(c["num-test"] for c in clients)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.toml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--seeds", default="0", help="Comma-separated seeds (default 0).")
    parser.add_argument("--malicious", type=int, default=4)
    parser.add_argument("--robust", default="median", choices=("median", "trimmed-mean"))
    parser.add_argument("--methods", default="fedavg,pflalign")
    args = parser.parse_args(argv)
    extra = [a for o in args.overrides for a in ("--set", o)]
    names = args.methods.split(",")
    entries = ",".join([*names, *(f"{m}(aggregation={args.robust})" for m in names)])
    seeds = [int(s) for s in args.seeds.split(",")]
    rows: dict[str, dict[str, list[float]]] = {}
    for seed in seeds:
        for attack in (None, *ATTACKS):
            results = run(args.out, args.config, extra, attack, args.malicious, entries, seed)
            settings = build_settings(dict(results["config"]))
            bad = malicious_clients(settings if attack else settings.replace(
                {"malicious-clients": args.malicious, "attack": "signflip"}))
            row = rows.setdefault(attack or "clean", {})
            for label, result in results["methods"].items():
                row.setdefault(label, []).append(honest_accuracy(result, bad))
    labels = list(next(iter(rows.values())))
    print(f"\npersonal-acc (%) of the honest clients, mean +- std over seeds {args.seeds}; "
          f"{args.malicious} malicious clients; robust = {args.robust}\n")
    print("| attack | " + " | ".join(labels) + " |")
    print("|---|" + "---:|" * len(labels))
    for attack, accs in rows.items():
        cells = [f"{100 * np.mean(accs[label]):.2f} ± {100 * np.std(accs[label], ddof=1):.2f}"
                 if len(accs[label]) > 1 else f"{100 * accs[label][0]:.2f}" for label in labels]
        print(f"| {attack} | " + " | ".join(cells) + " |")
    if len(seeds) > 1:
        print(f"\nchange from the clean run of the same seed (points; mean +- std over seeds "
              f"{args.seeds}; 'won' = seeds where the attacked run was not worse)\n")
        print("| attack | " + " | ".join(labels) + " |")
        print("|---|" + "---:|" * len(labels))
        for attack, accs in list(rows.items())[1:]:
            cells = []
            for label in labels:
                change = 100 * (np.array(accs[label]) - np.array(rows["clean"][label]))
                cells.append(f"{change.mean():+.2f} ± {change.std(ddof=1):.2f} "
                             f"({int((change >= 0).sum())}/{len(change)})")
            print(f"| {attack} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
