"""Summarize several results.json files (e.g. one per seed) as a mean ± std table.

    python -m pflalign.report results/seed0 results/seed1 results/seed2 [--markdown]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

#: (key in a run's "final" metrics, column label, scale, whether to show the std over runs)
COLUMNS = (("personal-acc", "personal", 100, True), ("personal-acc-next", "next", 100, True),
           ("personal-acc-bottom10", "bottom10", 100, True), ("global-acc", "global", 100, True),
           ("unseen-acc", "unseen", 100, True), ("seconds-per-round", "s/round", 1, False),
           ("bytes-up", "MB up", 1e-6, False), ("bytes-down", "MB down", 1e-6, False))


def load(paths: list[str | Path]) -> list[dict]:
    runs = []
    for path in paths:
        path = Path(path)
        file = path / "results.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"No results.json at '{path}'.")
        runs.append(json.loads(file.read_text()))
    return runs


def summarize(runs: list[dict], markdown: bool = False) -> str:
    """One row per method (in first-seen order): mean ± std over the runs that have it."""
    methods: dict[str, list[dict]] = {}
    for run in runs:
        for name, result in run["methods"].items():
            methods.setdefault(name, []).append(result["final"])
    header = ["method", "runs"] + [label for _, label, _, _ in COLUMNS]
    rows = []
    for name, finals in methods.items():
        cells = [name, str(len(finals))]
        for key, _, scale, with_std in COLUMNS:
            values = [f[key] * scale for f in finals
                      if isinstance(f.get(key), int | float) and math.isfinite(f[key])]
            if not values:
                cells.append("-")
            elif not with_std:
                cells.append(f"{np.mean(values):.2f}" if scale >= 1 else f"{np.mean(values):.1f}")
            else:
                cells.append(f"{np.mean(values):.2f} ± {np.std(values):.2f}")
        rows.append(cells)
    if markdown:
        lines = ["| " + " | ".join(header) + " |",
                 "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*header)] + [fmt.format(*r) for r in rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="results.json files or directories holding one")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args(argv)
    print(summarize(load(args.paths), markdown=args.markdown))


if __name__ == "__main__":
    main()
