"""Small-sample statistics for comparing methods over seeds and scenarios.

The distributions (Student's t, normal, chi-squared, F, studentized range) are SciPy's
(``scipy.stats``); this module holds the procedures built on them.

* :func:`t_critical`: the two-sided critical value of Student's t.
* :func:`mean_ci`: the mean of a few values and its two-sided t confidence interval (n - 1 df);
  with ``bounded=True`` (values in [0, 1], e.g. accuracies) the interval is the t interval of
  the values' logits mapped back (:func:`logit_interval`), so it stays inside [0, 1].
* :func:`paired`: two methods' per-seed values matched by seed: differences, their mean, t
  interval and two-sided paired-t p-value, wins / losses / ties, and whether the interval
  excludes zero (differences keep their own, unbounded, scale).
* :func:`paired_clients`: per-client differences (clients matched by id within each seed),
  averaged over seeds per client and pooled over all (seed, client) pairs.
* :func:`ranks` / :func:`average_ranks`: ranks of methods within a scenario (1 = best, ties
  share the average of the ranks they span) and their mean over scenarios.
* :func:`holm`: Holm's step-down adjustment of a family of p-values.
* :func:`friedman`: Demsar's (2006) comparison of k methods over N scenarios: Friedman's
  chi-squared and Iman-Davenport's F on the average ranks (:func:`friedman_statistics`), the
  Nemenyi critical difference (:func:`nemenyi_q`), every pair's z-test with Holm's adjustment,
  and the groups of methods whose average ranks differ by less than the critical difference
  (:func:`nemenyi_groups`).

J. Demsar, "Statistical Comparisons of Classifiers over Multiple Data Sets", Journal of
Machine Learning Research 7 (2006) 1-30.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence

#: Values of a bounded metric at exactly 0 or 1 are moved this far inside before their logit
#: is taken (0.1 percentage point for an accuracy).
UNIT_EPS = 1e-3
#: A metric name with 'acc' or 'accuracy' as one of its dash-separated words.
_ACCURACY = re.compile(r"(^|-)acc(uracy)?(-|$)")


def _scipy_stats():
    """``scipy.stats``, imported on first use: it takes about a second to load, and the command
    line imports this module (through the report) before any run."""
    from scipy import stats

    return stats


def t_critical(df: float, level: float = 0.95) -> float:
    """The two-sided critical value: ``t`` with P(|T| <= t) = ``level`` for Student's t with
    ``df`` degrees of freedom."""
    if not 0.0 < level < 1.0:
        raise ValueError("The confidence level must be in (0, 1).")
    if df <= 0:
        raise ValueError("Student's t needs df > 0.")
    return float(_scipy_stats().t.ppf(0.5 + level / 2.0, df))


def is_fraction(metric: str) -> bool:
    """Whether a metric is a fraction in [0, 1]: the accuracies, whose names hold 'acc' (or
    'accuracy') as a whole dash-separated word: personal-acc, personal-acc-bottom10,
    global-acc, unseen-acc, ... (not gga-accepted, a count). Losses, perplexities, times and
    bytes are not bounded above."""
    return bool(_ACCURACY.search(metric))


#: metrics whose direction and range their name does not say: (higher is better, the range of
#: :data:`SCALES`): the scores beyond accuracy (``eval-metrics``)
DECLARED: dict[str, tuple[bool, str | None]] = {
    "personal-macro-f1": (True, "fraction"), "personal-balanced-accuracy": (True, "fraction"),
    "personal-auroc": (True, "fraction"),
    # task = regression
    "personal-mse": (False, "positive"), "personal-mae": (False, "positive"),
    "global-mse": (False, "positive"), "unseen-mse": (False, "positive"),
    "personal-r2": (True, None),
    # attack = backdoor: the share of triggered test samples taken for the target
    "personal-backdoor-asr": (False, "fraction")}


def metric_scale(metric: str) -> str | None:
    """The range a metric lives in, for its intervals (:data:`SCALES`): as :data:`DECLARED`
    says, else ``fraction`` for the accuracies (:func:`is_fraction`), ``above-one`` for
    perplexities (names ending in ``ppl``), ``positive`` for losses (ending in ``loss``), None
    (unbounded) for anything else."""
    if metric in DECLARED:
        return DECLARED[metric][1]
    if is_fraction(metric):
        return "fraction"
    if metric.endswith("ppl"):
        return "above-one"
    if metric.endswith("loss"):
        return "positive"
    return None


def higher_is_better(metric: str) -> bool:
    """A metric's direction: as :data:`DECLARED` says, else lower is better for losses and
    perplexities, higher for the rest."""
    if metric in DECLARED:
        return DECLARED[metric][0]
    return not (metric.endswith("loss") or metric.endswith("ppl"))


def _finite(values: Iterable[object]) -> list[float]:
    return [float(v) for v in values
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)]


def _mean_sd(xs: Sequence[float]) -> tuple[float, float]:
    mean = math.fsum(xs) / len(xs)
    return mean, math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def _logit(x: float) -> float:
    x = min(max(x, UNIT_EPS), 1.0 - UNIT_EPS)
    return math.log(x / (1.0 - x))


def _expit(y: float) -> float:
    return 1.0 / (1.0 + math.exp(-y)) if y >= 0 else math.exp(y) / (1.0 + math.exp(y))


def _log_above(bound: float):
    def forward(x: float) -> float:
        return math.log(max(x - bound, UNIT_EPS))
    return forward


def _exp_above(bound: float):
    def back(y: float) -> float:
        return bound + math.exp(min(y, 700.0))
    return back


#: scale -> (the values' range, the transform the t interval is taken on, its inverse): an
#: accuracy's logit, a loss's log, a perplexity's log(ppl - 1); values at a bound are moved
#: UNIT_EPS inside first
SCALES = {
    "fraction": ((0.0, 1.0), _logit, _expit),
    "positive": ((0.0, math.inf), _log_above(0.0), _exp_above(0.0)),
    "above-one": ((1.0, math.inf), _log_above(1.0), _exp_above(1.0)),
}


def scaled_interval(xs: Sequence[float], level: float = 0.95,
                    scale: str = "fraction") -> tuple[float, float]:
    """The t interval of bounded values taken on a scale that opens their range
    (:data:`SCALES`) and mapped back: for ``fraction``, with ``y_i = logit(x_i)`` (``x_i``
    clamped to [UNIT_EPS, 1 - UNIT_EPS]), ``expit(mean(y) ± t_{(1+level)/2, n-1} * s_y /
    sqrt(n))``. Inside the range by construction; close to the plain t interval away from the
    bounds, longer on the side away from a bound near it. Two rules keep it beside the plain
    mean it is printed with: equal values give the zero-width interval at that value, and an
    interval that misses the plain mean (possible with a far outlier, as the back-transformed
    centre is not the mean) is widened to reach it. Needs at least two values."""
    if len(xs) < 2:
        raise ValueError("An interval needs at least two values.")
    (lowest, highest), forward, back = SCALES[scale]
    if not all(lowest <= x <= highest for x in xs):
        raise ValueError(f"A {scale} interval needs values in [{lowest:g}, {highest:g}].")
    mean = math.fsum(xs) / len(xs)
    if all(x == xs[0] for x in xs):
        return mean, mean
    centre, sd = _mean_sd([forward(x) for x in xs])
    half = t_critical(len(xs) - 1, level) * sd / math.sqrt(len(xs))
    low, high = back(centre - half), back(centre + half)
    return min(low, mean), max(high, mean)


def logit_interval(xs: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """:func:`scaled_interval` of values in [0, 1] (the accuracies)."""
    return scaled_interval(xs, level, "fraction")


def mean_ci(values: Iterable[float | None], level: float = 0.95,
            bounded: bool = False, scale: str | None = None,
            ) -> tuple[float, float, float, int]:
    """``(mean, low, high, n)``: the mean of the finite values and its two-sided t interval,
    ``mean ± t_{(1+level)/2, n-1} * s / sqrt(n)`` with ``s`` the sample standard deviation;
    with a ``scale`` (:data:`SCALES`, e.g. :func:`metric_scale`'s) the interval is
    :func:`scaled_interval`'s and the mean stays the plain mean; ``bounded`` is the scale
    ``fraction`` (values in [0, 1]). One value gives ``(x, nan, nan, 1)``; none gives
    ``(nan, nan, nan, 0)``."""
    xs = _finite(values)
    n = len(xs)
    if n == 0:
        return math.nan, math.nan, math.nan, 0
    mean = math.fsum(xs) / n
    if n == 1:
        return mean, math.nan, math.nan, 1
    scale = "fraction" if bounded else scale
    if scale is not None:
        low, high = scaled_interval(xs, level, scale)
        return mean, low, high, n
    _, sd = _mean_sd(xs)
    half = t_critical(n - 1, level) * sd / math.sqrt(n)
    return mean, mean - half, mean + half, n


def _counts(diffs: Sequence[float]) -> dict[str, int]:
    return {"wins": sum(d > 0 for d in diffs), "losses": sum(d < 0 for d in diffs),
            "ties": sum(d == 0 for d in diffs)}


def _paired_p(diffs: Sequence[float]) -> float:
    """Two-sided p-value of the paired t test (mean difference 0), n - 1 df; equal
    differences give p = 0 (nonzero) or 1 (all zero)."""
    mean, sd = _mean_sd(diffs)
    if sd == 0.0:
        return 1.0 if mean == 0.0 else 0.0
    t = mean / (sd / math.sqrt(len(diffs)))
    return float(2.0 * _scipy_stats().t.sf(abs(t), len(diffs) - 1))


def paired(values_a: Mapping[int, float | None], values_b: Mapping[int, float | None],
           level: float = 0.95) -> dict:
    """Compare two methods on the seeds both have a finite value for.

    Returns ``{"seeds", "diffs" (a - b per seed, in seed order), "mean", "low", "high", "n",
    "p", "wins" (a > b), "losses", "ties", "significant"}``; the interval is the plain t
    interval of the mean difference (differences are not bounded like the values), ``p`` the
    two-sided paired-t p-value (NaN for n < 2), and ``significant`` is True when the interval
    excludes 0 (never for n < 2)."""
    seeds = sorted(s for s in values_a if s in values_b
                   and _finite([values_a[s]]) and _finite([values_b[s]]))
    diffs = [float(values_a[s]) - float(values_b[s]) for s in seeds]
    mean, low, high, n = mean_ci(diffs, level)
    significant = n >= 2 and (low > 0 or high < 0)
    return {"seeds": seeds, "diffs": diffs, "mean": mean, "low": low, "high": high, "n": n,
            "p": _paired_p(diffs) if n >= 2 else math.nan, **_counts(diffs),
            "significant": bool(significant)}


def paired_clients(clients_a: Mapping[int, Sequence[Mapping]],
                   clients_b: Mapping[int, Sequence[Mapping]], key: str = "personal-acc",
                   level: float = 0.95) -> dict:
    """Per-client differences ``a - b`` of ``key``, clients matched by ``id`` within each seed
    (``clients_*`` map a seed to that run's per-client list).

    Returns ``{"clients": [{"id", "diff" (mean over seeds), "seeds"}] sorted by id, "pairs"
    (every (seed, client) difference, flattened), "n-pairs", "mean" (over pairs), "wins",
    "losses", "ties" (over pairs), "clients-ahead" / "clients-behind" (clients whose mean over
    seeds is above / below 0), "client-mean", "client-low", "client-high" (the t interval over
    the per-client means; descriptive, since clients share the models they are scored on)}."""
    per_client: dict[int, list[float]] = {}
    pairs: list[float] = []
    for seed in sorted(s for s in clients_a if s in clients_b):
        b_by_id = {c.get("id"): c.get(key) for c in clients_b[seed]}
        for client in clients_a[seed]:
            cid = client.get("id")
            if cid not in b_by_id:
                continue
            a_val, b_val = _finite([client.get(key)]), _finite([b_by_id[cid]])
            if a_val and b_val:
                diff = a_val[0] - b_val[0]
                per_client.setdefault(cid, []).append(diff)
                pairs.append(diff)
    clients = [{"id": cid, "diff": math.fsum(d) / len(d), "seeds": len(d)}
               for cid, d in sorted(per_client.items(), key=lambda item: str(item[0]))]
    client_mean, client_low, client_high, _ = mean_ci([c["diff"] for c in clients], level)
    return {"clients": clients, "pairs": pairs, "n-pairs": len(pairs),
            "mean": math.fsum(pairs) / len(pairs) if pairs else math.nan, **_counts(pairs),
            "clients-ahead": sum(c["diff"] > 0 for c in clients),
            "clients-behind": sum(c["diff"] < 0 for c in clients),
            "client-mean": client_mean, "client-low": client_low, "client-high": client_high}


def ranks(scores: Mapping[str, float | None], higher_is_better: bool = True) -> dict[str, float]:
    """Rank methods by score (1 = best); tied scores share the mean of the ranks they span.
    Methods without a finite score get no rank (they are left out)."""
    scored = [(name, float(v)) for name, v in scores.items() if _finite([v])]
    scored.sort(key=lambda item: -item[1] if higher_is_better else item[1])
    result: dict[str, float] = {}
    i = 0
    while i < len(scored):
        j = i
        while j + 1 < len(scored) and scored[j + 1][1] == scored[i][1]:
            j += 1
        shared = (i + 1 + j + 1) / 2.0
        for name, _ in scored[i:j + 1]:
            result[name] = shared
        i = j + 1
    return result


def average_ranks(per_scenario: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """The mean rank of each method over the scenarios it is ranked in (``per_scenario`` maps a
    scenario to the output of :func:`ranks`); methods in first-seen order."""
    collected: dict[str, list[float]] = {}
    for scenario_ranks in per_scenario.values():
        for name, rank in scenario_ranks.items():
            collected.setdefault(name, []).append(rank)
    return {name: math.fsum(r) / len(r) for name, r in collected.items()}


# ---------------------------------------------------------------------------------------------
# Many methods over many scenarios (Demsar 2006)
# ---------------------------------------------------------------------------------------------

def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values, in the input's order: with the m finite p-values
    sorted, ``p_(1) <= ... <= p_(m)``, the i-th adjusted value is ``max_{j <= i} min(1,
    (m - j + 1) p_(j))``; a hypothesis is rejected at level alpha when its adjusted p-value is
    below alpha, which is Holm's procedure (stop at the first ``p_(i) >= alpha / (m - i + 1)``).
    Missing values (None, NaN) stay None and do not count in m."""
    finite = sorted((float(p), i) for i, p in enumerate(pvalues) if _finite([p]))
    m = len(finite)
    adjusted: list[float | None] = [None] * len(pvalues)
    running = 0.0
    for j, (p, i) in enumerate(finite):
        running = max(running, min(1.0, (m - j) * p))
        adjusted[i] = running
    return adjusted


def friedman_statistics(average: Sequence[float], n: int) -> tuple[float, float]:
    """``(chi2_F, F_F)`` from the average ranks of k methods over ``n`` scenarios (Demsar 2006,
    section 3.2.2): ``chi2_F = 12 n / (k (k + 1)) * (sum_j R_j^2 - k (k + 1)^2 / 4)`` (the
    statistic without a correction for ties), chi-squared with k - 1 df, and Iman and
    Davenport's ``F_F = (n - 1) chi2_F / (n (k - 1) - chi2_F)``, F with k - 1 and
    (k - 1)(n - 1) df (infinite when every scenario ranks the methods alike, without ties)."""
    k = len(average)
    chi2 = 12.0 * n / (k * (k + 1)) * (math.fsum(r * r for r in average) - k * (k + 1) ** 2 / 4)
    denominator = n * (k - 1) - chi2
    ff = (n - 1) * chi2 / denominator if denominator > 1e-12 else math.inf
    return chi2, ff


def nemenyi_q(k: int, alpha: float = 0.05) -> float:
    """Nemenyi's critical value for k methods: the studentized range's ``1 - alpha`` quantile
    for k groups and infinite df, divided by sqrt(2) (Demsar's Table 5a: 2.569 for k = 4)."""
    if k < 2:
        raise ValueError("Nemenyi's test needs at least two methods.")
    return float(_scipy_stats().studentized_range.ppf(1.0 - alpha, k, math.inf) / math.sqrt(2.0))


def nemenyi_groups(average: Mapping[str, float], cd: float) -> list[list[str]]:
    """The maximal runs of methods, ordered by average rank (best first), whose average ranks
    all differ by less than ``cd`` (no pair in a run is significantly different by Nemenyi's
    test); a method no other is within ``cd`` of forms no run. These are the thick lines of a
    critical-difference diagram."""
    order = sorted(average, key=lambda name: average[name])
    groups: list[list[str]] = []
    last_end = -1
    for i, name in enumerate(order):
        j = i
        while j + 1 < len(order) and average[order[j + 1]] - average[name] < cd:
            j += 1
        if j > i and j > last_end:
            groups.append(order[i:j + 1])
            last_end = j
    return groups


def friedman(scores: Mapping[str, Mapping[str, float | None]], higher_is_better: bool = True,
             alpha: float = 0.05) -> dict | None:
    """Demsar's comparison of methods over scenarios. ``scores`` maps a scenario to each
    method's score (the mean over seeds); only methods with a finite score in every scenario
    take part (the others are listed in ``left-out``), and they are ranked within each
    scenario (1 = best, ties averaged). None with fewer than 2 such methods or 2 scenarios.

    Returns ``{"scenarios", "methods", "left-out", "n" (scenarios), "k" (methods),
    "average-rank", "chi2", "chi2-df", "chi2-p", "ff", "ff-df" ([k - 1, (k - 1)(n - 1)]),
    "ff-p", "alpha", "q", "cd", "se", "pairs", "groups"}``: every pair (in rank order) as
    ``{"a", "b", "rank-diff" (R_b - R_a), "z" (rank-diff / se, se = sqrt(k (k + 1) / (6 n))),
    "p" (two-sided normal), "p-holm" (Holm over the k (k - 1) / 2 pairs), "nemenyi" (rank
    difference of at least cd), "holm" (p-holm < alpha)}``, and the Nemenyi groups."""
    scenarios = list(scores)
    seen: dict[str, None] = {}
    for row in scores.values():
        seen.update(dict.fromkeys(row))
    methods = [m for m in seen if all(_finite([scores[s].get(m)]) for s in scenarios)]
    n, k = len(scenarios), len(methods)
    if n < 2 or k < 2:
        return None
    per_scenario = {s: ranks({m: scores[s][m] for m in methods}, higher_is_better)
                    for s in scenarios}
    average = {m: math.fsum(per_scenario[s][m] for s in scenarios) / n for m in methods}
    chi2, ff = friedman_statistics([average[m] for m in methods], n)
    df1, df2 = k - 1, (k - 1) * (n - 1)
    q = nemenyi_q(k, alpha)
    se = math.sqrt(k * (k + 1) / (6.0 * n))
    cd = q * se
    order = sorted(methods, key=lambda m: average[m])
    pairs = []
    for i, a in enumerate(order):
        for b in order[i + 1:]:
            diff = average[b] - average[a]
            z = diff / se
            pairs.append({"a": a, "b": b, "rank-diff": diff, "z": z,
                          "p": float(2.0 * _scipy_stats().norm.sf(abs(z))),
                          "nemenyi": diff >= cd})
    for pair, adjusted in zip(pairs, holm([p["p"] for p in pairs]), strict=True):
        pair["p-holm"] = adjusted
        pair["holm"] = adjusted is not None and adjusted < alpha
    return {"scenarios": scenarios, "methods": order,
            "left-out": [m for m in seen if m not in methods], "n": n, "k": k,
            "average-rank": {m: average[m] for m in order}, "chi2": chi2, "chi2-df": df1,
            "chi2-p": float(_scipy_stats().chi2.sf(chi2, df1)), "ff": ff, "ff-df": [df1, df2],
            "ff-p": float(_scipy_stats().f.sf(ff, df1, df2)) if math.isfinite(ff) else 0.0,
            "alpha": alpha, "q": q, "cd": cd, "se": se, "pairs": pairs,
            "groups": nemenyi_groups(average, cd)}
