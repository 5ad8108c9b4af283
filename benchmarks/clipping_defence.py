"""What does clipping every update (``update-clip``, norm bounding) cost honest runs, and what does
it save against a client that scales its update?

Two parts, each a set of ``simulate.py`` studies kept in ``OUT`` (a finished one is read back,
one killed part-way continues):

- ``honest``: the scenario suite (``--suite``: eight scenarios, ``--methods``, three seeds) without
  clipping and with ``update-clip`` = each of ``--clips``, on one engine, so that the cost of
  each clip is read paired by scenario, method and seed against the run without it;
- ``attack``: ``configs/scenarios/dir-0.1.toml`` (20 clients) with one client uploading
  ``attack-scale`` (10) times its update, which the update-norm bound (30x) never rejects, at
  2, 3 and 10 clients a round, without clipping and with each clip, and the same federation
  without the attacker's replies (``attack = hang``: the honest reference).

The report, ``OUT/clipping-PART.md`` (PART as ``--part``), gives the personal accuracy (mean
and 95% t-interval over seeds) and each clip's paired change, per method and scenario for
``honest`` and per round size for ``attack``.

    python benchmarks/clipping_defence.py --out results/clipping --part attack
    python benchmarks/clipping_defence.py --out results/clipping --part honest
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from studies import cached_study

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pflalign.outputs.report import study_runs  # noqa: E402
from pflalign.outputs.stats import mean_ci  # noqa: E402

#: clients a round in the attack part, as fraction-train of dir-0.1's 20 clients
ROUND_SIZES = {2: 0.1, 3: 0.15, 10: 0.5}


def interval(values: list[float], bounded: bool = False) -> str:
    """``mean [low, high]`` in %; ``bounded`` for accuracies (the logit-scale interval, inside
    [0, 100] %), not for their changes."""
    mean, low, high, n = mean_ci(values, bounded=bounded)
    if n == 0:
        return "none"
    return f"{100 * mean:.2f} [{100 * low:.2f}, {100 * high:.2f}]"


def accuracies(doc: dict, scenario: str = "") -> dict[tuple[str, str], dict[int, float]]:
    """(scenario, method) -> seed -> final personal accuracy (nan without one); ``scenario``
    names the runs of a ``--config`` study (their own scenario name is empty)."""
    out: dict[tuple[str, str], dict[int, float]] = {}
    for run in study_runs(doc):
        for label, entry in run["methods"].items():
            out.setdefault((run["scenario"] or scenario, label), {})[run["seed"]] = \
                entry["final"].get("personal-acc", math.nan)
    return out


def table(reference: dict, variants: dict[str, dict], key_name: str) -> list[str]:
    """Rows of ``(key, method)``: the reference's accuracy, each variant's, and each variant's
    change from the reference paired by seed."""
    names = list(variants)
    lines = [f"| {key_name} | method | without | " + " | ".join(names) + " | "
             + " | ".join(f"change, {n}" for n in names) + " |",
             "|---|---|---:|" + "---:|" * (2 * len(names))]
    for (key, label), by_seed in sorted(reference.items()):
        seeds = sorted(by_seed)
        cells = [interval([variants[n][(key, label)][s] for s in seeds], bounded=True)
                 for n in names]
        changes = [interval([variants[n][(key, label)][s] - by_seed[s] for s in seeds])
                   for n in names]
        lines.append(f"| {key} | {label} | {interval([by_seed[s] for s in seeds], True)} | "
                     + " | ".join(cells + changes) + " |")
    return lines


def honest(out: Path, args: argparse.Namespace) -> list[str]:
    common = ["--suite", "--methods", args.methods, "--seeds", args.seeds, "--set",
              f"engine={args.engine}"]
    reference = accuracies(cached_study(out / "honest" / "none", common, "honest / none"))
    variants = {f"update-clip {c:g}": accuracies(cached_study(
        out / "honest" / f"clip-{c:g}", [*common, "--set", f"update-clip={c:g}"],
        f"honest / clip {c:g}")) for c in args.clips}
    return ["## Honest runs: the scenario suite", "",
            "Final personal accuracy (%, mean [95% t-interval] over seeds) and each clip's "
            "change, paired by seed:", "", *table(reference, variants, "scenario"), ""]


def attack(out: Path, args: argparse.Namespace) -> list[str]:
    config = str(ROOT / "configs" / "scenarios" / "dir-0.1.toml")
    lines = ["## One client scaling its update by 10, on dir-0.1", ""]
    for size, fraction in ROUND_SIZES.items():
        common = ["--config", config, "--methods", args.attack_methods, "--seeds", args.seeds,
                  "--set", f"engine={args.engine}", "--set", f"fraction-train={fraction}",
                  "--set", "malicious-clients=1"]
        folder = out / "attack" / f"{size}-a-round"
        silent = accuracies(cached_study(folder / "silent", [*common, "--set", "attack=hang"],
                                         f"attack {size} / silent"), "dir-0.1")
        scaled = ["--set", "attack=scale", "--set", "attack-scale=10"]
        variants = {"attacked": accuracies(cached_study(folder / "none", [*common, *scaled],
                                                        f"attack {size} / none"), "dir-0.1")}
        for clip in args.clips:
            variants[f"attacked, update-clip {clip:g}"] = accuracies(cached_study(
                folder / f"clip-{clip:g}", [*common, *scaled, "--set", f"update-clip={clip:g}"],
                f"attack {size} / clip {clip:g}"), "dir-0.1")
        lines += [f"### {size} clients a round", "",
                  "'without': the attacker never answers (its replies dropped). Final personal "
                  "accuracy (%) and the change from that reference, paired by seed:", "",
                  *table(silent, variants, "scenario"), ""]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/clipping")
    parser.add_argument("--part", choices=("honest", "attack", "both"), default="both")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--clips", default="1,2", type=lambda t: [float(c) for c in t.split(",")])
    parser.add_argument("--methods", default="fedavg,fedavg-ft,local,fedrep,ditto,pflalign")
    parser.add_argument("--attack-methods", default="fedavg,fedrep,pflalign")
    parser.add_argument("--engine", default="batched")
    args = parser.parse_args()
    out = Path(args.out)
    lines = [f"Command: `python benchmarks/clipping_defence.py --out {args.out} --part "
             f"{args.part} --seeds {args.seeds} --clips {','.join(f'{c:g}' for c in args.clips)}"
             f" --methods {args.methods} --attack-methods {args.attack_methods} --engine "
             f"{args.engine}`", ""]
    if args.part in ("attack", "both"):
        lines += attack(out, args)
    if args.part in ("honest", "both"):
        lines += honest(out, args)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"clipping-{args.part}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
