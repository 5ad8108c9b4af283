#!/usr/bin/env python
"""Compare the metrics of two results.json files, bit for bit.

    python scripts/compare_results.py BEFORE/results.json AFTER/results.json
    python scripts/compare_results.py BEFORE_DIR AFTER_DIR        # every results.json below each
    python scripts/compare_results.py --by-metric BEFORE_DIR AFTER_DIR   # a line per metric

Every per-round row, final metric and per-client result of every method is compared for exact
equality (floats included). Wall-clock entries (``*-seconds``, ``seconds-per-round``) differ from
run to run and are skipped; so are the run's start time, its total seconds, the package versions
and each method's ``processes`` (the run's own process ids and peak memory). The partition
summary and the config must match too (``out-dir``, ``engine``, the engines' own keys and
``report``, ``save-models`` and the other output keys aside, so that two engines' runs of one
config can be compared). Prints one line per difference and a summary; exits 1 when anything
differs.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

IGNORED_CONFIG = {"out-dir", "engine", "cohort-size", "batched-backend", "batched-workers",
                  "memory-budget-gb", "report", "cache-dir", "save-models", "keep-checkpoints"}


def _timing(key: str) -> bool:
    return key.endswith("seconds") or key == "seconds-per-round"


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _compare_rows(where: str, a: dict, b: dict, out: list[str], allow_new: bool = False) -> int:
    checked = 0
    for key in sorted(set(a) | set(b)):
        if _timing(key) or (allow_new and key not in a):
            continue
        checked += 1
        if key not in a or key not in b:
            out.append(f"{where}: '{key}' only in {'before' if key in a else 'after'}")
        elif not _same(a[key], b[key]):
            out.append(f"{where}: '{key}' {a[key]!r} != {b[key]!r}")
    return checked


def compare(before: dict, after: dict, allow_new: bool = False) -> tuple[list[str], int]:
    """The differences between two results dictionaries, and how many values were compared.
    With ``allow_new``, methods, config keys, partition-summary keys and metrics only in ``after``
    (added since) are not differences."""
    out: list[str] = []
    checked = 0
    config_a = {k: v for k, v in before.get("config", {}).items() if k not in IGNORED_CONFIG}
    config_b = {k: v for k, v in after.get("config", {}).items() if k not in IGNORED_CONFIG
                and (k in config_a or not allow_new)}
    checked += _compare_rows("config", config_a, config_b, out)
    partition_a = before.get("partition") or {}
    partition_b = {k: v for k, v in (after.get("partition") or {}).items()
                   if k in partition_a or not allow_new}  # keys a later version added
    if partition_a != partition_b:
        out.append("partition summaries differ")
    methods_a, methods_b = before.get("methods", {}), after.get("methods", {})
    for name in sorted(set(methods_a) ^ set(methods_b)):
        if not (allow_new and name in methods_b):
            out.append(f"method '{name}' only in {'before' if name in methods_a else 'after'}")
    for name in [n for n in methods_a if n in methods_b]:
        a, b = methods_a[name], methods_b[name]
        if len(a["rounds"]) != len(b["rounds"]):
            out.append(f"[{name}] {len(a['rounds'])} rounds != {len(b['rounds'])}")
        for row_a, row_b in zip(a["rounds"], b["rounds"], strict=False):
            checked += _compare_rows(f"[{name}] round {row_a.get('round')}", row_a, row_b, out,
                                     allow_new)
        checked += _compare_rows(f"[{name}] final", a.get("final", {}), b.get("final", {}), out,
                                 allow_new)
        clients_a = {c["id"]: c for c in a.get("clients", [])}
        clients_b = {c["id"]: c for c in b.get("clients", [])}
        if set(clients_a) != set(clients_b):
            out.append(f"[{name}] evaluated clients differ")
        for cid in sorted(set(clients_a) & set(clients_b)):
            checked += _compare_rows(f"[{name}] client {cid}", clients_a[cid], clients_b[cid], out,
                                     allow_new)
        for key in ("method", "overrides"):
            if a.get(key) != b.get(key):
                out.append(f"[{name}] '{key}' {a.get(key)!r} != {b.get(key)!r}")
    return out, checked


_VALUE = re.compile(r"^\[(?P<method>.+?)\] (?P<where>.+?): '(?P<key>[^']+)' "
                    r"(?P<a>[-+0-9.eE]+|nan|inf) != (?P<b>[-+0-9.eE]+|nan|inf)$")


def by_metric(diffs: list[str]) -> list[str]:
    """The numeric differences grouped by method and metric (a ``-median`` with its metric):
    how many values differ and the largest relative difference; other lines as they are."""
    groups: dict[tuple[str, str], tuple[int, float]] = {}
    other = []
    for line in diffs:
        found = _VALUE.match(line)
        if found is None:
            other.append(line)
            continue
        a, b = float(found["a"]), float(found["b"])
        key = (found["method"], found["key"].removesuffix("-median"))
        count, largest = groups.get(key, (0, 0.0))
        groups[key] = (count + 1, max(largest, abs(a - b) / max(abs(a), 1e-300)))
    return other + [f"[{method}] '{metric}': {count} values differ, largest relative "
                    f"difference {largest:.1e}"
                    for (method, metric), (count, largest) in groups.items()]


def _pairs(before: Path, after: Path) -> list[tuple[Path, Path]]:
    if before.is_file():
        return [(before, after)]
    found = sorted(p.relative_to(before) for p in before.rglob("results.json"))
    if not found:
        raise SystemExit(f"error: no results.json under {before}")
    return [(before / rel, after / rel) for rel in found]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--allow-new", action="store_true",
                        help="Methods, config keys and metrics only in AFTER (added since "
                             "BEFORE) are not counted as differences; new methods are listed.")
    parser.add_argument("--by-metric", action="store_true",
                        help="One line per method and metric that differs (how many values, "
                             "the largest relative difference) instead of one per value.")
    args = parser.parse_args(argv)
    total_diffs = 0
    for path_a, path_b in _pairs(args.before, args.after):
        if not path_b.is_file():
            print(f"{path_b}: missing")
            total_diffs += 1
            continue
        before, after = json.loads(path_a.read_text()), json.loads(path_b.read_text())
        diffs, checked = compare(before, after, args.allow_new)
        methods = len(before.get("methods", {}))
        new = sorted(set(after.get("methods", {})) - set(before.get("methods", {})))
        for line in by_metric(diffs) if args.by_metric else diffs:
            print(f"{path_b}: {line}")
        status = "identical" if not diffs else f"{len(diffs)} differences"
        print(f"{path_a} vs {path_b}: {methods} methods, {checked} values compared, {status}"
              + (f" (new since: {', '.join(new)})" if new and args.allow_new else ""))
        total_diffs += len(diffs)
    print("no differences" if not total_diffs else f"{total_diffs} differences in all")
    return 1 if total_diffs else 0


if __name__ == "__main__":
    sys.exit(main())
