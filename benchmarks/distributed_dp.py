"""What does distributed DP cost against central DP? FedAvg on the privacy experiment's setting.

``configs/privacy.toml`` (1,000 Fashion-MNIST clients, each in a round with probability 0.1, 30
rounds, delta 1e-5) with a fixed clip (``dp-clip = 0.5``, the experiment's first clip: secure
aggregation cannot count clipped uploads, so the adaptive clip is off in both), at each target
epsilon (``--epsilons``), under two mechanisms:

- ``central``: DP-FedAvg, the server clips every update and adds Gaussian noise to their sum
  (docs/privacy.md; no secure aggregation: SecAgg+ under central DP releases the same sum to
  within its quantization error, tests/test_secagg.py);
- ``distributed``: SecAgg+ (``secagg-neighbours = 10``) with each client adding its share of
  discrete Gaussian noise before masking (Kairouz et al. 2021; docs/privacy.md).

Each (mechanism, epsilon, seed) is one run (``simulate.py``) in
``OUT/<mechanism>/eps-<e>/seed-<s>``, kept when finished (``--jobs`` at a time). The report,
``OUT/distributed-dp.md``, gives the personal accuracy (mean and 95% t-interval over seeds), the
change from central DP paired by seed, the noise multiplier each mechanism's calibration chose,
the epsilon the runs reported by their last round, and the seconds and megabytes a round took.

    python benchmarks/distributed_dp.py --out results/distributed-dp --jobs 2
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from studies import cached_study

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pflalign.outputs.report import study_runs  # noqa: E402
from pflalign.outputs.stats import mean_ci  # noqa: E402

CONFIG = ROOT / "configs" / "privacy.toml"
MECHANISMS = {
    "central": ["--set", "dp=central"],
    "distributed": ["--set", "dp=distributed", "--set", "secure-aggregation=secagg+",
                    "--set", "secagg-neighbours=10"],
}


def run(mechanism: str, epsilon: float, seed: int, out: Path, extra: list[str]) -> dict:
    return cached_study(
        out / mechanism / f"eps-{epsilon:g}" / f"seed-{seed}",
        ["--config", str(CONFIG), "--seeds", str(seed), "--methods", "fedavg",
         "--set", "dp-clipping=fixed", "--set", "dp-clip=0.5", "--set", f"dp-epsilon={epsilon:g}",
         "--set", "save-models=none", "--set", "checkpoint-every=0",
         *MECHANISMS[mechanism], *extra],
        f"{mechanism} eps {epsilon:g} seed {seed}")


def interval(values: list[float], scale: float = 100, digits: int = 2) -> str:
    mean, low, high, n = mean_ci(values)
    if n == 0:
        return "none"
    if n == 1:
        return f"{scale * mean:.{digits}f}"
    return f"{scale * mean:.{digits}f} [{scale * low:.{digits}f}, {scale * high:.{digits}f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/distributed-dp")
    parser.add_argument("--epsilons", default="3,8")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    out = Path(args.out)
    epsilons = [float(e) for e in args.epsilons.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    extra = [arg for item in args.set for arg in ("--set", item)]
    cells = [(m, e, s) for s in seeds for e in epsilons for m in MECHANISMS]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        docs = list(pool.map(lambda cell: run(*cell, out, extra), cells))
    results = {}
    for (mechanism, epsilon, seed), doc in zip(cells, docs, strict=True):
        (entry,) = study_runs(doc)
        results[mechanism, epsilon, seed] = entry["methods"]["fedavg"]
    sets = "".join(f" --set {item}" for item in args.set)
    lines = [f"Command: `python benchmarks/distributed_dp.py --out {args.out} --epsilons "
             f"{args.epsilons} --seeds {args.seeds}{sets}`", "",
             "FedAvg's personal accuracy (%, mean [95% t-interval] over seeds), distributed's "
             "change from central paired by seed (points), the epsilon the runs reported by "
             "their last round (largest over seeds; against the server, which knows who took "
             "part, under distributed: central DP's server sees every update), seconds and "
             "megabytes up per round:", "",
             "| epsilon | mechanism | accuracy | change | epsilon spent | against the server "
             "| s/round | MB up/round |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for epsilon in epsilons:
        for mechanism in MECHANISMS:
            rows = {s: results[mechanism, epsilon, s] for s in seeds}
            acc = [r["final"]["personal-acc"] for r in rows.values()]
            change = ([results["distributed", epsilon, s]["final"]["personal-acc"]
                       - results["central", epsilon, s]["final"]["personal-acc"] for s in seeds]
                      if mechanism == "distributed" else [])
            spent = max(r["rounds"][-1]["dp-epsilon"] for r in rows.values())
            server = (f'{max(r["rounds"][-1]["dp-epsilon-server"] for r in rows.values()):.3f}'
                      if mechanism == "distributed" else "none")
            seconds = [r["final"]["seconds-per-round"]
                       for r in rows.values()]
            mb = [sum(x["bytes-up"] for x in r["rounds"]) / len(r["rounds"]) / 1e6
                  for r in rows.values()]
            lines.append(f"| {epsilon:g} | {mechanism} | {interval(acc)} | "
                         f"{interval(change) if change else '-'} | {spent:.3f} | {server} | "
                         f"{interval(seconds, 1, 1)} | {interval(mb, 1, 1)} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "distributed-dp.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
