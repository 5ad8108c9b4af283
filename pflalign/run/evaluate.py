"""Score the models a run saved (``save-models``) on data given later.

    pflalign-evaluate OUT_DIR [--method LABEL] [--set KEY=VALUE ...] [--out FILE]
    python -m pflalign.run.evaluate ...   (the same)

Each saved client model of each method entry in ``OUT_DIR/models/`` is scored on that client's
test split of the run's data, with the run's config and any ``--set`` changes (new data in the
same layout: ``--set data-path=...`` or ``--set dataset=csv:new.csv``). Without changes it
recomputes the run's own final per-client metrics, bit for bit, and says so. The scores are
printed and written to ``OUT_DIR/evaluation.json`` (or ``--out``): per entry, each client's
id, name, accuracy, mean loss and test count, and every client's samples pooled.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pflalign.outputs.models import _manifests, check_fingerprint
from pflalign.run.models import client_model, entry_settings
from pflalign.settings.options import ConfigError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="pflalign-evaluate",
        description="Score the models a run saved (save-models) on its clients' test splits, "
                    "of the run's data or of data given with --set.")
    parser.add_argument("out_dir", help="the run's out-dir (holding results.json and models/)")
    parser.add_argument("--method", action="append", default=[],
                        help="a method entry's label (repeatable; default: every saved entry)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="change the run's config (e.g. the data)")
    parser.add_argument("--out", default=None,
                        help="where to write the scores (default: OUT_DIR/evaluation.json)")
    return parser.parse_args(argv)


def evaluate_saved(out_dir: str | Path, methods: list[str] | None = None,
                   overrides: list[str] | None = None) -> dict:
    """The scores of every saved client model of ``methods`` (every entry when None) on its
    client's test split of the run's data with ``overrides`` (``KEY=VALUE`` texts)."""
    import torch

    from pflalign.data.node import pooled_node_data
    from pflalign.run.config import parse_override
    from pflalign.training.loops import configure_threads, evaluate

    out = Path(out_dir)
    entries = _manifests(out)
    if not entries:
        raise ConfigError(f"{out} holds no saved models (no models/*/manifest.json); run with "
                          "save-models = final (the default) to write them.")
    unknown = [m for m in methods or [] if m not in entries]
    if unknown:
        raise ConfigError(f"{out} holds no saved models of {', '.join(unknown)}; it holds "
                          f"{', '.join(entries)}.")
    changes = dict(parse_override(text) for text in overrides or [])
    scores: dict = {"out-dir": str(out), "changes": {k: str(v) for k, v in changes.items()},
                    "methods": {}}
    for label in methods or list(entries):
        folder, manifest = entries[label]
        check_fingerprint(out, folder, manifest)
        settings = entry_settings(manifest)
        if changes:
            settings = settings.replace(changes, source="--set")
        configure_threads(settings.run.client_resources_num_cpus)
        regression = settings.run.task == "regression"
        key = "personal-mse" if regression else "personal-acc"  # a regression's score
        rows = []
        for record in manifest["clients"]:
            model = client_model(folder, manifest, settings, record)
            data = pooled_node_data(settings, record["id"], "cpu").data
            with torch.no_grad():
                stats = evaluate(model.module, data.test_x, data.test_y, model.inputs)
            loss = stats.loss_sum / max(stats.count, 1)
            row = {"id": record["id"], **({"name": record["name"]} if "name" in record else {}),
                   "num-test": stats.count, key: loss if regression
                   else stats.correct / max(stats.count, 1), "personal-loss": loss}
            if not changes:
                row["same-as-run"] = (row[key] == record[key]
                                      and row["num-test"] == record["num-test"]
                                      and row["personal-loss"] == record["personal-loss"])
            rows.append(row)
        tested = sum(r["num-test"] for r in rows)
        scores["methods"][label] = {
            "method": manifest["method"], "clients": rows, "metric": key,
            key: (sum(r[key] * r["num-test"] for r in rows) / tested
                  if tested else float("nan"))}
    return scores


def table(scores: dict) -> str:
    lines = [f"{'method':<24} {'clients':>7} {'score':>12}  per client"]
    for label, entry in scores["methods"].items():
        key = entry["metric"]
        show = (lambda v: f"{v:.4g}") if key == "personal-mse" else (
            lambda v: f"{100 * v:.2f}%")
        per = ", ".join(f"{r.get('name', r['id'])}: {show(r[key])}"
                        for r in entry["clients"][:6])
        more = " ..." if len(entry["clients"]) > 6 else ""
        lines.append(f"{label:<24} {len(entry['clients']):>7} {show(entry[key]):>12}  "
                     f"{key}: {per}{more}")
        same = [r["same-as-run"] for r in entry["clients"] if "same-as-run" in r]
        if same:
            lines.append(f"{'':<24} {sum(same)} of {len(same)} clients score exactly as in "
                         "the run")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        scores = evaluate_saved(args.out_dir, args.method or None, args.overrides)
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    path = Path(args.out) if args.out else Path(args.out_dir) / "evaluation.json"
    path.write_text(json.dumps(scores, indent=1, default=float) + "\n")
    print(table(scores))
    print(f"\nScores written to {path.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
