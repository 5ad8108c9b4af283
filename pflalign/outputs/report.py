"""Reports over results.json files: a study's report.md with plots, or a mean ± std table.

    python -m pflalign.outputs.report DIR [--reference LABEL]   # DIR/report.md and DIR/plots/*.png
    python -m pflalign.outputs.report results/seed0 results/seed1 results/seed2 [--markdown]

With one directory (or one results.json), the report is regenerated from that results.json
alone: a study (``"kind": "study"``, several seeds / scenarios / sweep settings) or a single run
(a study of one run). It holds the protocol, a leaderboard (mean final personal accuracy with
its 95% interval over seeds, worst decile and rank per scenario; the average rank), the verdict
across scenarios (Friedman and Iman-Davenport tests, Nemenyi's critical difference and diagram,
Holm's adjustment; Demsar 2006), per scenario the paired differences against the reference
method (with raw and Holm-adjusted p-values) and against each method's best rival, and the plots
of :mod:`pflalign.outputs.plots`. With several paths, one mean ± std row per
method over all their runs is printed instead (``--table`` prints it for one path too).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pflalign.outputs import stats
from pflalign.outputs.results import json_safe, sample_notes, slug
from pflalign.settings.params import EDGE_MARGIN, edges

#: (key in a run's "final" metrics, column label, scale, whether to show the std over runs)
COLUMNS = (("personal-acc", "personal", 100, True), ("personal-acc-next", "next", 100, True),
           ("personal-acc-bottom10", "bottom10", 100, True), ("global-acc", "global", 100, True),
           ("unseen-acc", "unseen", 100, True), ("seconds-per-round", "s/round", 1, False),
           ("bytes-up", "MB up", 1e-6, False), ("bytes-down", "MB down", 1e-6, False))

#: Final metrics summarized per method in a study (those without values are left out).
STUDY_METRICS = ("personal-acc", "personal-acc-bottom10", "global-acc", "unseen-acc")
#: the final metrics a study can compare methods by (``--metric``): the accuracies, the
#: personal loss, and a language model's perplexities and next-token accuracy
COMPARABLE_METRICS = ("personal-acc", "personal-acc-unweighted", "personal-acc-bottom10",
                      "global-acc", "unseen-acc", "personal-acc-next", "personal-loss",
                      "personal-ppl", "global-ppl", "personal-macro-f1",
                      "personal-balanced-accuracy", "personal-auroc", "personal-mse",
                      "personal-mae", "personal-r2", "global-mse", "unseen-mse")
#: Names of the report file and the plot folder inside a results directory.
REPORT_FILE, PLOT_DIR = "report.md", "plots"
LEVEL = 0.95
CI_METHOD = ("two-sided 95% Student-t confidence intervals of the mean over seeds "
             "(mean ± t(0.975, n-1) · s / √n, with s the sample standard deviation and n - 1 "
             "degrees of freedom; none for n = 1). Accuracies, which lie in [0, 1], take that "
             "interval on the logit scale of the per-seed values and map it back, so it stays "
             "within [0, 1] (values of exactly 0 or 1 count as 0.001 or 0.999; equal values give "
             "a zero-width interval; the point shown is the plain mean, and the interval is "
             "widened to reach it in the rare case it misses it); paired differences keep the "
             "plain t interval")
#: Significance level of the tests across scenarios (Friedman, Nemenyi, Holm).
ALPHA = 0.05
#: The critical-difference diagram's file name (in the plot folder).
CD_PLOT = "cd.png"


def load(paths: list[str | Path]) -> list[dict]:
    """The results.json documents at ``paths`` (files, or directories holding one)."""
    runs = []
    for path in paths:
        path = Path(path)
        file = path / "results.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"No results.json at '{path}'.")
        runs.append(json.loads(file.read_text()))
    return runs


def summarize(runs: list[dict], markdown: bool = False) -> str:
    """One row per method (in first-seen order): mean ± std over the runs that have it.
    A study document counts as all of its runs."""
    methods: dict[str, list[dict]] = {}
    for doc in runs:
        for run in doc.get("runs", []) if doc.get("kind") == "study" else [doc]:
            for name, result in run.get("methods", {}).items():
                methods.setdefault(name, []).append(result.get("final", {}))
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
        return _markdown_table(header, rows, left=1)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*header)] + [fmt.format(*r) for r in rows])


# ---------------------------------------------------------------------------------------------
# Studies: runs grouped by (scenario, setting), methods compared over seeds
# ---------------------------------------------------------------------------------------------

@dataclass
class Group:
    """The runs of one (scenario, sweep setting), by seed."""

    scenario: str
    setting: dict
    runs: dict[int, dict] = field(default_factory=dict)
    #: the label without a scenario or setting (a single run's): its dataset
    fallback: str = "run"

    @property
    def label(self) -> str:
        parts = [p for p in (self.scenario, setting_label(self.setting)) if p]
        return " / ".join(parts) or self.fallback


def setting_label(setting: Mapping[str, object]) -> str:
    """``key=value, ...`` for a sweep setting ('' for none)."""
    return ", ".join(f"{k}={v}" for k, v in setting.items())


def study_runs(doc: Mapping) -> list[dict]:
    """The runs of a study document, or a single run's document as a study of one run (its
    scenario is the config's ``name`` or '', its seed the config's ``seed``, no setting)."""
    if doc.get("kind") == "study":
        return [dict(run, scenario=run.get("scenario", ""), seed=run.get("seed", 0),
                     setting=dict(run.get("setting") or {})) for run in doc.get("runs", [])]
    config = doc.get("config", {})
    return [dict(doc, scenario=str(doc.get("scenario") or config.get("name") or ""),
                 seed=doc.get("seed", config.get("seed", 0)),
                 setting=dict(doc.get("setting") or {}))]


def study_protocol(doc: Mapping) -> dict:
    """The study's protocol; for a single run, one derived from it."""
    if doc.get("kind") == "study":
        return dict(doc.get("protocol") or {})
    runs = study_runs(doc)
    regression = (runs[0].get("config") or {}).get("task") == "regression"
    return {"seeds": [runs[0]["seed"]], "reference": None,
            "metric": "personal-mse" if regression else "personal-acc",
            "scenarios": [runs[0]["scenario"]], "sweep": {}, "tune": None}


def group_runs(doc: Mapping) -> list[Group]:
    """Runs grouped by (scenario, setting): scenarios in the protocol's order (then first-seen),
    settings first-seen. A second run of the same cell and seed replaces the first."""
    groups: dict[tuple[str, str], Group] = {}
    for run in study_runs(doc):
        key = (run["scenario"], json.dumps(run["setting"], sort_keys=True))
        fallback = str((run.get("config") or {}).get("dataset") or "run")
        groups.setdefault(key, Group(run["scenario"], run["setting"], fallback=fallback)
                          ).runs[run["seed"]] = run
    order = [str(s) for s in study_protocol(doc).get("scenarios") or []]
    position = {s: i for i, s in enumerate(order)}
    return sorted(groups.values(), key=lambda g: position.get(g.scenario, len(order)))


def labels_in_groups(groups: Sequence[Group]) -> list[str]:
    """Every method label, first-seen order."""
    labels: dict[str, None] = {}
    for group in groups:
        for run in group.runs.values():
            labels.update(dict.fromkeys(run.get("methods", {})))
    return list(labels)


def _final(run: Mapping, label: str, key: str) -> float | None:
    value = run.get("methods", {}).get(label, {}).get("final", {}).get(key)
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _values(group: Group, label: str, key: str) -> dict[int, float]:
    """Seed -> the method's final ``key`` in that seed's run (seeds without it left out)."""
    found = {seed: _final(run, label, key) for seed, run in sorted(group.runs.items())}
    return {seed: v for seed, v in found.items() if v is not None}


#: why the report names a run whose final evaluation rejected client replies
PARTIAL_WHY = ("the final evaluation rejected client replies (a non-finite loss: the "
               "personalized model diverged; or a malformed reply), so their metrics cover only "
               "the clients that answered")


def _partial(group: Group, labels: Sequence[str]) -> list[dict]:
    """The runs in which :data:`PARTIAL_WHY`: the report names them beside the values."""
    out = []
    for label in labels:
        for seed, run in sorted(group.runs.items()):
            final = run.get("methods", {}).get(label, {}).get("final", {})
            if final.get("eval-rejected"):
                out.append({"method": label, "seed": seed, "rejected": final["eval-rejected"],
                            "evaluated": final.get("evaluated"),
                            "eval-clients": final.get("eval-clients")})
    return out


def _partial_text(group: Mapping) -> str:
    return "; ".join(f"{p['method']} seed {p['seed']}: {p['evaluated']} of {p['eval-clients']} "
                     f"clients ({p['rejected']} replies rejected)" for p in group["partial"])


def _total_bytes(group: Group, label: str) -> dict[int, float]:
    up, down = _values(group, label, "bytes-up"), _values(group, label, "bytes-down")
    return {seed: up[seed] + down[seed] for seed in up if seed in down}


def _seen_clients(group: Group, label: str) -> dict[int, list[dict]]:
    return {seed: [c for c in run["methods"][label].get("clients", []) if not c.get("unseen")]
            for seed, run in sorted(group.runs.items()) if label in run.get("methods", {})}


def _better(test: dict, high_first: bool) -> dict:
    """A paired comparison whose ``wins`` count the seeds where the method is better: where the
    difference is above 0 for a metric that is better high, below 0 for a loss or perplexity
    (whose ``losses`` then count the seeds where it is worse)."""
    if not high_first:
        test["wins"], test["losses"] = test["losses"], test["wins"]
    return test


def _summary_ci(values: Mapping[int, float], scale: str | None = None) -> dict:
    mean, low, high, n = stats.mean_ci(values.values(), LEVEL, scale=scale)
    return {"mean": mean, "low": low, "high": high, "n": n, "seeds": list(values),
            "values": list(values.values())}


def higher_is_better(metric: str) -> bool:
    """Accuracies rank high-first; losses and perplexities low-first
    (:func:`pflalign.outputs.stats.higher_is_better`)."""
    return stats.higher_is_better(metric)


def _choose_reference(reference: str | None, protocol: Mapping, labels: Sequence[str]) -> str:
    if reference is not None:
        if reference not in labels:
            raise ValueError(f"Unknown reference method '{reference}'; the results hold "
                             f"{', '.join(labels) or 'no methods'}.")
        return reference
    declared = protocol.get("reference")
    return declared if declared in labels else (labels[0] if labels else "")


def summarize_study(doc: Mapping, reference: str | None = None) -> dict:
    """Statistics of a study (or of a single run, as a study of one run), JSON-able (no NaN:
    missing numbers are None; accuracies are fractions).

    Returns ``{"protocol", "reference", "metric", "ci", "methods" (labels), "groups": [...],
    "average-rank": {label: mean rank over the groups}, "friedman", "holm-vs-reference"}``;
    ``friedman`` is :func:`pflalign.outputs.stats.friedman` over the groups' mean ``metric``
    (None for fewer than two groups or methods), ``holm-vs-reference`` is ``{"m", "tests":
    [{"group", "method", "p", "p-holm"}]}``, Holm's adjustment over every vs-reference paired
    t test of the study (each ``vs-reference`` also carries its ``p-holm``); each group is
    ``{"scenario", "setting", "label", "seeds", "best", "ranking", "methods": {label: {"method",
    "metrics": {key: {"mean", "low", "high", "n", "seeds", "values"}}, "total-bytes", "rank",
    "vs-reference", "vs-best-other", "clients-vs-reference"}}}`` (accuracy intervals are the
    bounded ones of :func:`pflalign.outputs.stats.mean_ci`). ``vs-reference`` and
    ``vs-best-other`` (against the best other method by mean; ``other`` names it) are
    :func:`pflalign.outputs.stats.paired` results on the protocol metric;
    ``clients-vs-reference`` is :func:`pflalign.outputs.stats.paired_clients` on the seen
    clients' personal-acc. ``reference`` overrides the protocol's (default: the protocol's, else
    the first method)."""
    protocol = study_protocol(doc)
    groups = group_runs(doc)
    labels = labels_in_groups(groups)
    reference = _choose_reference(reference, protocol, labels)
    metric = str(protocol.get("metric") or "personal-acc")
    keys = list(dict.fromkeys([metric, *STUDY_METRICS]))
    high_first = higher_is_better(metric)
    out_groups, all_ranks = [], {}
    for group in groups:
        present = [lb for lb in labels if any(lb in r.get("methods", {})
                                              for r in group.runs.values())]
        per_metric = {lb: _values(group, lb, metric) for lb in present}
        methods: dict[str, dict] = {}
        for lb in present:
            name = next(r["methods"][lb].get("method", lb) for r in group.runs.values()
                        if lb in r.get("methods", {}))
            metrics = {k: _summary_ci(_values(group, lb, k), stats.metric_scale(k))
                       for k in keys}
            methods[lb] = {"method": name,
                           "metrics": {k: v for k, v in metrics.items() if v["n"] or k == metric},
                           "total-bytes": _summary_ci(_total_bytes(group, lb))}
        means = {lb: methods[lb]["metrics"][metric]["mean"] for lb in present}
        group_ranks = stats.ranks(means, high_first)
        all_ranks[group.label] = group_ranks
        ranking = sorted(group_ranks, key=lambda lb: group_ranks[lb])
        for lb in present:
            entry = methods[lb]
            entry["rank"] = group_ranks.get(lb)
            has_ref = reference in methods and lb != reference
            entry["vs-reference"] = (_better(stats.paired(per_metric[lb], per_metric[reference],
                                                          LEVEL), high_first)
                                     if has_ref else None)
            entry["clients-vs-reference"] = (
                stats.paired_clients(_seen_clients(group, lb), _seen_clients(group, reference),
                                     "personal-acc", LEVEL) if has_ref else None)
            others = [o for o in ranking if o != lb]
            entry["vs-best-other"] = (dict(_better(stats.paired(
                per_metric[lb], per_metric[others[0]], LEVEL), high_first), other=others[0])
                                      if others else None)
        out_groups.append({"scenario": group.scenario, "setting": group.setting,
                           "label": group.label, "seeds": sorted(group.runs),
                           "best": ranking[0] if ranking else None, "ranking": ranking,
                           "methods": methods, "partial": _partial(group, present)})
    tests = [(g["label"], lb, e["vs-reference"]) for g in out_groups
             for lb, e in g["methods"].items()
             if e["vs-reference"] is not None and math.isfinite(e["vs-reference"]["p"])]
    adjusted = stats.holm([vs["p"] for _, _, vs in tests])
    for (_, _, vs), p_holm in zip(tests, adjusted, strict=True):
        vs["p-holm"] = p_holm
    holm = {"m": len(tests), "tests": [{"group": g, "method": lb, "p": vs["p"],
                                        "p-holm": vs["p-holm"]} for g, lb, vs in tests]}
    scores = {g["label"]: {lb: e["metrics"][metric]["mean"] for lb, e in g["methods"].items()}
              for g in out_groups}
    verdict = stats.friedman(scores, high_first, ALPHA)
    return json_safe({"protocol": protocol, "reference": reference, "metric": metric,
                       "ci": CI_METHOD, "methods": labels, "groups": out_groups,
                       "average-rank": stats.average_ranks(all_ranks), "friedman": verdict,
                       "holm-vs-reference": holm})


# ---------------------------------------------------------------------------------------------
# report.md
# ---------------------------------------------------------------------------------------------

def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i < left else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _scale(metric: str) -> float:
    return 100.0 if stats.is_fraction(metric) else 1.0


def _num(value: float | None, scale: float = 1.0, digits: int = 2, sign: bool = False) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value * scale:+.{digits}f}" if sign else f"{value * scale:.{digits}f}"


def _ci(entry: Mapping | None, scale: float, sign: bool = False) -> str:
    """``mean [low, high]`` (or just the mean when there is no interval)."""
    if not entry or entry.get("mean") is None:
        return "-"
    text = _num(entry["mean"], scale, sign=sign)
    if entry.get("low") is not None:
        low, high = _num(entry["low"], scale, sign=sign), _num(entry["high"], scale, sign=sign)
        text += f" [{low}, {high}]"
    return text


def _interval(entry: Mapping, scale: float) -> str:
    if entry.get("low") is None:
        return "- (n < 2)"
    return f"[{_num(entry['low'], scale, sign=True)}, {_num(entry['high'], scale, sign=True)}]"


def _rank(value: float | None) -> str:
    return "-" if value is None else (f"{value:g}")


def _significant(entry: Mapping) -> str:
    return "yes" if entry["significant"] else ("no (n < 2)" if entry["n"] < 2 else "no")


def _p(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return "< 0.0001" if value < 1e-4 else f"{value:.4f}"


def _seeds_text(seeds: Sequence) -> str:
    seeds = list(seeds)
    return f"seed{'s' if len(seeds) != 1 else ''} {', '.join(map(str, seeds)) or '-'}"


def _tuning_text(protocol: Mapping) -> str:
    tune = protocol.get("tune")
    if not tune:
        return "no tuning (each method at its configured values)"
    seeds = ", ".join(map(str, tune.get("tune-seeds") or [])) or "-"
    return (f"tuned ({tune.get('trials', '-')} trials per method, validation split of tuning "
            f"seeds {seeds})")


def _context(where: str, seeds: Sequence, summary: Mapping) -> str:
    """``where; seeds ...; tuning`` for a caption."""
    return f"{where}; {_seeds_text(seeds)}; {_tuning_text(summary['protocol'])}"


def _all_seeds(summary: Mapping) -> list:
    return sorted({s for g in summary["groups"] for s in g["seeds"]})


def _group_names(summary: Mapping) -> str:
    return ", ".join(g["label"] for g in summary["groups"])


def _params(params: Mapping[str, object]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "-"


#: the keys that parametrize each partition scheme (beside min-samples-per-client and
#: test-fraction, which every scheme has)
PARTITION_KEYS = {"dirichlet": ("dirichlet-alpha",), "pathological": ("classes-per-client",),
                  "quantity": ("quantity-power",),
                  "rotated": ("rotation-angles", "rotation-unseen-groups", "dirichlet-alpha")}
#: a run's local work, as the setup names it
LOCAL_WORK = ("local-epochs", "local-steps", "batch-size", "lr", "local-optimizer")


def _first_run(doc: Mapping) -> Mapping:
    """The document's first run (a single run is its own)."""
    return next(iter(doc.get("runs") or []), {}) if doc.get("kind") == "study" else doc


def _keys_text(config: Mapping, keys: Sequence[str]) -> str:
    return ", ".join(f"{k} = {config[k]}" for k in keys if k in config)


def _setup_section(summary: Mapping, doc: Mapping) -> list[str]:
    """What ran: the dataset (its source and content fingerprint), the model and its size, the
    partition, the clients, rounds and local work, every method's resolved hyperparameters
    (tuned ones marked), the engine and seeds, and the versions; read from the runs'
    results.json (what an older one lacks is left out)."""
    run = _first_run(doc)
    config, partition = run.get("config") or {}, run.get("partition") or {}
    if not config:
        return []
    lines = ["## Setup", ""]
    source = partition.get("dataset") or config.get("dataset")
    where = config.get("dataset")
    data = f"- Dataset: {source}" + (f" (`{where}`)" if where and where != source else "")
    if partition.get("samples") is not None:
        data += f", {partition['samples']:,} samples in use"
    if partition.get("fingerprint"):
        data += f", content fingerprint `{partition['fingerprint']}` (SHA-256 of the data)"
    lines.append(data)
    models = {}
    for entry in (run.get("methods") or {}).values():
        model = entry.get("model") or {}
        if model.get("name"):
            models.setdefault(model["name"], model.get("parameters"))
    if not models:
        models[config.get("model")] = None
    lines.append("- Model: " + "; ".join(
        f"{name}" + (f" ({count:,} trainable parameters)" if count else "")
        for name, count in models.items()))
    scheme = str(config.get("partition", "-"))
    args = [*PARTITION_KEYS.get(scheme, ()), "min-samples-per-client", "test-fraction"]
    if config.get("partition-args"):
        args.insert(0, "partition-args")
    lines.append(f"- Partition: {scheme} ({_keys_text(config, args)})")
    unseen = config.get("num-unseen-clients") or 0
    per_round = ("Poisson sampling, each client with probability fraction-train = "
                 f"{config.get('fraction-train')}" if config.get("sampling") == "poisson"
                 else f"fraction-train = {config.get('fraction-train')}")
    lines.append(f"- Clients: {config.get('num-clients')} training"
                 + (f" and {unseen} unseen (evaluated only)" if unseen else "")
                 + f"; per round {per_round}")
    lines.append(f"- Rounds: {config.get('rounds')}, evaluated every {config.get('eval-every')} "
                 f"and after the last, on the {config.get('evaluate-on', 'test')} split")
    lines.append(f"- Local work: {_keys_text(config, LOCAL_WORK)}")
    lines.append(f"- Engine: {config.get('engine')}; seeds: "
                 f"{', '.join(map(str, summary['protocol'].get('seeds') or _all_seeds(summary)))}")
    versions = run.get("versions") or {}
    if versions:
        lines.append("- Versions: " + ", ".join(
            f"{name} {versions[name]}" for name in ("pflalign", "torch", "flwr", "ray", "numpy",
                                                    "python") if name in versions)
            + (f"; commit `{versions['commit']}`" if versions.get("commit") else ""))
    tuned = _tuned_keys(summary["protocol"])
    rows = []
    for label, entry in (run.get("methods") or {}).items():
        values = entry.get("hyperparameters") or {}
        chosen = tuned.get(label, {})
        if values or entry.get("overrides"):
            cells = {**values, **(entry.get("overrides") or {})}
            rows.append([label, entry.get("method", label), ", ".join(
                f"{k} = {v}" + (" *" if k in chosen else "") for k, v in cells.items())])
    if rows:
        lines += ["", "Each method's hyperparameters as the run resolved them"
                  + (" (* chosen by tuning on validation data)" if tuned else "") + ":", "",
                  _markdown_table(["entry", "method", "hyperparameters"], rows, left=3)]
    return lines


def _tuned_keys(protocol: Mapping) -> dict[str, dict]:
    """Method label -> the values tuning chose for it (of its first scenario when tuned per
    scenario); empty without tuning."""
    tune = protocol.get("tune") or {}
    methods = tune.get("methods") or next(iter((tune.get("scenarios") or {}).values()), {})
    return {label: dict(info.get("chosen") or {}) for label, info in methods.items()}


def _protocol_section(summary: Mapping, doc: Mapping) -> list[str]:
    protocol = summary["protocol"]
    metric = summary["metric"]
    seeds = protocol.get("seeds") or sorted({s for g in summary["groups"] for s in g["seeds"]})
    lines = ["## Protocol", ""]
    if doc.get("command"):
        lines.append(f"- Command: `{doc['command']}`")
    lines.append(f"- Seeds: {', '.join(map(str, seeds))} (n = {len(seeds)})")
    scenarios = protocol.get("scenarios") or sorted({g["scenario"] for g in summary["groups"]})
    if any(scenarios):
        lines.append(f"- Scenarios: {', '.join(map(str, scenarios))}")
    lines.append(f"- Reference method: {summary['reference'] or '-'}"
                 + ("" if protocol.get("reference") in (None, summary["reference"])
                    else f" (the protocol named {protocol['reference']})"))
    lines.append(f"- Metric: final `{metric}` (accuracies in %, differences in percentage "
                 "points, pp)" if stats.is_fraction(metric) else f"- Metric: final `{metric}`")
    sweep = protocol.get("sweep") or {}
    if sweep:
        lines.append("- Sweep: " + "; ".join(f"`{k}` ∈ {{{', '.join(map(str, v))}}}"
                                              for k, v in sweep.items()))
    else:
        lines.append("- Sweep: none")
    lines.append(f"- Confidence intervals: {summary['ci']}.")
    sampled = [f"seed {run['seed']}: {note}" for run in study_runs(doc)
               for note in sample_notes(run.get("methods") or {})]
    if sampled:
        lines.append("- Evaluation of a sample of the clients (eval-clients): each final "
                     "metric below is the sample's, which estimates the whole population's; "
                     "the interval is for the population, from the one sample (a ratio "
                     "estimator with the finite-population correction):")
        lines += [f"  - {note}" for note in sampled]
    tune = protocol.get("tune")
    if not tune:
        lines.append("- Tuning: none (each method with its configured values)")
        return lines
    lines += ["", "### Tuning", "",
              f"- Trials per method: {tune.get('trials', '-')}; tuning seeds: "
              f"{', '.join(map(str, tune.get('tune-seeds') or [])) or '-'}; validation "
              f"fraction: {tune.get('validation-fraction', '-')}; objective: "
              f"{tune.get('objective', '-')}",
              "- The chosen values were then run on the evaluation seeds above; validation "
              "scores are means over the tuning seeds."]
    if tune.get("draw"):
        lines.append(f"- Trials: {tune['draw']}")
    scale = _scale(metric)  # the tuning's objective is the study's metric
    tables = tune.get("scenarios") or {}
    lines += _edge_lines(tables or {"": tune.get("methods") or {}}, metric, scale)
    if len(tables) > 1:  # one compact table per scenario: a row per method
        for scenario, methods in tables.items():
            rows = []
            for label, info in methods.items():
                chosen = info.get("chosen") or {}
                trials = "; ".join(
                    f"{_params(trial.get('params') or {})}: {_num(trial.get('score'), scale)}"
                    + (" ✓" if (trial.get("params") or {}) == chosen else "")
                    for trial in info.get("trials") or [])
                best = max((trial.get("score") for trial in info.get("trials") or []
                            if trial.get("score") is not None and math.isfinite(trial["score"])
                            and (trial.get("params") or {}) == chosen), default=None)
                at_edge = edges(info.get("space") or {}, chosen)
                rows.append([label, "; ".join(f"`{k}` ∈ {_space(v)}" for k, v in
                                              (info.get("space") or {}).items()) or "-",
                             _params(chosen) + "".join(f" ⚠ {k} at the {side} end"
                                                       for k, side in at_edge.items()),
                             _num(best, scale), trials or "-"])
            lines += ["", f"#### {scenario}", "",
                      f"Each method's trials on {scenario} (values: mean validation `{metric}` "
                      "over the tuning seeds; ✓ the chosen one, run on the evaluation seeds):",
                      "", _markdown_table(["method", "space", "chosen", "its score",
                                           "trials"], rows, left=5)]
        return lines
    for label, info in (tune.get("methods") or next(iter(tables.values()), {})).items():
        space = info.get("space") or {}
        lines += ["", f"#### {label}", "",
                  "- Space: " + ("; ".join(f"`{k}` ∈ {_space(v)}"
                                           for k, v in space.items()) or "-"),
                  f"- Default: {_params(info.get('default') or {})}",
                  f"- Chosen: {_params(info.get('chosen') or {})}"
                  + "".join(f" ⚠ {k} at the {side} end of its range" for k, side in
                            edges(space, info.get("chosen") or {}).items()), ""]
        chosen = info.get("chosen") or {}
        rows = []
        for i, trial in enumerate(info.get("trials") or [], start=1):
            params = trial.get("params") or {}
            rows.append([str(i), _params(params), _num(trial.get("score"), scale),
                         ", ".join(_num(s, scale) for s in trial.get("scores") or []) or "-",
                         "✓" if params == chosen else ""])
        if rows:
            lines.append(_markdown_table(["trial", "values", "validation score",
                                          "per tuning seed", "chosen"], rows, left=2))
    return lines


def _edge_lines(tables: Mapping[str, Mapping[str, dict]], metric: str, scale: float,
                ) -> list[str]:
    """The tuned choices that lie at an end of their range (:data:`EDGE_MARGIN` of its width),
    each with every trial's value of that key and score beside it, in the key's order."""
    found = []
    for scenario, methods in tables.items():
        for label, info in methods.items():
            chosen = info.get("chosen") or {}
            for key, side in edges(info.get("space") or {}, chosen).items():
                tried = sorted((((t.get("params") or {})[key], t.get("score"))
                                for t in info.get("trials") or []
                                if key in (t.get("params") or {})),
                               key=lambda pair: pair[0])  # a failed trial's score is None
                scores = ", ".join(f"{value:.4g}: {_num(score, scale)}"
                                   + (" ✓" if value == chosen[key] and score is not None
                                      else "")
                                   for value, score in tried)
                found.append(f"- {label}" + (f" on {scenario}" if scenario else "")
                             + f": `{key}` = {chosen[key]:.4g}, at the {side} end of "
                             f"{_space(info['space'][key])}; its trials (`{key}`: validation "
                             f"`{metric}`): {scores}")
    if not found:
        return []
    return ["", f"**Choices at a range's edge** (within {EDGE_MARGIN:.0%} of its width; the "
            "optimum may lie beyond the range, which then holds the method back):", "", *found]


def _space(values: object) -> str:
    """A declared search space as the tuning wrote it (``log-uniform [0.005, 0.2]``), or the
    grid of values of a study written before Optuna tuned (``{0.01, 0.1}``)."""
    if isinstance(values, str):
        return values
    return "{" + ", ".join(map(str, values)) + "}"  # type: ignore[call-overload]


def _leaderboard(summary: Mapping) -> list[str]:
    metric, groups = summary["metric"], summary["groups"]
    scale = _scale(metric)
    header = ["method"]
    for g in groups:
        prefix = f"{g['label']}: " if len(groups) > 1 else ""
        header += [f"{prefix}{metric} [95% CI]", f"{prefix}worst-10%", f"{prefix}rank"]
    header.append("avg rank")
    rows = []
    for label in summary["methods"]:
        row = [label]
        for g in groups:
            entry = g["methods"].get(label)
            if entry is None:
                row += ["-", "-", "-"]
                continue
            bottom = entry["metrics"].get("personal-acc-bottom10")
            mark = " †" if any(p["method"] == label for p in g.get("partial", [])) else ""
            row += [_ci(entry["metrics"][metric], scale) + mark,
                    _num(bottom["mean"], 100) if bottom else "-", _rank(entry["rank"])]
        row.append(_num(summary["average-rank"].get(label), digits=2))
        rows.append(row)
    return ["## Leaderboard", "",
            f"Mean final `{metric}` over seeds with its 95% CI, the mean worst-decile client "
            "accuracy (`personal-acc-bottom10`), and the rank by mean within each scenario "
            "(1 = best; ties share the average rank). The average rank is over the "
            f"{len(groups)} scenario/setting group(s). Scenarios: "
            f"{_context(_group_names(summary), _all_seeds(summary), summary)}.", "",
            _markdown_table(header, rows)] + _partial_note(groups)


def _partial_note(groups: Sequence[Mapping]) -> list[str]:
    partial = [f"{g['label']}: {_partial_text(g)}" for g in groups if g.get("partial")]
    if not partial:
        return []
    return ["", f"† In these runs {PARTIAL_WHY}: " + "; ".join(partial) + "."]


def leaderboard_text(doc: Mapping, reference: str | None = None) -> str:
    """The leaderboard of a study (or single run) as a Markdown table, for a terminal."""
    return "\n".join(_leaderboard(summarize_study(doc, reference))[4:])


def _group_section(group: Mapping, summary: Mapping, plots: Sequence[tuple[str, str]]) -> list[str]:
    metric, reference = summary["metric"], summary["reference"]
    scale = _scale(metric)
    unit = "pp" if scale == 100 else ""
    context = _context(group["label"], group["seeds"], summary)
    lines = [f"## {group['label']}", "",
             f"Seeds: {', '.join(map(str, group['seeds']))}.", "", "### Final metrics", "",
             f"Final metrics per method on {context}: mean over seeds with its 95% CI "
             "(accuracies: the logit-scale t interval, within [0, 100] %), traffic, and the "
             f"`{metric}` of each seed.", ""]
    keys = [k for k in dict.fromkeys([metric, *STUDY_METRICS])
            if any(k in e["metrics"] for e in group["methods"].values())]
    rows = []
    for label, entry in group["methods"].items():
        m = entry["metrics"]
        rows.append([label, str(m[metric]["n"])] + [_ci(m.get(k), _scale(k)) for k in keys]
                    + [_num(entry["total-bytes"]["mean"], 1e-6, 1),
                       ", ".join(_num(v, scale) for v in m[metric]["values"]) or "-"])
    lines += [_markdown_table(["method", "n"] + [f"{k} [95% CI]" for k in keys]
                              + ["MB up+down", f"{metric} per seed"], rows), ""]
    if group.get("partial"):
        lines += [f"**Partial evaluations.** In these runs {PARTIAL_WHY}: "
                  + _partial_text(group) + ".", ""]
    family = summary.get("holm-vs-reference", {}).get("m", 0)
    paired_rows = []
    for label, entry in group["methods"].items():
        vs, clients = entry["vs-reference"], entry["clients-vs-reference"]
        if vs is None:
            continue
        tests = [_p(vs.get("p")), _p(vs.get("p-holm"))] if family else []
        paired_rows.append([
            label, _num(vs["mean"], scale, sign=True), _interval(vs, scale),
            f"{vs['wins']}/{vs['n']}", _significant(vs), *tests,
            ", ".join(_num(d, scale, sign=True) for d in vs["diffs"]) or "-",
            _num(clients["client-mean"], 100, sign=True) if clients else "-",
            f"{clients['clients-ahead']}/{clients['clients-behind']}" if clients else "-"])
    if paired_rows:
        # with one seed there is no test to report: the p-value columns and Holm's family go
        tested = ("; p = the two-sided paired t test's p-value (n - 1 df); p (Holm) = that "
                  "p-value adjusted by Holm's step-down procedure over all "
                  f"{family} paired tests against {reference} in this report (every method "
                  "and scenario/setting group)" if family else
                  " (one seed per method: no interval and no test)")
        lines += [f"### Paired differences vs {reference}", "",
                  f"Each method minus {reference} on `{metric}` ({unit or 'units'}), paired by "
                  f"seed, on {context}. The CI is the plain t interval of the mean difference; "
                  f"significant = the CI excludes 0{tested}. Per client: clients matched by id "
                  "in each seed, differences averaged over seeds (seen clients' personal-acc); "
                  "ahead/behind = clients whose mean difference is above/below 0.", "",
                  _markdown_table(["method", f"mean diff ({unit})", f"95% CI ({unit})", "wins",
                                   "significant", *(["p", "p (Holm)"] if family else []),
                                   "per seed", f"per-client mean ({unit})",
                                   "clients ahead/behind"], paired_rows), ""]
    best_rows = []
    for label, entry in group["methods"].items():
        vs = entry["vs-best-other"]
        if vs is None:
            continue
        best_rows.append([label, vs["other"], _num(vs["mean"], scale, sign=True),
                          _interval(vs, scale), f"{vs['wins']}/{vs['n']}", _significant(vs)])
    if best_rows:
        lines += ["### Each method vs the best other method", "",
                  "Each method minus the best of the other methods by mean (the 'best other' "
                  f"column; for the leader: the runner-up, i.e. whether its lead is "
                  f"significant) on `{metric}` ({unit or 'units'}), paired by seed, on "
                  f"{context}. The CI is the plain t interval of the mean difference; "
                  "significant = the CI excludes 0. The rival is chosen after seeing the "
                  "means, so this table gives no p-values.", "",
                  _markdown_table(["method", "best other", f"mean diff ({unit})",
                                   f"95% CI ({unit})", "wins", "significant"], best_rows,
                                  left=2), ""]
        best = group["best"]
        lead = group["methods"][best]["vs-best-other"] if best else None
        if lead is not None:
            verdict = ("significant" if lead["significant"] else
                       "not significant (n < 2)" if lead["n"] < 2 else "not significant")
            interval = ("no CI" if lead["low"] is None
                        else f"95% CI {_interval(lead, scale)} {unit}".rstrip())
            lines += [f"**{best}** leads {lead['other']} by "
                      f"{_num(lead['mean'], scale, sign=True)} {unit} ({interval}, wins "
                      f"{lead['wins']}/{lead['n']}): {verdict}.", ""]
    if plots:
        lines += ["### Plots", ""]
        where = f"{_seeds_text(group['seeds'])}, {_tuning_text(summary['protocol'])}"
        for caption, rel in plots:
            lines += [f"![{caption}]({rel})", "", f"*{caption}, {where}.*", ""]
    return lines


def _verdict_section(summary: Mapping, cd_plot: str | None = None) -> list[str]:
    """The comparison across scenario/setting groups: Friedman, Iman-Davenport, Nemenyi, Holm
    (Demsar 2006), and every paired test against the reference with its Holm-adjusted p."""
    result = summary.get("friedman")
    if not result:
        return []
    metric, reference = summary["metric"], summary["reference"]
    alpha = result["alpha"]
    context = _context(", ".join(result["scenarios"]), _all_seeds(summary), summary)
    ff = "∞" if result["ff"] is None else f"{result['ff']:.2f}"
    rejected = result["ff-p"] is not None and result["ff-p"] < alpha
    lines = ["## Across scenarios: Friedman, Nemenyi, Holm", "",
             f"The {result['k']} methods that have a mean final `{metric}` in every one of the "
             f"{result['n']} scenario/setting groups, ranked within each group by that mean (1 = "
             "best, ties share the average rank), following Demšar (JMLR 7, 2006); "
             f"{context}."
             + (f" Left out (missing in some group): {', '.join(result['left-out'])}."
                if result["left-out"] else ""), "",
             f"- Friedman: χ²_F = {result['chi2']:.2f} with {result['chi2-df']} df, "
             f"p = {_p(result['chi2-p'])}",
             f"- Iman–Davenport: F_F = {ff} with ({result['ff-df'][0]}, {result['ff-df'][1]}) "
             f"df, p = {_p(result['ff-p'])}: equal average ranks are "
             + ("**rejected**" if rejected else "not rejected") + f" at α = {alpha:g}",
             f"- Nemenyi: q_{alpha:g} = {result['q']:.3f}, critical difference CD = q · "
             f"√(k(k+1)/(6N)) = {result['cd']:.2f}; two methods differ significantly when their "
             "average ranks differ by at least CD", ""]
    if not rejected:
        lines += ["The Friedman test does not reject equal ranks, so the post-hoc tests below "
                  "are shown for completeness; Demšar proceeds to them only after a rejection.",
                  ""]
    lines += [_markdown_table(["method", "average rank"],
                              [[m, f"{r:.3f}"] for m, r in result["average-rank"].items()]), ""]
    rows = [[pair["a"], pair["b"], f"{pair['rank-diff']:.3f}", f"{pair['z']:.2f}",
             _p(pair["p"]), _p(pair["p-holm"]), "yes" if pair["nemenyi"] else "no",
             "yes" if pair["holm"] else "no"] for pair in result["pairs"]]
    lines += [f"Every pair of methods (better average rank first) on {context}: the rank "
              f"difference, z = difference / √(k(k+1)/(6N)) = difference / {result['se']:.3f}, "
              f"its two-sided normal p-value, that p-value adjusted by Holm's step-down "
              f"procedure over the {len(rows)} pairs, and whether each test calls the pair "
              f"different at α = {alpha:g} (Nemenyi: difference ≥ CD; Holm: adjusted p < α).",
              "", _markdown_table(["method", "vs", "rank difference", "z", "p", "p (Holm)",
                                   "Nemenyi", "Holm"], rows, left=2), ""]
    if cd_plot:
        caption = (f"Critical-difference diagram: average rank by mean final `{metric}` of "
                   f"{result['k']} methods over {result['n']} scenario/setting groups ({context})"
                   f"; Nemenyi test at α = {alpha:g}, CD = {result['cd']:.2f}; methods joined "
                   f"by a thick line do not differ significantly (Iman–Davenport p = "
                   f"{_p(result['ff-p'])})")
        lines += [f"![Critical-difference diagram]({cd_plot})", "", f"*{caption}.*", ""]
    holm = summary.get("holm-vs-reference") or {}
    scale = _scale(metric)
    unit = "pp" if scale == 100 else "units"
    by_label = {g["label"]: g for g in summary["groups"]}
    rows = []
    for test in holm.get("tests", []):
        vs = by_label[test["group"]]["methods"][test["method"]]["vs-reference"]
        rows.append([test["group"], test["method"], _num(vs["mean"], scale, sign=True),
                     _interval(vs, scale), f"{vs['wins']}/{vs['n']}", _p(test["p"]),
                     _p(test["p-holm"])])
    if rows:
        lines += [f"### Paired t tests vs {reference}, all groups", "",
                  f"Each method minus {reference} on `{metric}` ({unit}), paired by seed, in "
                  f"each group ({context}): the two-sided paired t test's p-value (n - 1 df) "
                  f"and Holm's adjustment over these {holm['m']} tests.", "",
                  _markdown_table(["group", "method", f"mean diff ({unit})",
                                   f"95% CI ({unit})", "wins", "p", "p (Holm)"], rows,
                                  left=2), ""]
    return lines


def format_report(summary: Mapping, doc: Mapping,
                  plots: Mapping[str, Sequence[tuple[str, str]]] | None = None,
                  cd_plot: str | None = None) -> str:
    """report.md's text from :func:`summarize_study`'s ``summary``; ``plots`` maps a group
    label to its (caption, relative path) images (the report adds the seeds and the tuning to
    each caption); ``cd_plot`` is the critical-difference
    diagram's relative path (None: none drawn)."""
    plots = plots or {}
    kind = "Study" if doc.get("kind") == "study" else "Run"
    lines = [f"# {kind} report", "",
             "Generated from results.json by `python -m pflalign.outputs.report`.", ""]
    lines += _setup_section(summary, doc) + [""]
    lines += _protocol_section(summary, doc) + [""]
    lines += _leaderboard(summary) + [""]
    lines += _verdict_section(summary, cd_plot)
    runs = {g.label: g for g in group_runs(doc)}
    for group in summary["groups"]:
        lines += _group_section(group, summary, plots.get(group["label"], []))
        if group["label"] in runs:
            lines += _clients_section(runs[group["label"]])
    return "\n".join(lines).rstrip() + "\n"


#: the most clients the report lists one by one (results.csv has every client)
CLIENT_ROWS = 40


def _clients_section(group: Group) -> list[str]:
    """Each client's final personal score per method in the group's first seed, by the client's
    name where the data names it: accuracy in %, or a regression's mean squared error."""
    seed = min(group.runs)
    methods = group.runs[seed].get("methods", {})
    by_client: dict[int, dict] = {}
    regression = False
    for label, entry in methods.items():
        for client in entry.get("clients", []):
            row = by_client.setdefault(client["id"], {"who": client.get("name", client["id"]),
                                                      "unseen": client.get("unseen"),
                                                      "num-test": client.get("num-test")})
            regression = regression or "personal-mse" in client
            value = client.get("personal-mse" if "personal-mse" in client else "personal-acc")
            row[label] = "-" if value is None else (f"{value:.4g}" if "personal-mse" in client
                                                    else f"{100 * value:.2f}")
    if not by_client:
        return []
    what = "personal-mse" if regression else "personal-acc (%)"
    if len(by_client) > CLIENT_ROWS:
        return ["### Per client", "",
                f"{len(by_client)} clients: each one's final {what} per method is in "
                "results.csv (rows with a client).", ""]
    labels = list(methods)
    rows = [[str(row["who"]) + (" (unseen)" if row["unseen"] else ""), str(row["num-test"]),
             *(row.get(label, "-") for label in labels)]
            for _, row in sorted(by_client.items())]
    return ["### Per client", "",
            f"Each client's final {what} per method, seed {seed}, by its name where the data "
            "names it.", "", _markdown_table(["client", "test samples", *labels], rows), ""]


def write_report(out_dir: str | Path, doc: Mapping, reference: str | None = None) -> list[Path]:
    """Write ``out_dir/report.md`` and ``out_dir/plots/*.png`` for the study (or single run)
    ``doc``; returns the paths written (report.md first). Plots without data are not written;
    earlier plots of this report's kinds in ``plots/`` are replaced."""
    from pflalign.outputs import plots as plotting

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize_study(doc, reference)
    plot_dir = out / PLOT_DIR
    plotting.remove_old_plots(plot_dir)
    colors = plotting.method_colors(summary["methods"])
    images: dict[str, list[tuple[str, str]]] = {}
    written: list[Path] = []
    names = [slug(g["label"]) for g in summary["groups"]]
    for group, group_summary, name in zip(group_runs(doc), summary["groups"], names, strict=True):
        for caption, path in plotting.write_group_plots(plot_dir, name, group.runs,
                                                        group_summary, summary["reference"],
                                                        colors, summary["metric"]):
            images.setdefault(group.label, []).append(
                (caption, path.relative_to(out).as_posix()))
            written.append(path)
    cd_plot = None
    if summary.get("friedman"):
        path = plotting.plot_critical_difference(plot_dir / CD_PLOT, summary["friedman"],
                                                 summary["metric"])
        if path is not None:
            cd_plot = path.relative_to(out).as_posix()
            written.append(path)
    report = out / REPORT_FILE
    report.write_text(format_report(summary, doc, images, cd_plot))
    return [report, *written]


CSV_COLUMNS = ("scenario", "setting", "seed", "method", "round", "metric", "value", "client",
               "client-name")


def write_csv(path: str | Path, doc: Mapping) -> Path:
    """A tidy CSV of a results document: one row per scenario × setting × seed × method × round
    × metric (numeric metrics only), with the final metrics under round ``final``; then each
    client's final values (round ``final``, its id under ``client`` and its name, where the data
    names it, under ``client-name``; empty on the other rows). Written atomically."""
    path = Path(path)
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS)
        for run in study_runs(doc):
            setting = ";".join(f"{k}={v}" for k, v in run.get("setting", {}).items())
            head = (run.get("scenario", ""), setting, run.get("seed"))
            for label, result in run.get("methods", {}).items():
                rows = [(row.get("round"), row) for row in result.get("rounds", [])]
                rows.append(("final", result.get("final", {})))
                for number, row in rows:
                    for metric, value in row.items():
                        if metric == "round" or isinstance(value, bool) or not isinstance(
                                value, int | float):
                            continue
                        writer.writerow((*head, label, number, metric,
                                         repr(value) if isinstance(value, float) else value,
                                         "", ""))
                for client in result.get("clients", []):
                    for metric, value in client.items():
                        if metric in ("id", "name", "unseen") or isinstance(value, bool) \
                                or not isinstance(value, int | float):
                            continue
                        writer.writerow((*head, label, "final", metric,
                                         repr(value) if isinstance(value, float) else value,
                                         client.get("id"), client.get("name", "")))
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="results.json files or directories holding one")
    parser.add_argument("--reference", metavar="LABEL",
                        help="method to compare the others against (default: the study's "
                             "reference, else the first method); one path only")
    parser.add_argument("--table", action="store_true",
                        help="only print the mean ± std table (no report.md)")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args(argv)
    docs = load(args.paths)
    if len(args.paths) > 1 or args.table:
        if args.reference:
            parser.error("--reference applies to the report of one results directory")
        print(summarize(docs, markdown=args.markdown))
        return
    path = Path(args.paths[0])
    out = path if path.is_dir() else path.parent
    try:
        board = leaderboard_text(docs[0], args.reference)
    except ValueError as err:
        parser.error(str(err))
    written = write_report(out, docs[0], args.reference)
    print(board)
    print(f"\nWrote {written[0]} and {len(written) - 1} plot(s) in {out / PLOT_DIR}.")

if __name__ == "__main__":
    main()
