"""Does personalization keep its advantage when the clients it needs are slow, away or late?

FedAvg, FedRep, Ditto and pFLAlign on two scenarios (``configs/scenarios/dir-0.1.toml`` and
``cross-device.toml``), three seeds, in four settings of the systems (docs/systems.md):

- ``homogeneous``: every device the median one (``device-spread = 0``): the metrics of a run
  without profiles, with a clock;
- ``deadline``: log-normal devices (spread 1) and a ``round-deadline`` at the 90th percentile of
  the training clients' round times (seed 0's devices and sizes), so that about 10% of the
  sampled clients are late;
- ``deadline+over``: the same with ``over-selection = 1.3``;
- ``async``: FedBuff (``mode = async``) on the same devices, ``concurrency`` the synchronous
  round's clients and ``buffer-size`` half of them, twice the rounds (the same number of
  aggregated updates).

Each setting is one study (``simulate.py --config SCENARIO --seeds 0,1,2``) in
``OUT/<scenario>/<setting>``; a finished one is kept (delete it to run it again). The report,
``OUT/systems.md`` with a figure, gives for each scenario and setting: personal accuracy at the
end and at the scenario's equal-time budget (the earliest end of all its runs: every run reached
it), the simulated hours, the fraction of each device-speed decile's dispatched trainings that
were aggregated, and pFLAlign minus FedRep per seed with its paired 95% t-interval, and how that
gap moved from the homogeneous setting (paired by seed).

    python benchmarks/systems_experiment.py --out results/systems
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from studies import cached_study

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pflalign.data.federated import federated_dataset  # noqa: E402
from pflalign.outputs.plots import per_time  # noqa: E402
from pflalign.outputs.report import study_runs  # noqa: E402
from pflalign.outputs.stats import mean_ci  # noqa: E402
from pflalign.run.config import build_settings, load_toml  # noqa: E402
from pflalign.run.driver import initial_model  # noqa: E402
from pflalign.server.clock import drawn_profiles  # noqa: E402
from pflalign.wire.traffic import records_bytes  # noqa: E402

METHODS = "fedavg,fedrep,ditto,pflalign"
SETTINGS = ("homogeneous", "deadline", "deadline+over", "async")
#: evaluations a run makes: every round on dir-0.1 (20 clients), every third on cross-device
EVAL_EVERY = {"dir-0.1": 1, "cross-device": 3}


def round_times(scenario: dict, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Each client's simulated round time on the default log-normal devices (download and
    upload of the model, its training samples) and whether it trains (not unseen)."""
    settings = build_settings({**scenario, "seed": seed, "device-profiles": "lognormal"})
    federation = federated_dataset(settings)
    total = settings.run.num_clients + settings.run.num_unseen_clients
    model, _ = initial_model(settings)
    size = records_bytes([model])
    run = settings.run
    profiles = drawn_profiles(total, seed, run.device_compute, run.device_upload,
                              run.device_download, run.device_spread)
    epochs = settings.training.local_epochs
    times = np.array([profiles.seconds(c, size, federation.sizes(c)[0] * epochs, size)
                      for c in range(total)])
    training = np.array([not federation.partition.is_unseen(c) for c in range(total)])
    return times, training


def setting_args(name: str, scenario: dict, deadline: float) -> list[str]:
    rounds = int(scenario["rounds"])
    if name == "homogeneous":
        sets = {"device-profiles": "lognormal", "device-spread": 0.0}
    elif name == "deadline":
        sets = {"device-profiles": "lognormal", "round-deadline": round(deadline, 3)}
    elif name == "deadline+over":
        sets = {"device-profiles": "lognormal", "round-deadline": round(deadline, 3),
                "over-selection": 1.3}
    else:
        sets = {"device-profiles": "lognormal", "mode": "async", "rounds": 2 * rounds}
    return [arg for k, v in sets.items() for arg in ("--set", f"{k}={v}")]


def run_setting(scenario_name: str, name: str, args: list[str], out: Path, seeds: str,
                engine: str) -> dict:
    config = ROOT / "configs" / "scenarios" / f"{scenario_name}.toml"
    return cached_study(out / scenario_name / name,
                        ["--config", str(config), "--methods", METHODS, "--seeds", seeds,
                         "--set", f"engine={engine}", "--set",
                         f"eval-every={EVAL_EVERY[scenario_name]}", *args],
                        f"{scenario_name} / {name}")


def at_time(rows: list[dict], budget: float) -> float | None:
    """The personal accuracy of the last evaluation in a round that ended by ``budget``."""
    within = [r for r in rows if "personal-acc" in r and r["sim-time"] <= budget]
    return within[-1]["personal-acc"] if within else None


def ci(values: list[float]) -> str:
    mean, low, high, _ = mean_ci(values)
    return f"{100 * mean:+.2f} [{100 * low:+.2f}, {100 * high:+.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/systems")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--scenarios", default="dir-0.1,cross-device")
    parser.add_argument("--engine", default="batched")
    args = parser.parse_args()
    out = Path(args.out)
    seeds = [int(s) for s in args.seeds.split(",")]
    lines = [f"Command: `python benchmarks/systems_experiment.py --out {args.out} --seeds "
             f"{args.seeds} --scenarios {args.scenarios} --engine {args.engine}`", ""]
    figure_data = {}
    for scenario_name in args.scenarios.split(","):
        scenario = load_toml(ROOT / "configs" / "scenarios" / f"{scenario_name}.toml")
        scenario.pop("out-dir", None)
        times, training = round_times(scenario, seeds[0])
        deadline = float(np.quantile(times[training], 0.9))
        docs = {}
        for name in SETTINGS:
            docs[name] = run_setting(scenario_name, name,
                                     setting_args(name, scenario, deadline), out,
                                     args.seeds, args.engine)
        runs = {name: {r["seed"]: r for r in study_runs(doc)} for name, doc in docs.items()}
        labels = list(next(iter(runs["homogeneous"].values()))["methods"])
        budget = min(entry["rounds"][-1]["sim-time"] for by_seed in runs.values()
                     for run in by_seed.values() for entry in run["methods"].values())
        lines += [f"## {scenario_name}", "",
                  f"Deadline {deadline:.1f} simulated s (90th percentile of seed {seeds[0]}'s "
                  f"training clients' round times); equal-time budget {budget / 3600:.2f} "
                  "simulated hours (the earliest end of any run).", "",
                  "| setting | method | final personal-acc | at the budget | sim hours | "
                  "late / sampled | used / dispatched |", "|---|---|---:|---:|---:|---:|---:|"]
        deciles: dict[str, dict[str, list[float]]] = {}
        for name in SETTINGS:
            for label in labels:
                entries = [runs[name][s]["methods"][label] for s in seeds]
                final = [e["final"]["personal-acc"] for e in entries]
                at = [at_time(e["rounds"], budget) for e in entries]
                hours = np.mean([e["rounds"][-1]["sim-time"] / 3600 for e in entries])
                late = sum(r.get("late", 0) for e in entries for r in e["rounds"])
                dispatched = sum(u["dispatched"] for e in entries for u in e["usage"])
                used = sum(u["used"] for e in entries for u in e["usage"])
                lines.append(f"| {name} | {label} | {100 * np.mean(final):.2f} | "
                             f"{100 * np.mean([a for a in at if a is not None]):.2f} | "
                             f"{hours:.2f} | {late} / {dispatched} | "
                             f"{used / max(dispatched, 1):.3f} |")
                figure_data.setdefault(scenario_name, {}).setdefault(name, {})[label] = [
                    [(r["sim-time"] / 3600, r["personal-acc"]) for r in e["rounds"]
                     if "personal-acc" in r] for e in entries]
            # the fraction of dispatched trainings aggregated, by device-speed decile
            share = {}
            for label in labels:
                fractions = np.zeros(10)
                counts = np.zeros(10)
                for seed in seeds:
                    seed_times, seed_training = round_times(scenario, seed)
                    order = np.argsort(seed_times[seed_training], kind="stable")
                    ids = np.flatnonzero(seed_training)[order]
                    decile = {int(c): min(9, 10 * i // len(ids)) for i, c in enumerate(ids)}
                    for usage in runs[name][seed]["methods"][label]["usage"]:
                        d = decile[int(usage["id"])]
                        fractions[d] += usage["used"]
                        counts[d] += usage["dispatched"]
                share[label] = (fractions / np.maximum(counts, 1)).tolist()
            deciles[name] = share
        lines += ["", "Fraction of dispatched trainings that were aggregated, by decile of the "
                  "device's round time (1: the fastest tenth), all methods and seeds pooled:",
                  "", "| setting | " + " | ".join(str(d + 1) for d in range(10)) + " |",
                  "|---|" + "---:|" * 10]
        for name in SETTINGS:
            pooled = np.mean([deciles[name][label] for label in labels], axis=0)
            lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in pooled) + " |")
        lines += ["", "pFLAlign minus FedRep (personal-acc, points; paired by seed, 95% t-interval"
                  f", {len(seeds)} seeds), and its change from the homogeneous setting:", "",
                  "| setting | gap at the end | gap at the budget | change of the final gap |",
                  "|---|---:|---:|---:|"]
        gaps = {}
        for name in SETTINGS:
            gap = [runs[name][s]["methods"]["pflalign"]["final"]["personal-acc"]
                   - runs[name][s]["methods"]["fedrep"]["final"]["personal-acc"] for s in seeds]
            at_gap = [at_time(runs[name][s]["methods"]["pflalign"]["rounds"], budget)
                      - at_time(runs[name][s]["methods"]["fedrep"]["rounds"], budget)
                      for s in seeds]
            gaps[name] = gap
            change = ("-" if name == "homogeneous" else
                      ci([g - h for g, h in zip(gap, gaps["homogeneous"], strict=True)]))
            lines.append(f"| {name} | {ci(gap)} | {ci(at_gap)} | {change} |")
        lines.append("")
    (out / "systems.md").write_text("\n".join(lines) + "\n")
    (out / "figure-data.json").write_text(json.dumps(figure_data))
    plot(figure_data, out / "systems.png")
    print("\n".join(lines))


def plot(data: dict, path: Path) -> None:
    """Personal accuracy at equal simulated time (mean over seeds), one panel per scenario and
    setting."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    scenarios = list(data)
    figure = Figure(figsize=(4 * len(SETTINGS), 3.2 * len(scenarios)))
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(scenarios), len(SETTINGS), squeeze=False)
    for i, scenario in enumerate(scenarios):
        for j, name in enumerate(SETTINGS):
            ax = axes[i][j]
            for label, curves in data[scenario][name].items():
                # at each simulated time, every seed's last evaluation by then (the report's
                # simtime plot), mean over seeds
                runs = {seed: {"methods": {label: {"rounds": [
                    {"sim-time": 3600 * hours, "personal-acc": acc} for hours, acc in curve]}}}
                    for seed, curve in enumerate(curves)}
                series = per_time(runs, label, "personal-acc")
                ax.plot([h for h, _ in series], [100 * ci[0] for _, ci in series], label=label)
            ax.set_title(f"{scenario} / {name}", fontsize=9)
            ax.set_xlabel("simulated hours")
            ax.set_ylabel("personal-acc (%)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
