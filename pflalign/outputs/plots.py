"""The figures of a study report (matplotlib's Agg canvas, one PNG per figure, ~100 dpi).

Per scenario/setting group (``runs`` maps a seed to that seed's run dict, ``group`` is the
group's entry of :func:`pflalign.outputs.report.summarize_study`):

* ``accuracy-*``: personal accuracy per evaluated round, mean over seeds with a 95% t band;
* ``clients-*``: the final per-client personal accuracy per method, pooled over seeds;
* ``paired-*``: the forest plot of each method's mean paired difference from the reference;
* ``partition-*``: the first seed's partition as a clients × labels heatmap of training counts;
* ``diagnostics-*``: pFLAlign's per-round diagnostics (pflalign-family methods only);
* ``bytes-*``: total traffic (MB up + down) against final personal accuracy.

Across the groups, ``cd.png`` (:func:`plot_critical_difference`): Demsar's critical-difference
diagram of the methods' average ranks, from :func:`pflalign.outputs.stats.friedman`'s result.

Bands and whiskers of accuracies are the bounded (logit-scale) t intervals of
:func:`pflalign.outputs.stats.mean_ci`, so they stay within [0, 100] %; other quantities and
paired differences use the plain t interval.

A figure without data is not written. Figures are drawn without pyplot (no global state), with
fixed sizes, colours and jitter, and saved without a software tag, so equal inputs give equal
files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from pflalign.outputs import stats

DPI = 100
#: File name prefixes, one per kind of figure.
KINDS = ("accuracy", "metric", "simtime", "clients", "paired", "partition", "diagnostics",
         "bytes", "cd")
DIAGNOSTICS = (("mean-P", "mean P (preconditioner)"), ("mean-gamma", "mean γ"),
               ("delta-norm", "‖Δ‖ (personal offset norm)"), ("update-cosine", "update cosine"))
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf")


def method_colors(labels: Sequence[str]) -> dict[str, str]:
    """A fixed colour per method label (the same in every figure of a report)."""
    return {label: _PALETTE[i % len(_PALETTE)] for i, label in enumerate(labels)}


def remove_old_plots(plot_dir: Path) -> None:
    """Remove this module's earlier PNGs in ``plot_dir`` (other files are left alone)."""
    if plot_dir.is_dir():
        for path in sorted(plot_dir.glob("*.png")):
            if path.stem.split("-", 1)[0] in KINDS:
                path.unlink()


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png", metadata={"Software": None})
    return path


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _per_round(runs: Mapping[int, Mapping], label: str, key: str) -> list[tuple[int, tuple]]:
    """``[(round, mean_ci over seeds)]`` for the rounds where some seed recorded ``key``."""
    by_round: dict[int, list[float]] = {}
    for run in runs.values():
        for row in run.get("methods", {}).get(label, {}).get("rounds", []):
            if _finite(row.get(key)) and isinstance(row.get("round"), int):
                by_round.setdefault(row["round"], []).append(float(row[key]))
    scale = stats.metric_scale(key)
    return [(r, stats.mean_ci(v, scale=scale)) for r, v in sorted(by_round.items())]


def per_time(runs: Mapping[int, Mapping], label: str,
              key: str) -> list[tuple[float, tuple]]:
    """``[(simulated hours, mean_ci over seeds)]`` at equal simulated time: at each time some
    seed evaluated, every seed's last evaluation of ``key`` whose round ended by then (as
    ``time-budget`` reads a run), over the span where every seed has one. Empty without a
    clock (no ``sim-time`` in the rows)."""
    timelines = []
    for run in runs.values():
        rows = run.get("methods", {}).get(label, {}).get("rounds", [])
        points = sorted((float(r["sim-time"]), float(r[key])) for r in rows
                        if _finite(r.get(key)) and _finite(r.get("sim-time")))
        if not points:
            return []
        timelines.append(points)
    if not timelines:
        return []
    start = max(t[0][0] for t in timelines)
    end = min(t[-1][0] for t in timelines)
    grid = sorted({time for t in timelines for time, _ in t if start <= time <= end})
    out = []
    for time in grid:
        values = [next(v for s, v in reversed(t) if s <= time) for t in timelines]
        out.append((time / 3600.0, stats.mean_ci(values, scale=stats.metric_scale(key))))
    return out


def _clip_percent(ax: Axes) -> None:
    """Keep an accuracy axis within [-5, 105] % (bands stay in [0, 100] %; this leaves a
    margin and no more)."""
    low, high = ax.get_ylim()
    ax.set_ylim(max(low, -5.0), min(high, 105.0))


def _round_axis(ax: Axes) -> None:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _draw_band(ax: Axes, series: list[tuple[float, tuple]], scale: float, color: str,
               label: str) -> None:
    x = np.array([r for r, _ in series], dtype=float)
    mean = np.array([ci[0] for _, ci in series]) * scale
    low = np.array([ci[1] for _, ci in series]) * scale
    high = np.array([ci[2] for _, ci in series]) * scale
    ax.plot(x, mean, marker="o", markersize=3, color=color, label=label)
    has_band = np.isfinite(low) & np.isfinite(high)
    if has_band.any():
        ax.fill_between(x, np.where(has_band, low, mean), np.where(has_band, high, mean),
                        color=color, alpha=0.2, linewidth=0)


def _seed_note(runs: Mapping) -> str:
    n = len(runs)
    return f"{n} seed{'s' if n != 1 else ''}"


def _plot_accuracy(path: Path, series: Mapping[str, list], colors: Mapping[str, str],
                   xlabel: str, title: str, metric: str = "personal-acc") -> Path | None:
    """A metric (personal accuracy unless named), one band per method with data; ``None``
    when none has."""
    series = {lb: s for lb, s in series.items() if s}
    if not series:
        return None
    fraction = stats.is_fraction(metric)
    fig = _figure(7.5, 4.5)
    ax = fig.add_subplot()
    for lb, s in series.items():
        _draw_band(ax, s, 100 if fraction else 1, colors[lb], lb)
    ax.set_xlabel(xlabel)
    if xlabel == "round":
        _round_axis(ax)
    if fraction:
        _clip_percent(ax)
    ax.set_ylabel("personal accuracy (%)" if metric == "personal-acc"
                  else f"{metric} (%)" if fraction else metric)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def plot_accuracy_rounds(path: Path, runs: Mapping[int, Mapping], labels: Sequence[str],
                         colors: Mapping[str, str], title: str) -> Path | None:
    """Personal accuracy per evaluated round per method: mean over seeds, 95% t band."""
    return _plot_accuracy(
        path, {lb: _per_round(runs, lb, "personal-acc") for lb in labels}, colors, "round",
        f"{title}: personal accuracy per round\n(mean over {_seed_note(runs)}, 95% CI band)")


def plot_metric_rounds(path: Path, runs: Mapping[int, Mapping], labels: Sequence[str],
                       colors: Mapping[str, str], title: str, metric: str) -> Path | None:
    """A study's metric (``--metric``) per evaluated round per method, from round 0 when the
    runs evaluated before training (``eval-at-start``: a pretrained model's own value): mean
    over seeds, 95% band on the metric's scale."""
    start = " from round 0 (before training)" if any(
        row.get("round") == 0 for run in runs.values() for entry in run.get("methods", {})
        .values() for row in entry.get("rounds", [])) else ""
    return _plot_accuracy(
        path, {lb: _per_round(runs, lb, metric) for lb in labels}, colors, "round",
        f"{title}: {metric} per round{start}\n(mean over {_seed_note(runs)}, 95% CI band)",
        metric)


def plot_accuracy_time(path: Path, runs: Mapping[int, Mapping], labels: Sequence[str],
                       colors: Mapping[str, str], title: str) -> Path | None:
    """Personal accuracy against the simulated clock (runs with device profiles): at each
    simulated hour, every seed's last evaluation by then, mean over seeds with a 95% t band."""
    return _plot_accuracy(
        path, {lb: per_time(runs, lb, "personal-acc") for lb in labels}, colors,
        "simulated time (hours)", f"{title}: personal accuracy at equal simulated time\n(each "
        f"seed's last evaluation by then, mean over {_seed_note(runs)}, 95% CI band)")


def plot_client_distribution(path: Path, runs: Mapping[int, Mapping], labels: Sequence[str],
                             colors: Mapping[str, str], title: str) -> Path | None:
    """Box plot of the final per-client personal accuracy (seen clients), pooled over seeds,
    with the clients as jittered points."""
    data = {}
    for lb in labels:
        values = [float(c["personal-acc"]) * 100 for run in runs.values()
                  for c in run.get("methods", {}).get(lb, {}).get("clients", [])
                  if not c.get("unseen") and _finite(c.get("personal-acc"))]
        if values:
            data[lb] = values
    if not data:
        return None
    fig = _figure(max(5.0, 1.1 * len(data) + 2.5), 4.5)
    ax = fig.add_subplot()
    positions = np.arange(1, len(data) + 1)
    box = ax.boxplot(list(data.values()), positions=positions, widths=0.55, showfliers=False,
                     patch_artist=True, medianprops={"color": "black"})
    rng = np.random.default_rng(0)
    for pos, (lb, values), patch in zip(positions, data.items(), box["boxes"], strict=True):
        patch.set_facecolor(colors[lb])
        patch.set_alpha(0.35)
        ax.scatter(pos + rng.uniform(-0.18, 0.18, len(values)), values, s=10,
                   color=colors[lb], alpha=0.7, zorder=3)
    ax.set_xticks(positions)
    ax.set_xticklabels(list(data), rotation=20 if len(data) > 4 else 0, ha="right"
                       if len(data) > 4 else "center", fontsize=8)
    ax.set_ylabel("final personal accuracy per client (%)")
    ax.set_title(f"{title}: per-client accuracy\n(seen clients, pooled over {_seed_note(runs)})",
                 fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def plot_forest(path: Path, group: Mapping, reference: str, metric: str,
                colors: Mapping[str, str], title: str) -> Path | None:
    """Each method's mean paired difference from ``reference`` with its 95% CI whiskers."""
    rows = [(lb, e["vs-reference"]) for lb, e in group["methods"].items()
            if e.get("vs-reference") and e["vs-reference"]["n"] > 0]
    if not rows:
        return None
    scale = 100.0 if stats.is_fraction(metric) else 1.0
    fig = _figure(7.0, max(2.5, 0.55 * len(rows) + 1.6))
    ax = fig.add_subplot()
    for y, (lb, vs) in enumerate(reversed(rows)):
        mean = vs["mean"] * scale
        if vs["low"] is not None:
            err = [[mean - vs["low"] * scale], [vs["high"] * scale - mean]]
            ax.errorbar([mean], [y], xerr=err, fmt="o", color=colors[lb], capsize=4)
        else:
            ax.plot([mean], [y], "o", color=colors[lb])
        ax.annotate(f"{vs['wins']}/{vs['n']} wins" + (" *" if vs["significant"] else ""),
                    (mean, y), xytext=(0, 7), textcoords="offset points", ha="center",
                    fontsize=7)
    ax.axvline(0.0, color="black", linewidth=1, linestyle="--")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([lb for lb, _ in reversed(rows)], fontsize=8)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    unit = " (pp)" if scale == 100 else ""
    ax.set_xlabel(f"{metric}: method − {reference}{unit}, mean over seeds, 95% CI")
    ax.set_title(f"{title}: paired difference vs {reference} (* = CI excludes 0)", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def plot_partition(path: Path, run: Mapping, title: str) -> Path | None:
    """The partition of ``run`` as a clients × labels heatmap of training-sample counts."""
    clients = [c for c in run.get("partition", {}).get("clients", []) if c.get("train-labels")]
    if not clients:
        return None
    width = max(len(c["train-labels"]) for c in clients)
    counts = np.zeros((len(clients), width))
    for i, c in enumerate(clients):
        counts[i, :len(c["train-labels"])] = c["train-labels"]
    fig = _figure(max(5.0, 0.45 * width + 2.5), min(14.0, max(3.5, 0.22 * len(clients) + 1.8)))
    ax = fig.add_subplot()
    image = ax.imshow(counts, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="training samples")
    if len(clients) <= 20 and width <= 12:
        threshold = counts.max() / 2
        for (i, j), value in np.ndenumerate(counts):
            ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=6,
                    color="black" if value > threshold else "white")
    step = max(1, math.ceil(len(clients) / 40))
    ticks = list(range(0, len(clients), step))
    ax.set_yticks(ticks)
    ax.set_yticklabels([f"{clients[i].get('name', clients[i].get('id', i))}"
                        f"{'*' if clients[i].get('unseen') else ''}" for i in ticks], fontsize=7)
    classes = run.get("partition", {}).get("class-names") or []
    ax.set_xticks(range(width))
    ax.set_xticklabels([str(classes[i]) if i < len(classes) else str(i) for i in range(width)],
                       fontsize=8, rotation=45 if classes else 0,
                       ha="right" if classes else "center")
    ax.set_xlabel("label")
    ax.set_ylabel("client (* = unseen)" if any(c.get("unseen") for c in clients) else "client")
    dataset = run.get("partition", {}).get("dataset", "")
    ax.set_title(f"{title}: partition of seed {run.get('seed', '-')}"
                 + (f" ({dataset})" if dataset else ""), fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def pflalign_labels(runs: Mapping[int, Mapping], labels: Sequence[str]) -> list[str]:
    """The labels of pflalign-family methods (method name starting 'pflalign') whose rounds
    record some of pFLAlign's diagnostics."""
    found = []
    for lb in labels:
        for run in runs.values():
            result = run.get("methods", {}).get(lb)
            if (result and str(result.get("method", lb)).startswith("pflalign")
                    and any(_finite(row.get(k)) for row in result.get("rounds", [])
                            for k, _ in DIAGNOSTICS)):
                found.append(lb)
                break
    return found


def plot_diagnostics(path: Path, runs: Mapping[int, Mapping], labels: Sequence[str],
                     colors: Mapping[str, str], title: str) -> Path | None:
    """pFLAlign's diagnostics per round (one panel each; mean over seeds, 95% t band)."""
    family = pflalign_labels(runs, labels)
    if not family:
        return None
    fig = _figure(9.0, 6.0)
    axes = fig.subplots(2, 2).ravel()
    for ax, (key, name) in zip(axes, DIAGNOSTICS, strict=True):
        drawn = False
        for lb in family:
            series = _per_round(runs, lb, key)
            if series:
                _draw_band(ax, series, 1.0, colors[lb], lb)
                drawn = True
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("round", fontsize=8)
        _round_axis(ax)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"{title}: pFLAlign diagnostics per round (mean over {_seed_note(runs)}, "
                 "95% CI band)", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def plot_bytes_accuracy(path: Path, group: Mapping, colors: Mapping[str, str],
                        title: str) -> Path | None:
    """Total traffic (MB up + down) against final personal accuracy per method, with 95% CI
    whiskers on both."""
    points = []
    for lb, entry in group["methods"].items():
        acc, traffic = entry["metrics"].get("personal-acc"), entry.get("total-bytes")
        if acc and traffic and acc["mean"] is not None and traffic["mean"] is not None:
            points.append((lb, acc, traffic))
    if not points:
        return None
    fig = _figure(7.0, 4.5)
    ax = fig.add_subplot()

    def whisker(entry: Mapping, scale: float) -> list[list[float]] | None:
        if entry["low"] is None:
            return None
        mean = entry["mean"] * scale
        return [[mean - entry["low"] * scale], [entry["high"] * scale - mean]]

    for lb, acc, traffic in points:  # exact positions: methods with equal traffic share an x
        x, y = traffic["mean"] / 1e6, acc["mean"] * 100
        ax.errorbar([x], [y], xerr=whisker(traffic, 1e-6), yerr=whisker(acc, 100), fmt="o",
                    color=colors[lb], capsize=4, label=lb)
        ax.annotate(lb, (x, y), xytext=(5, 3), textcoords="offset points", fontsize=7)
    ax.autoscale_view()
    ax.set_xlabel("total traffic, MB (up + down, whole run)")
    ax.set_ylabel("final personal accuracy (%)")
    ax.margins(0.15)
    _clip_percent(ax)
    ax.set_title(f"{title}: traffic vs accuracy (mean, 95% CI)", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def plot_critical_difference(path: Path, result: Mapping,
                             metric: str = "personal-acc") -> Path | None:
    """Demsar's critical-difference diagram from :func:`pflalign.outputs.stats.friedman`'s
    ``result``: the methods on an average-rank axis (1 = best, at the left), each joined to its
    label by an elbow line (the better half labelled on the left, the rest on the right), a
    bar of length CD above the axis, and under it one thick line per group of methods whose
    average ranks differ by less than CD (not significantly different by Nemenyi's test)."""
    average = result.get("average-rank") or {}
    if len(average) < 2 or result.get("cd") is None:
        return None
    names = list(average)  # best first
    k, cd = len(names), float(result["cd"])
    groups = result.get("groups") or []
    half = math.ceil(k / 2)
    step = 0.32
    group_top = -0.28
    label_top = group_top - 0.16 * len(groups) - 0.2
    bottom = label_top - step * (max(half, k - half) - 1) - 0.3
    fig = _figure(8.0, 1.3 + 0.42 * (-bottom))
    ax = fig.add_subplot()
    ax.set_axis_off()
    low_end, high_end = 1.0, float(max(k, 2))
    pad = 0.08 * (high_end - low_end)
    ax.plot([low_end, high_end], [0, 0], color="black", linewidth=1.2)
    for tick in range(1, int(high_end) + 1):
        ax.plot([tick, tick], [0, 0.07], color="black", linewidth=1)
        ax.text(tick, 0.12, str(tick), ha="center", va="bottom", fontsize=9)
    bar_y = 0.72
    ax.plot([low_end, low_end + cd], [bar_y, bar_y], color="black", linewidth=1.5)
    for end in (low_end, low_end + cd):
        ax.plot([end, end], [bar_y - 0.05, bar_y + 0.05], color="black", linewidth=1.5)
    ax.text(low_end + cd / 2, bar_y + 0.08, f"CD = {cd:.2f}", ha="center", va="bottom",
            fontsize=9)
    for i, name in enumerate(names):
        rank = float(average[name])
        left = i < half
        y = label_top - step * (i if left else k - 1 - i)
        x_label = low_end - pad if left else high_end + pad
        ax.plot([rank, rank, x_label], [0, y, y], color="#444444", linewidth=0.9)
        ax.text(x_label - 0.02 * (1 if left else -1) * (high_end - low_end + 1), y,
                f"{name} ({rank:.2f})", ha="right" if left else "left", va="center",
                fontsize=9)
    for j, members in enumerate(groups):
        ranks_in = [float(average[m]) for m in members if m in average]
        if len(ranks_in) < 2:
            continue
        y = group_top - 0.16 * j
        ax.plot([min(ranks_in) - 0.03, max(ranks_in) + 0.03], [y, y], color="black",
                linewidth=4, solid_capstyle="round")
    ax.set_xlim(low_end - pad, max(high_end, low_end + cd) + pad)
    ax.set_ylim(bottom, bar_y + 0.35)
    alpha = result.get("alpha", 0.05)
    p_text = result.get("ff-p")
    ax.set_title(f"Average rank (1 = best) by final {metric} over {result.get('n', '?')} "
                 "scenarios "
                 f"(Nemenyi, α = {alpha:g}; Iman–Davenport p = "
                 + ("-" if p_text is None else f"{p_text:.3g}") + ")", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png", metadata={"Software": None}, bbox_inches="tight",
                pad_inches=0.15)
    return path


def write_group_plots(plot_dir: Path, name: str, runs: Mapping[int, Mapping], group: Mapping,
                      reference: str, colors: Mapping[str, str],
                      metric: str = "personal-acc") -> list[tuple[str, Path]]:
    """Every figure of one scenario/setting group that has data, as ``(caption, path)``; files
    are ``plot_dir/<kind>-<name>.png`` (``<kind>.png`` when ``name`` is empty). ``metric`` is
    the one the group's paired differences are on."""
    plot_dir = Path(plot_dir)
    labels = list(group["methods"])
    title = group.get("label") or "run"

    def file(kind: str) -> Path:
        return plot_dir / (f"{kind}-{name}.png" if name else f"{kind}.png")

    first = runs[min(runs)] if runs else {}
    made = [
        ("Personal accuracy per round", plot_accuracy_rounds(file("accuracy"), runs, labels,
                                                             colors, title)),
        (f"{metric} per round", plot_metric_rounds(file("metric"), runs, labels, colors,
                                                   title, metric)
         if metric != "personal-acc" else None),
        ("Personal accuracy by simulated time", plot_accuracy_time(
            file("simtime"), runs, labels, colors, title)),
        ("Per-client accuracy", plot_client_distribution(file("clients"), runs, labels, colors,
                                                         title)),
        (f"Paired differences vs {reference}", plot_forest(
            file("paired"), group, reference, metric, colors, title)),
        ("Partition (clients × labels)", plot_partition(file("partition"), first, title)),
        ("pFLAlign diagnostics", plot_diagnostics(file("diagnostics"), runs, labels, colors,
                                                  title)),
        ("Traffic vs accuracy", plot_bytes_accuracy(file("bytes"), group, colors, title)),
    ]
    return [(f"{caption} ({title})", path) for caption, path in made if path is not None]

