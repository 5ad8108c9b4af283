#!/usr/bin/env python
"""Run federated methods on one partition and seed, print a comparison, write results.json.

    python simulate.py                                  # configs/default.toml
    python simulate.py --config FILE --set rounds=5 --methods fedavg,local --out DIR
    python simulate.py --print-config                   # every key with its resolved value
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from pflalign.config import OPTIONS, ConfigError, format_settings, resolve
from pflalign.methods import METHODS
from pflalign.results import Reporter

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
        reporter = Reporter(quiet=args.quiet)
        if settings.run.engine == "sequential":
            from pflalign.engines.sequential import simulate as simulate_sequential

            simulate_sequential(settings, reporter)
        else:
            from strategies.simulation import simulate

            simulate(settings, reporter, verbose=args.verbose)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
