#!/usr/bin/env python
"""Run federated methods on one partition and seed, print a comparison, write results.json.

    python simulate.py                                  # configs/default.toml
    python simulate.py --config FILE --set rounds=5 --methods fedavg,local --out DIR
    python simulate.py --print-config                   # every key with its resolved value
    python simulate.py --ray-address 127.0.0.1:6379     # clients on a running Ray cluster

Ctrl-C (or SIGTERM) stops a run: the finished method entries are written to results.json, marked
"interrupted", and the exit status is 130 (143 for SIGTERM); a second Ctrl-C exits at once.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from pflalign.config import OPTIONS, ConfigError, Settings, format_settings, resolve
from pflalign.interrupt import Interrupted, exit_status, handle_signals, signal_name, stop_signal
from pflalign.methods import METHODS
from pflalign.results import Reporter, prepare_output

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "default.toml"


def _epilog() -> str:
    lines = ["config keys (set in the TOML file or with --set KEY=VALUE; defaults shown):"]
    for opt in OPTIONS:
        lines.append(f"  {opt.key} = {opt.default!r}")
        lines += textwrap.wrap(opt.help, width=88, initial_indent="      ",
                               subsequent_indent="      ")
    lines.append("\nmethods:")
    for spec in METHODS.values():
        lines += textwrap.wrap(f"{spec.name}: {spec.summary}", width=88, initial_indent="  ",
                               subsequent_indent="      ")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Simulate federated rounds of personalized FL on Flower + Ray and compare "
                    "methods on the same partition and seed.",
        epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), metavar="FILE",
                        help="TOML run config (default: configs/default.toml).")
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
    parser.add_argument("--print-config", action="store_true",
                        help="Print the resolved config (every key, defaults included) and exit.")
    parser.add_argument("--quiet", action="store_true", help="Print only the final table.")
    parser.add_argument("--verbose", action="store_true", help="Show Flower's own log lines.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    extra = {}
    if args.methods:
        extra["methods"] = args.methods
    if args.out:
        extra["out-dir"] = args.out
    try:
        settings = resolve(args.config, args.overrides, extra)
        if args.print_config:
            print(format_settings(settings), end="")
            return 0
        if args.ray_address and settings.run.engine != "flower":
            raise ConfigError(f"--ray-address runs the clients on a Ray cluster, which needs "
                              f"engine = 'flower' (this run has engine = "
                              f"{settings.run.engine!r}).")
        if not args.ray_address:
            from pflalign.engines import check_resources

            check_resources(settings)  # a config error comes before any complaint about --out
        prepare_output(settings.run.out_dir, overwrite=args.overwrite)
        reporter = Reporter(quiet=args.quiet)
        with handle_signals():
            try:
                run(settings, reporter, args)
            except Interrupted as stop:
                print(interrupted_message(stop), file=sys.stderr, flush=True)
                return exit_status(stop_signal())
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def run(settings: Settings, reporter: Reporter, args: argparse.Namespace) -> dict:
    if settings.run.engine == "sequential":
        from pflalign.engines.sequential import simulate as simulate_sequential

        return simulate_sequential(settings, reporter)
    from strategies.simulation import simulate

    return simulate(settings, reporter, verbose=args.verbose, ray_address=args.ray_address)


def interrupted_message(stop: Interrupted) -> str:
    """The one line printed when a run stops early: what finished and where it was written."""
    head = f"Interrupted ({signal_name(stop_signal())})"
    if stop.results_path is None:
        return f"{head} before any method entry ran; nothing was written."
    total = len(stop.finished) + len(stop.unfinished)
    done = f" ({', '.join(stop.finished)})" if stop.finished else ""
    partial = (f", with the {stop.partial_rounds} finished round(s) of {stop.unfinished[0]} "
               "under 'partial'" if stop.partial_rounds else "")
    return (f"{head}: {len(stop.finished)} of {total} method entries finished{done}; results so "
            f"far are in {stop.results_path}, marked \"interrupted\": true{partial}. There is no "
            "resume: re-running (with --overwrite, or another --out) starts from round 1 again; "
            f"--methods '{','.join(stop.unfinished)}' runs just the unfinished entries.")


if __name__ == "__main__":
    sys.exit(main())
