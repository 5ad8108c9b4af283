"""Small-sample statistics for comparing methods over seeds (pure Python, no SciPy).

* :func:`t_cdf` / :func:`t_quantile` / :func:`t_critical`: Student's t distribution, the CDF
  through the regularized incomplete beta function (a continued fraction, modified Lentz) and
  the quantile by bisection on the CDF.
* :func:`mean_ci`: the mean of a few values and its two-sided t confidence interval (n - 1 df).
* :func:`paired`: two methods' per-seed values matched by seed: differences, their mean and t
  interval, wins / losses / ties, and whether the interval excludes zero.
* :func:`paired_clients`: per-client differences (clients matched by id within each seed),
  averaged over seeds per client and pooled over all (seed, client) pairs.
* :func:`ranks` / :func:`average_ranks`: ranks of methods within a scenario (1 = best, ties
  share the average of the ranks they span) and their mean over scenarios.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

#: Relative accuracy of the continued fraction and of the quantile search.
_EPS = 1e-15
_TINY = 1e-300


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction ``1 / (1 + d1 / (1 + d2 / (1 + ...)))`` of ``I_x(a, b)``, with
    ``d_{2m+1} = -(a+m)(a+b+m) x / ((a+2m)(a+2m+1))`` and ``d_{2m} = m(b-m) x /
    ((a+2m-1)(a+2m))``, evaluated by the modified Lentz method. Converges fast for
    ``x < (a+1) / (a+b+2)``."""
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    result = d
    for m in range(1, 10_000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + numerator / c
            c = c if abs(c) > _TINY else _TINY
            result *= c * d
        if abs(c * d - 1.0) < _EPS:
            return result
    raise ArithmeticError(f"Incomplete beta continued fraction did not converge (a={a}, b={b}, "
                          f"x={x}).")


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)`` for ``a, b > 0``, ``0 <= x <= 1``."""
    if a <= 0 or b <= 0:
        raise ValueError("betainc needs a > 0 and b > 0.")
    if not 0.0 <= x <= 1.0:
        raise ValueError("betainc needs 0 <= x <= 1.")
    if x in (0.0, 1.0):
        return x
    log_front = (a * math.log(x) + b * math.log1p(-x)
                 + math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    # Symmetry I_x(a, b) = 1 - I_{1-x}(b, a) keeps the fraction in its fast region.
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom:
    the two tails are ``I_{df/(df+t^2)}(df/2, 1/2)`` together."""
    if df <= 0:
        raise ValueError("t_cdf needs df > 0.")
    if math.isnan(t):
        return math.nan
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (inverse of
    :func:`t_cdf`, by bisection)."""
    if not 0.0 < p < 1.0:
        raise ValueError("t_quantile needs 0 < p < 1.")
    if df <= 0:
        raise ValueError("t_quantile needs df > 0.")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, 2.0 * high
        if high > 1e300:
            return math.inf
    for _ in range(200):
        mid = 0.5 * (low + high)
        if t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low <= _EPS * high:
            break
    return 0.5 * (low + high)


def t_critical(df: float, level: float = 0.95) -> float:
    """The two-sided critical value: ``t`` with P(|T| <= t) = ``level``."""
    if not 0.0 < level < 1.0:
        raise ValueError("The confidence level must be in (0, 1).")
    return t_quantile(0.5 + level / 2.0, df)


def _finite(values: Iterable[object]) -> list[float]:
    return [float(v) for v in values
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)]


def mean_ci(values: Iterable[float | None],
            level: float = 0.95) -> tuple[float, float, float, int]:
    """``(mean, low, high, n)``: the mean of the finite values and its two-sided t interval,
    ``mean ± t_{(1+level)/2, n-1} * s / sqrt(n)`` with ``s`` the sample standard deviation.
    One value gives ``(x, nan, nan, 1)``; none gives ``(nan, nan, nan, 0)``."""
    xs = _finite(values)
    n = len(xs)
    if n == 0:
        return math.nan, math.nan, math.nan, 0
    mean = math.fsum(xs) / n
    if n == 1:
        return mean, math.nan, math.nan, 1
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_critical(n - 1, level) * sd / math.sqrt(n)
    return mean, mean - half, mean + half, n


def _counts(diffs: Sequence[float]) -> dict[str, int]:
    return {"wins": sum(d > 0 for d in diffs), "losses": sum(d < 0 for d in diffs),
            "ties": sum(d == 0 for d in diffs)}


def paired(values_a: Mapping[int, float | None], values_b: Mapping[int, float | None],
           level: float = 0.95) -> dict:
    """Compare two methods on the seeds both have a finite value for.

    Returns ``{"seeds", "diffs" (a - b per seed, in seed order), "mean", "low", "high", "n",
    "wins" (a > b), "losses", "ties", "significant"}``; ``significant`` is True when the t
    interval of the mean difference excludes 0 (never for n < 2)."""
    seeds = sorted(s for s in values_a if s in values_b
                   and _finite([values_a[s]]) and _finite([values_b[s]]))
    diffs = [float(values_a[s]) - float(values_b[s]) for s in seeds]
    mean, low, high, n = mean_ci(diffs, level)
    significant = n >= 2 and (low > 0 or high < 0)
    return {"seeds": seeds, "diffs": diffs, "mean": mean, "low": low, "high": high, "n": n,
            **_counts(diffs), "significant": bool(significant)}


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
