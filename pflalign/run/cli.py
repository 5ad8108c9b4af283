"""The command line: ``pflalign`` (the installed console command) and ``python simulate.py``.

Run federated methods on one partition and seed, or a study over seeds, scenarios, sweeps and
tuning; print a comparison; write results.json, results.csv, report.md and plots/.

    pflalign                                            # configs/default.toml (in a checkout)
    pflalign --config FILE --set rounds=5 --methods fedavg,local --out DIR
    pflalign --seeds 0,1,2 --reference pflalign         # mean, 95% CIs, paired differences
    pflalign --suite --seeds 0-2                        # every scenario in configs/scenarios
    pflalign --scenario dir-0.1 --tune 6                # equal-budget tuning on validation data
    pflalign --sweep lr=0.01,0.05                       # one row per setting, no selection
    pflalign --resume DIR                               # continue a stopped or killed run
    pflalign --print-config                             # every key with its resolved value
    pflalign --ray-address 127.0.0.1:6379               # clients on a running Ray cluster

Ctrl-C (or SIGTERM) stops a run: what finished is written, marked "interrupted", the exit status
is 130 (143 for SIGTERM), and `--resume DIR` continues it; a second Ctrl-C exits at once.

The default config is the checkout's ``configs/default.toml``; an installed package without the
checkout starts from the built-in defaults (``--print-config`` shows them).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from pflalign.methods.registry import METHODS
from pflalign.outputs.report import COMPARABLE_METRICS, leaderboard_text
from pflalign.outputs.results import Reporter, make_reporter, prepare_output
from pflalign.process.interrupt import (
    Interrupted,
    exit_status,
    handle_signals,
    signal_name,
    stop_signal,
)
from pflalign.run.config import OPTIONS, format_settings, left_out_by_all, resolve
from pflalign.run.driver import check_resources, preflight, simulate
from pflalign.run.study import (
    DEFAULT_SUITE,
    METRIC,
    SUITES,
    Plan,
    Study,
    parse_seeds,
    parse_sweep,
    scenario_names,
    scenario_settings,
    wants_report,
)
from pflalign.settings.options import ConfigError
from pflalign.settings.schema import Settings

#: the checkout's default run (absent from an installed package without the checkout)
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.toml"


def program() -> str:
    """How the user started this command: ``pflalign`` or ``python simulate.py``."""
    return "pflalign" if Path(sys.argv[0]).name == "pflalign" else "python simulate.py"


def _epilog() -> str:
    lines = ["config keys (set in the TOML file or with --set KEY=VALUE; defaults shown):"]
    for opt in OPTIONS:
        lines.append(f"  {opt.key} = {opt.default!r}")
        lines += textwrap.wrap(opt.full_help, width=88, initial_indent="      ",
                               subsequent_indent="      ")
    lines.append("\nmethods:")
    for spec in METHODS.values():
        lines += textwrap.wrap(f"{spec.name}: {spec.summary}", width=88, initial_indent="  ",
                               subsequent_indent="      ")
    lines.append("\nexamples:")
    for comment, command in EXAMPLES:
        lines += [f"  # {comment}", f"  {program()} {command}"]
    return "\n".join(lines)


#: the examples ``--help`` ends with: (what it does, the arguments)
EXAMPLES = (
    ("the default run: fedavg, fedavg-ft, local and pflalign on Fashion-MNIST",
     "--out results/default"),
    ("every method, 5 seeds, with 95% intervals and paired tests against fedavg",
     "--methods all --seeds 0-4 --out results/all"),
    ("a method with its own values, beside another",
     "--methods 'fedavg,pflalign(pflalign-lr=1.0)' --set rounds=50"),
    ("your own data and model (docs/data.md, docs/usage.md)",
     "--set dataset=npz:my_data.npz --set partition=natural --set model=py:my_model.py:build"),
    ("tune each method on a validation split (20 trials), then run the best on 3 seeds",
     "--methods fedavg,ditto,pflalign --tune 20 --seeds 0-2"),
    ("the scenario suite, with a critical-difference verdict across scenarios",
     "--suite --seeds 0-2 --out results/suite"),
    ("the Flower engine on Ray, then the report again from results.json",
     "--set engine=flower --out results/flower && python -m pflalign.outputs.report "
     "results/flower"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=program(),
        description="Simulate federated rounds of personalized FL on Flower + Ray and compare "
                    "methods on the same partition and seed.",
        epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE",
                        default=str(DEFAULT_CONFIG) if DEFAULT_CONFIG.exists() else None,
                        help="TOML run config (default: configs/default.toml in a checkout, "
                             "else the built-in defaults).")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="Override one config key; repeatable.")
    parser.add_argument("--methods", metavar="LIST",
                        help="Comma-separated methods to compare, or 'all' (overrides 'methods').")
    parser.add_argument("--out", metavar="DIR", help="Output directory for results.json "
                        "(overrides 'out-dir').")
    parser.add_argument("--overwrite", action="store_true",
                        help="Replace an existing results.json in the output directory (without "
                             "it, a run refuses to start there).")
    parser.add_argument("--ray-address", metavar="ADDR",
                        help="Run the clients on an existing Ray cluster (e.g. 127.0.0.1:6379, "
                             "as `ray start --head` prints) instead of starting a local Ray; "
                             "this machine must be one of its nodes. engine = flower only.")
    parser.add_argument("--seeds", metavar="LIST",
                        help="Run every method on each seed ('0,1,2' or '0-4'); tables show the "
                             "mean and a 95%% confidence interval, and each method's paired "
                             "difference from --reference (default: the config's seed).")
    parser.add_argument("--metric", metavar="NAME", default=METRIC,
                        help="The final metric the statistics, ranks, verdict and --tune use, "
                             "with its direction (losses and perplexities: lower is better) and "
                             "its range: " + ", ".join(COMPARABLE_METRICS) + f" (default: "
                             f"{METRIC}).")
    parser.add_argument("--reference", metavar="LABEL",
                        help="The method the others are paired against (default: fedavg when it "
                             "runs, else the first method).")
    parser.add_argument("--suite", nargs="?", const=DEFAULT_SUITE, choices=list(SUITES),
                        metavar="NAME",
                        help="Run every scenario of a suite instead of --config; the report has "
                             "a leaderboard and a critical-difference verdict over them. "
                             "Without NAME, the default suite (configs/scenarios: "
                             + ", ".join(scenario_names()) + "); 'language': configs/scenarios/"
                             "language (" + ", ".join(scenario_names("language")) + ").")
    parser.add_argument("--scenario", metavar="LIST",
                        help="Run these scenarios (comma-separated names from configs/scenarios) "
                             "instead of --config.")
    parser.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                        help="Run every value of a config key (repeatable: a grid), one row per "
                             "setting; nothing is selected.")
    parser.add_argument("--tune", type=int, default=0, metavar="N",
                        help="Give every method N trials of its declared search space "
                             "(Optuna's TPE), scored on a validation split of each client's "
                             "training data over --tune-seeds; then run the best on --seeds.")
    parser.add_argument("--tune-seeds", metavar="LIST", default="100",
                        help="Seeds the tuning trials run on; must be disjoint from --seeds "
                             "(default: 100).")
    parser.add_argument("--resume", metavar="DIR",
                        help="Continue the run whose output directory is DIR (its plan.json): "
                             "finished entries are kept, the running one continues from its last "
                             "checkpoint; the other options are ignored.")
    parser.add_argument("--print-config", action="store_true",
                        help="Print the resolved config (every key, defaults included) and exit.")
    parser.add_argument("--quiet", action="store_true", help="Print only the final table.")
    parser.add_argument("--verbose", action="store_true", help="Show Flower's own log lines.")
    args = parser.parse_args(argv)
    if args.tune < 0:
        parser.error("--tune takes a number of trials >= 0.")
    return args


def make_plan(args: argparse.Namespace) -> Plan:
    """The study the command line asks for."""
    extra: dict[str, object] = {}
    if args.methods:
        extra["methods"] = args.methods
    if args.suite or args.scenario:
        names = scenario_names(args.suite) if args.suite else [
            n.strip() for n in args.scenario.split(",") if n.strip()]
        if not names:
            raise ConfigError("No scenario to run: configs/scenarios is empty or --scenario "
                              "names none.")
        built = {name: scenario_settings(name, args.overrides, extra) for name in names}
        scenarios = {name: settings.to_dict() for name, settings in built.items()}
        notes = tuple(dict.fromkeys(
            f"scenario {name}: {note}" for name, settings in built.items()
            for note in settings.notes))
        default_out = ("results/suite" + ("" if args.suite in (None, DEFAULT_SUITE)
                                          else f"-{args.suite}")
                       if args.suite or len(names) > 1 else scenarios[names[0]]["out-dir"])
    else:
        resolved = resolve(args.config, args.overrides, extra)
        values, notes = resolved.to_dict(), resolved.notes
        scenarios = {"": values}
        default_out = values["out-dir"]
    if args.out is not None and not args.out.strip():
        raise ConfigError("--out is empty; give the output directory, or leave --out out for "
                          f"the config's out-dir ({default_out}).")
    out = args.out or str(default_out)
    for values in scenarios.values():
        values["out-dir"] = out
    first = next(iter(scenarios.values()))
    seeds = parse_seeds(args.seeds) if args.seeds else (int(first["seed"]),)
    return Plan(scenarios=scenarios, seeds=seeds, sweep=parse_sweep(args.sweep),
                reference=args.reference, tune=args.tune, metric=args.metric,
                tune_seeds=parse_seeds(args.tune_seeds, "--tune-seeds") if args.tune else (),
                out_dir=out, command=" ".join([program(), *sys.argv[1:]]), notes=notes)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        plan = Plan.load(args.resume) if args.resume else make_plan(args)
        first = plan.settings(next(iter(plan.scenarios)))
        if args.print_config:
            print(format_settings(first), end="")
            return 0
        for name in plan.scenarios:
            settings = plan.settings(name)
            # a config error comes before any complaint about --out
            check_resources(settings, args.ray_address)
        if not args.resume:
            prepare_output(plan.out_dir, overwrite=args.overwrite, create=False)
            # the data and the model load before anything is written (the first run's: a
            # later cell's error leaves the finished ones resumable)
            preflight(first.replace({**plan.settings_list()[0], "seed": plan.seeds[0]},
                                    follow_data=False))
            prepare_output(plan.out_dir, overwrite=args.overwrite)
        reporter = make_reporter(quiet=args.quiet)
        for note in plan.notes:
            reporter.info(note)
        if str(first["methods"]).strip() == "all":
            for label, reason in left_out_by_all(first).items():
                reporter.info(f"methods = all leaves out {label}: {reason}")
        with handle_signals():
            try:
                doc = Study(plan, group_runner(args), reporter, resume=bool(args.resume)).run()
            except Interrupted as stop:
                reporter.close()
                print(interrupted_message(stop, plan.out_dir), file=sys.stderr, flush=True)
                return exit_status(stop_signal())
            finally:
                reporter.close()
        if doc.get("kind") == "study":
            reporter.result("\n" + leaderboard_text(doc))
        if wants_report(doc):
            reporter.result(f"Report: {Path(plan.out_dir, 'report.md').resolve()}")
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def group_runner(args: argparse.Namespace):
    """Runs one group of method entries (one scenario, setting and seed) on its engine."""
    def run_group(settings: Settings, reporter: Reporter, resume: bool) -> dict:
        return simulate(settings, reporter, resume=resume, ray_address=args.ray_address,
                        verbose=args.verbose)
    return run_group


def interrupted_message(stop: Interrupted, out_dir: str) -> str:
    """The one line printed when a run stops early: what finished, where, and how to resume."""
    head = f"Interrupted ({signal_name(stop_signal())})"
    resume = f"`{program()} --resume {out_dir}` continues it."
    if stop.results_path is None:
        return f"{head} before any method entry of this group ran. {resume}"
    total = len(stop.finished) + len(stop.unfinished)
    done = f" ({', '.join(stop.finished)})" if stop.finished else ""
    partial = (f", with the {stop.partial_rounds} finished round(s) of {stop.unfinished[0]} "
               "under 'partial'" if stop.partial_rounds else "")
    return (f"{head}: {len(stop.finished)} of {total} method entries of this group finished"
            f"{done}; results so far are in {stop.results_path}, marked \"interrupted\": true"
            f"{partial}. {resume} Finished entries are kept and the running one continues from "
            "its last checkpoint (checkpoint-every).")

