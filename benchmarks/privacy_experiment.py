"""Which personalization methods keep their accuracy under user-level differential privacy?

FedAvg, FedAvg-FT, FedRep, Ditto and pFLAlign on ``configs/privacy.toml`` (1,000 Fashion-MNIST
clients, each in a round with probability 0.1, the batched engine) under central DP-FedAvg with an
adaptive clip (docs/privacy.md), at epsilon 1, 3 and 8 (delta 1e-5, the whole run; the noise
multiplier calibrated before the run) and at epsilon infinity: the same clipping and weighting
without noise, so that the differences between the settings are the noise's alone. Three seeds.

Each setting and seed is one run (``simulate.py --config configs/privacy.toml --seeds S``) in
``OUT/eps-<e>/seed-<s>``; a finished one is kept (delete it to run it again), one killed part-way
continues from its checkpoints. ``--jobs N`` runs N of them at a time, each a process of its own
(one torch thread each on the CPU; on a GPU, add ``--set client-resources-num-gpus=0.05`` so that
they share it); ``--runs-only`` stops after the runs, for a machine that lacks matplotlib (the
report is then written where the results are read back). The report, ``OUT/privacy.md`` with
a privacy-utility figure (``OUT/privacy.png``), gives for each method and epsilon the personal
accuracy (mean and 95% t-interval over seeds), its loss from epsilon infinity paired by seed, the
global accuracy where there is a global model, and the epsilon the runs reported spending.

    python benchmarks/privacy_experiment.py --out results/privacy
    python benchmarks/privacy_experiment.py --out results/privacy --jobs 12 --runs-only \
        --set client-resources-num-gpus=0.05            # the GPU machine: benchmarks/privacy_gpu.sh
"""

from __future__ import annotations

import argparse
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from studies import cached_study

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pflalign.outputs.report import study_runs  # noqa: E402
from pflalign.outputs.stats import mean_ci  # noqa: E402

CONFIG = ROOT / "configs" / "privacy.toml"
#: the settings: epsilon, or None for no noise (epsilon infinity)
EPSILONS = (1.0, 3.0, 8.0, None)


def name_of(epsilon: float | None) -> str:
    return "eps-inf" if epsilon is None else f"eps-{epsilon:g}"


def run_setting(epsilon: float | None, seed: int, out: Path, extra: list[str]) -> dict:
    """The results of one setting's run at ``seed`` (run once, then read back)."""
    noise = (["--set", "dp-noise-multiplier=0"] if epsilon is None
             else ["--set", f"dp-epsilon={epsilon:g}"])
    return cached_study(out / name_of(epsilon) / f"seed-{seed}",
                        ["--config", str(CONFIG), "--seeds", str(seed), *noise, *extra],
                        f"{name_of(epsilon)} seed {seed}")


def interval(values: list[float], bounded: bool = False) -> str:
    """Mean and 95% t-interval in percent, with how many runs had a value when some had
    none; ``bounded`` for accuracies (the logit-scale interval, inside [0, 100] %), not for
    their changes."""
    mean, low, high, n = mean_ci(values, bounded=bounded)
    if n == 0:
        return "none"
    text = f"{100 * mean:.2f} [{100 * low:.2f}, {100 * high:.2f}]"
    return text if n == len(values) else f"{text} ({n} of {len(values)} runs)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/privacy")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every setting (e.g. rounds=10 for a trial)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (processes)")
    parser.add_argument("--runs-only", action="store_true",
                        help="run (or read back) every run, and stop before the report")
    args = parser.parse_args()
    out = Path(args.out)
    seeds = [int(s) for s in args.seeds.split(",")]
    extra = [arg for item in args.set for arg in ("--set", item)]
    # seed by seed: an experiment stopped part-way has every setting of its first seeds
    cells = [(e, s) for s in seeds for e in EPSILONS]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        docs = list(pool.map(lambda cell: run_setting(*cell, out, extra), cells))
    if args.runs_only:
        return
    runs: dict = {e: {} for e in EPSILONS}
    for (epsilon, seed), doc in zip(cells, docs, strict=True):
        (run,) = study_runs(doc)
        runs[epsilon][seed] = run
    labels = list(next(iter(runs[None].values()))["methods"])
    # a run whose every client's evaluation was rejected (a model the noise broke: its losses
    # beyond any honest one) has no accuracy: nan, left out of the mean and counted
    final = {(e, label): [runs[e][s]["methods"][label]["final"].get("personal-acc", math.nan)
                          for s in seeds]
             for e in EPSILONS for label in labels}
    spent = {e: max(r["methods"][label]["rounds"][-1].get("dp-epsilon", math.inf)
                    for r in runs[e].values() for label in labels) for e in EPSILONS}
    sets = " ".join(f"--set {item}" for item in args.set)
    lines = [f"Command: `python benchmarks/privacy_experiment.py --out {args.out} --seeds "
             f"{args.seeds}{' ' + sets if sets else ''}`", "",
             "Personal accuracy (%, mean [95% t-interval] over seeds), and its change from "
             "epsilon infinity (no noise, the same clipping), paired by seed:", "",
             "| method | " + " | ".join(f"eps {e:g}" if e else "eps inf" for e in EPSILONS)
             + " | " + " | ".join(f"change at eps {e:g}" for e in EPSILONS if e) + " |",
             "|---|" + "---:|" * (2 * len(EPSILONS) - 1)]
    for label in labels:
        cells = [interval(final[(e, label)], bounded=True) for e in EPSILONS]
        changes = [interval([a - b for a, b in zip(final[(e, label)], final[(None, label)],
                                                   strict=True)])
                   for e in EPSILONS if e]
        lines.append(f"| {label} | " + " | ".join(cells + changes) + " |")
    lines += ["", "Global accuracy (%, the global model on every client's test split), where a "
              "method has one:", "",
              "| method | " + " | ".join(f"eps {e:g}" if e else "eps inf" for e in EPSILONS)
              + " |", "|---|" + "---:|" * len(EPSILONS)]
    for label in labels:
        if not runs[None][seeds[0]]["methods"][label]["final"].get("global-acc"):
            continue
        values = [[runs[e][s]["methods"][label]["final"].get("global-acc", math.nan)
                   for s in seeds] for e in EPSILONS]
        if values:
            lines.append(f"| {label} | " + " | ".join(interval(vs, bounded=True)
                                                      for vs in values) + " |")
    partial = sorted({f"{label} at {name_of(e)}, seed {s}: {int(r['evaluated'])} of "
                      f"{int(r['eval-clients'])}"
                      for e in EPSILONS for s in seeds for label in labels
                      for r in [runs[e][s]["methods"][label]["final"]]
                      if r.get("evaluated", 0) < r.get("eval-clients", 0)})
    if partial:
        lines += ["", "Runs whose last evaluation left clients out (their replies rejected, "
                  "e.g. a loss beyond the reply check's range from a model the noise broke; "
                  "the accuracy above covers the others only): " + "; ".join(partial) + "."]
    lines += ["", "Epsilon the runs reported spending by their last round (the largest over "
              "methods and seeds; delta 1e-5): "
              + ", ".join(f"target {e:g}: {spent[e]:.3f}" for e in EPSILONS if e) + "."]
    (out / "privacy.md").write_text("\n".join(lines) + "\n")
    plot(final, labels, out / "privacy.png")
    print("\n".join(lines))


def plot(final: dict, labels: list[str], path: Path) -> None:
    """Personal accuracy against epsilon (mean and 95% interval over seeds), one line a
    method; epsilon infinity at the right."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5.5, 3.6))
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    xs = np.arange(len(EPSILONS))
    for label in labels:
        stats = [mean_ci(final[(e, label)], bounded=True) for e in EPSILONS]
        means = [100 * s[0] for s in stats]
        ax.errorbar(xs, means, yerr=[[100 * (s[0] - s[1]) for s in stats],
                                     [100 * (s[2] - s[0]) for s in stats]],
                    label=label, marker="o", capsize=3)
    ax.set_xticks(xs, [f"{e:g}" if e else "inf" for e in EPSILONS])
    ax.set_xlabel("epsilon (delta 1e-5, user-level)")
    ax.set_ylabel("personal-acc (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
