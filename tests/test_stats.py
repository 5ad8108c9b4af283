"""pflalign.outputs.stats against values computed by hand (or from closed forms)."""

from __future__ import annotations

import json
import math

import pytest

from pflalign.outputs.stats import (
    UNIT_EPS,
    average_ranks,
    friedman,
    friedman_statistics,
    higher_is_better,
    holm,
    is_fraction,
    logit_interval,
    mean_ci,
    metric_scale,
    nemenyi_groups,
    nemenyi_q,
    paired,
    paired_clients,
    ranks,
    t_critical,
)


@pytest.mark.parametrize(("df", "expected"), [(1, 12.7062), (2, 4.3027), (4, 2.7764),
                                              (10, 2.2281), (30, 2.0423)])
def test_two_sided_95_critical_values_match_the_tables(df, expected):
    assert t_critical(df, 0.95) == pytest.approx(expected, abs=1e-4)


def test_t_critical_maps_the_level_to_the_right_quantile():
    # df = 1 is the Cauchy distribution: F(t) = 1/2 + atan(t)/pi, so the two-sided critical
    # value at level L is tan(pi L / 2).
    for level in (0.5, 0.9, 0.95, 0.99):
        assert t_critical(1, level) == pytest.approx(math.tan(math.pi * level / 2), rel=1e-10)
    # df = 2: F(t) = 1/2 + t / (2 sqrt(2 + t^2)), so P(|T| <= t) = t / sqrt(2 + t^2) = L gives
    # t = L sqrt(2 / (1 - L^2)); t(0.995, 2) = 9.9248 in the tables.
    for level in (0.5, 0.9, 0.95, 0.99):
        assert t_critical(2, level) == pytest.approx(level * math.sqrt(2 / (1 - level ** 2)),
                                                     rel=1e-10)
    assert t_critical(2, 0.99) == pytest.approx(9.9248, abs=1e-4)
    # Large df approaches the normal: z(0.975) = 1.959964.
    assert t_critical(100_000) == pytest.approx(1.959964, abs=1e-4)
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError):
            t_critical(3, bad)


def test_mean_ci_by_hand():
    # [1, 2, 3, 4]: mean 2.5; squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5, s^2 = 5/3,
    # s = 1.290994; s / sqrt(4) = 0.645497; t(0.975, 3 df) = 3.182446;
    # half width = 3.182446 * 0.645497 = 2.054260 -> [0.445740, 4.554260].
    mean, low, high, n = mean_ci([1, 2, 3, 4])
    assert (mean, n) == (2.5, 4)
    assert low == pytest.approx(0.445740, abs=1e-6)
    assert high == pytest.approx(4.554260, abs=1e-6)
    # Non-finite values and None are left out.
    assert mean_ci([1, None, 2, math.nan, 3, 4]) == (mean, low, high, n)
    one = mean_ci([0.7])
    assert one[0] == 0.7 and math.isnan(one[1]) and math.isnan(one[2]) and one[3] == 1
    empty = mean_ci([])
    assert all(math.isnan(v) for v in empty[:3]) and empty[3] == 0
    # Equal values: a zero-width interval.
    assert mean_ci([0.5, 0.5, 0.5])[1:3] == (0.5, 0.5)


def test_paired_differences_on_a_tiny_table():
    # seed:      0     1     2     3 (only in a)
    # a:       0.80  0.70  0.90  0.60
    # b:       0.70  0.72  0.80   -
    # a - b:   0.10 -0.02  0.10
    # mean 0.06; deviations 0.04, -0.08, 0.04 -> s^2 = 0.0096 / 2 = 0.0048, s = 0.069282,
    # s / sqrt(3) = 0.04; t(0.975, 2 df) = 4.302653 -> half width 0.172106.
    result = paired({0: 0.80, 1: 0.70, 2: 0.90, 3: 0.60}, {0: 0.70, 1: 0.72, 2: 0.80})
    assert result["seeds"] == [0, 1, 2]
    assert result["diffs"] == pytest.approx([0.10, -0.02, 0.10], abs=1e-12)
    assert result["mean"] == pytest.approx(0.06, abs=1e-12)
    assert result["low"] == pytest.approx(0.06 - 0.172106, abs=1e-6)
    assert result["high"] == pytest.approx(0.06 + 0.172106, abs=1e-6)
    assert (result["n"], result["wins"], result["losses"], result["ties"]) == (3, 2, 1, 0)
    assert result["significant"] is False
    # Paired t = 0.06 / 0.04 = 1.5 with 2 df; for 2 df P(|T| > t) = 1 - t / sqrt(2 + t^2)
    # = 1 - 1.5 / sqrt(4.25) = 0.272393.
    assert result["p"] == pytest.approx(1 - 1.5 / math.sqrt(4.25), abs=1e-9)
    assert result["p"] == pytest.approx(0.272393, abs=1e-6)
    json.dumps(result)  # JSON-able
    # Differences 0.10, 0.12, 0.11: mean 0.11, s = 0.01, s / sqrt(3) = 0.005774,
    # half width 4.302653 * 0.005774 = 0.024841 -> [0.085159, 0.134841]: excludes 0.
    strong = paired({0: 0.9, 1: 0.92, 2: 0.91}, {0: 0.8, 1: 0.8, 2: 0.8})
    assert strong["low"] == pytest.approx(0.085159, abs=1e-6)
    assert strong["significant"] is True and strong["wins"] == 3
    # t = 0.11 / (0.01 / sqrt(3)) = 19.0526 -> p = 1 - 19.0526 / sqrt(2 + 363.0) = 0.002743.
    assert strong["p"] == pytest.approx(0.002743, abs=1e-6)
    assert paired({0: 0.5, 1: 0.6}, {0: 0.5, 1: 0.6})["p"] == 1.0  # all differences 0
    assert math.isnan(paired({5: 0.5}, {5: 0.4})["p"])  # n < 2: no test
    tie = paired({5: 0.5}, {5: 0.5})
    assert (tie["n"], tie["ties"], tie["significant"]) == (1, 1, False)
    assert paired({0: 0.9}, {0: 0.1})["significant"] is False  # n < 2: never significant


def test_per_client_differences_are_matched_by_id_and_averaged_over_seeds():
    a = {0: [{"id": 0, "personal-acc": 0.5}, {"id": 1, "personal-acc": 0.9},
             {"id": 2, "personal-acc": 0.4}],
         1: [{"id": 1, "personal-acc": 0.7}, {"id": 0, "personal-acc": 0.6}]}
    b = {0: [{"id": 1, "personal-acc": 0.8}, {"id": 0, "personal-acc": 0.6}],
         1: [{"id": 0, "personal-acc": 0.6}, {"id": 1, "personal-acc": 0.5}],
         2: [{"id": 0, "personal-acc": 0.0}]}
    result = paired_clients(a, b)
    # seed 0: client 0: -0.1, client 1: +0.1 (client 2 has no partner); seed 1: 0: 0.0, 1: +0.2
    assert sorted(result["pairs"]) == pytest.approx([-0.1, 0.0, 0.1, 0.2], abs=1e-12)
    assert result["n-pairs"] == 4
    assert result["mean"] == pytest.approx(0.05, abs=1e-12)
    assert (result["wins"], result["losses"], result["ties"]) == (2, 1, 1)
    by_id = {c["id"]: c for c in result["clients"]}
    assert by_id[0]["diff"] == pytest.approx(-0.05) and by_id[0]["seeds"] == 2
    assert by_id[1]["diff"] == pytest.approx(0.15)
    assert (result["clients-ahead"], result["clients-behind"]) == (1, 1)
    assert result["client-mean"] == pytest.approx(0.05)


def test_ranks_average_ties():
    assert ranks({"a": 0.9, "b": 0.8, "c": 0.8, "d": 0.7}) == {"a": 1, "b": 2.5, "c": 2.5,
                                                               "d": 4}
    assert ranks({"x": 0.5, "y": 0.5, "z": 0.5}) == {"x": 2, "y": 2, "z": 2}
    assert ranks({"a": 1.0, "b": 2.0, "c": None, "d": math.nan}, higher_is_better=False) == {
        "a": 1, "b": 2}
    per_scenario = {"s1": {"a": 1, "b": 2.5, "c": 2.5}, "s2": {"a": 3, "b": 1, "c": 2},
                    "s3": {"b": 1}}
    assert average_ranks(per_scenario) == {"a": 2, "b": 1.5, "c": 2.25}


# ---------------------------------------------------------------------------------------------
# Bounded (logit-scale) intervals for accuracies
# ---------------------------------------------------------------------------------------------

def _expit(y: float) -> float:
    return 1 / (1 + math.exp(-y))


def test_the_pathological_2_row_gets_an_interval_inside_0_100():
    # docs/experiments/suite-untuned/report.md, pathological-2, pflalign: personal-acc per seed
    # 94.71, 91.06, 96.83 printed as "94.20 [86.95, 101.45]": the plain t interval, past 100%.
    values = [0.9471, 0.9106, 0.9683]
    mean, low, high, n = mean_ci(values)
    assert (round(100 * mean, 2), round(100 * low, 2), round(100 * high, 2)) == (
        94.20, 86.95, 101.45)
    # Logits ln(x / (1 - x)): 2.885001, 2.320983, 3.419225; mean 2.875070; s = 0.549188,
    # s / sqrt(3) = 0.317074; half width 4.302653 * 0.317074 = 1.364260;
    # expit(2.875070 -/+ 1.364260) = expit(1.510810), expit(4.239330) = 0.819181, 0.985788.
    mean, low, high, n = mean_ci(values, bounded=True)
    assert n == 3 and mean == pytest.approx(0.942, abs=1e-12)  # the plain mean stays
    assert low == pytest.approx(_expit(1.510810), abs=1e-6)
    assert high == pytest.approx(_expit(4.239330), abs=1e-6)
    assert (low, high) == pytest.approx((0.819181, 0.985788), abs=1e-6)
    assert 0 <= low <= mean <= high <= 1
    # The local row "91.95 [83.00, 100.90]" (89.69, 90.06, 96.11): logits 2.163245, 2.203909,
    # 3.207084, mean 2.524746, s = 0.591272, half width 1.468801 -> [0.741915, 0.981899].
    mean, low, high, _ = mean_ci([0.8969, 0.9006, 0.9611], bounded=True)
    assert (low, high) == pytest.approx((0.741915, 0.981899), abs=1e-6)
    assert 0 <= low <= mean <= high <= 1


def test_bounded_interval_is_close_to_the_plain_one_away_from_the_bounds():
    # [0.70, 0.74, 0.72]: plain 0.72 ± 4.302653 * 0.02 / sqrt(3) = [0.670317, 0.769683];
    # logits 0.847298, 1.045969, 0.944462, mean 0.945909, s = 0.099343, half width 0.246782
    # -> [expit(0.699127), expit(1.192691)] = [0.667994, 0.767222].
    plain = mean_ci([0.70, 0.74, 0.72])
    bounded = mean_ci([0.70, 0.74, 0.72], bounded=True)
    assert plain[1:3] == pytest.approx((0.670317, 0.769683), abs=1e-6)
    assert bounded[1:3] == pytest.approx((0.667994, 0.767222), abs=1e-6)
    assert bounded[0] == plain[0]


def test_bounded_interval_at_the_bounds_and_when_degenerate():
    assert UNIT_EPS == 1e-3
    # All equal (also at a bound): the zero-width interval at that value.
    assert mean_ci([1.0, 1.0, 1.0], bounded=True) == (1.0, 1.0, 1.0, 3)
    assert mean_ci([0.0, 0.0], bounded=True) == (0.0, 0.0, 0.0, 2)
    assert mean_ci([0.8, 0.8, 0.8], bounded=True)[1:3] == pytest.approx((0.8, 0.8))
    # An exact 1 counts as 0.999: logits 6.906755, 3.891820, 4.595120; mean 5.131232,
    # s = 1.577346, half width 4.302653 * 0.910681 = 3.918344 -> [0.770810, 0.999883].
    mean, low, high, _ = mean_ci([1.0, 0.98, 0.99], bounded=True)
    assert mean == pytest.approx(0.99)
    assert (low, high) == pytest.approx((0.770810, 0.999883), abs=1e-6)
    # An exact 0 counts as 0.001: [0, 0.5, 0.6] -> logits -6.906755, 0, 0.405465; the interval
    # is wide but inside (0, 1).
    mean, low, high, _ = mean_ci([0.0, 0.5, 0.6], bounded=True)
    assert 0 < low < mean < high < 1
    # One value: no interval, as for the plain one; values outside [0, 1] are refused.
    one = mean_ci([1.0], bounded=True)
    assert one[0] == 1.0 and math.isnan(one[1]) and one[3] == 1
    with pytest.raises(ValueError):
        mean_ci([0.5, 1.2], bounded=True)
    with pytest.raises(ValueError):
        logit_interval([0.5])


def test_bounded_interval_is_widened_to_reach_a_mean_it_misses():
    # 19 seeds at 0.99 and one at 0.01: logits 4.595120 (x19) and -4.595120, mean 4.135608,
    # s = 2.055000, s / sqrt(20) = 0.459512, t(0.975, 19) = 2.093024, half width 0.961770
    # -> [expit(3.173838), expit(5.097378)] = [0.959838, 0.993924], which misses the plain
    # mean (19 * 0.99 + 0.01) / 20 = 0.941: the low end moves down to it.
    values = [0.99] * 19 + [0.01]
    mean, low, high, n = mean_ci(values, bounded=True)
    assert n == 20 and mean == pytest.approx(0.941)
    assert low == mean
    assert high == pytest.approx(0.993924, abs=1e-6)


def test_which_metrics_are_fractions():
    for metric in ("personal-acc", "personal-acc-bottom10", "global-acc", "unseen-acc",
                   "personal-acc-next"):
        assert is_fraction(metric)
    for metric in ("train-loss", "perplexity", "seconds-per-round", "bytes-up", "gga-accepted"):
        assert not is_fraction(metric)


# ---------------------------------------------------------------------------------------------
# Many methods over many scenarios: Demsar (2006)
# ---------------------------------------------------------------------------------------------

#: Demsar's Table 5: Nemenyi's q_alpha for k = 2 .. 10 at alpha = 0.05 and 0.10.
Q_05 = (1.960, 2.343, 2.569, 2.728, 2.850, 2.949, 3.031, 3.102, 3.164)
Q_10 = (1.645, 2.052, 2.291, 2.459, 2.589, 2.693, 2.780, 2.855, 2.920)


@pytest.mark.parametrize("k", range(2, 11))
def test_nemenyi_q_matches_demsars_table(k):
    assert nemenyi_q(k, 0.05) == pytest.approx(Q_05[k - 2], abs=1e-3)
    assert nemenyi_q(k, 0.10) == pytest.approx(Q_10[k - 2], abs=1e-3)


#: Demsar's worked example (section 3.2.2): four variants of C4.5 on 14 data sets with average
#: ranks 3.143, 2.000, 2.893, 1.964. Any table of within-data-set ranks with these column sums
#: (44, 28, 40.5, 27.5) gives the same statistics; this one has a tie in two rows.
DEMSAR_METHODS = ("C4.5", "C4.5+m", "C4.5+cf", "C4.5+m+cf")
DEMSAR_RANKS = ((4, 1, 3, 2), (4, 2, 3, 1), (4, 1, 2, 3), (3, 2, 4, 1), (4, 2, 3, 1),
                (1, 3, 4, 2), (3, 2, 4, 1), (3, 4, 2, 1), (4, 3, 2, 1), (2, 2, 4, 2),
                (4, 2, 1, 3), (3, 1, 4, 2), (2, 1, 3.5, 3.5), (3, 2, 1, 4))


def _demsar_table() -> dict[str, dict[str, float]]:
    return {f"data set {i}": dict(zip(DEMSAR_METHODS, row, strict=True))
            for i, row in enumerate(DEMSAR_RANKS)}


def test_friedman_and_iman_davenport_on_demsars_example():
    assert [sum(row[j] for row in DEMSAR_RANKS) for j in range(4)] == [44, 28, 40.5, 27.5]
    for row in DEMSAR_RANKS:  # each row is a ranking of four methods
        assert sum(row) == 10
    # Ranks as scores, low first: ranking them again gives the same ranks.
    result = friedman(_demsar_table(), higher_is_better=False)
    assert (result["n"], result["k"], result["left-out"]) == (14, 4, [])
    assert result["average-rank"] == pytest.approx(
        {"C4.5": 44 / 14, "C4.5+m": 2.0, "C4.5+cf": 40.5 / 14, "C4.5+m+cf": 27.5 / 14})
    assert result["methods"] == ["C4.5+m+cf", "C4.5+m", "C4.5+cf", "C4.5"]
    # chi2_F = 12 * 14 / (4 * 5) * (3.143^2 + 2^2 + 2.893^2 + 1.964^2 - 4 * 25 / 4) = 9.28,
    # F_F = 13 * 9.28 / (14 * 3 - 9.28) = 3.69 (Demsar); exactly 9.278571 and 3.686313.
    assert round(result["chi2"], 2) == 9.28 and round(result["ff"], 2) == 3.69
    assert result["chi2"] == pytest.approx(9.278571, abs=1e-6)
    assert result["ff"] == pytest.approx(13 * 9.278571 / (42 - 9.278571), abs=1e-5)
    assert (result["chi2-df"], result["ff-df"]) == (3, [3, 39])
    # Chi-squared with 3 df: P(X > x) = erfc(sqrt(x / 2)) + sqrt(2 x / pi) exp(-x / 2).
    x = result["chi2"]
    assert result["chi2-p"] == pytest.approx(
        math.erfc(math.sqrt(x / 2)) + math.sqrt(2 * x / math.pi) * math.exp(-x / 2), rel=1e-9)
    # Demsar: the critical value of F(3, 39) at 0.05 is 2.85, so F_F = 3.69 rejects.
    assert 0.01 < result["ff-p"] < 0.05
    # CD = 2.569 * sqrt(4 * 5 / (6 * 14)) = 1.25.
    assert result["se"] == pytest.approx(math.sqrt(20 / 84))
    assert result["q"] == pytest.approx(2.569, abs=1e-3)
    assert round(result["cd"], 2) == 1.25
    # No pair differs by CD (the largest rank difference is 3.143 - 1.964 = 1.179).
    assert not any(pair["nemenyi"] for pair in result["pairs"])
    assert result["groups"] == [["C4.5+m+cf", "C4.5+m", "C4.5+cf", "C4.5"]]


def test_nemenyi_at_010_on_demsars_example():
    # Demsar: at alpha = 0.10, q = 2.291 and CD = 1.12; C4.5 (3.143) is then worse than
    # C4.5+m+cf (1.964) and C4.5+m (2.000), the other pairs are not told apart.
    result = friedman(_demsar_table(), higher_is_better=False, alpha=0.10)
    assert round(result["cd"], 2) == 1.12
    called = {(p["a"], p["b"]) for p in result["pairs"] if p["nemenyi"]}
    assert called == {("C4.5+m+cf", "C4.5"), ("C4.5+m", "C4.5")}
    assert result["groups"] == [["C4.5+m+cf", "C4.5+m", "C4.5+cf"], ["C4.5+cf", "C4.5"]]


def test_pairwise_z_tests_and_holm_on_demsars_example():
    result = friedman(_demsar_table(), higher_is_better=False)
    pairs = {(p["a"], p["b"]): p for p in result["pairs"]}
    assert len(pairs) == 6
    # z = (R_i - R_j) / sqrt(k (k + 1) / (6 N)): C4.5 vs C4.5+m+cf: (44 - 27.5) / 14 / 0.487950
    # = 2.415353, two-sided p = erfc(z / sqrt(2)) = 0.015720.
    worst = pairs[("C4.5+m+cf", "C4.5")]
    assert worst["rank-diff"] == pytest.approx(16.5 / 14)
    assert worst["z"] == pytest.approx(2.415353, abs=1e-6)
    assert worst["p"] == pytest.approx(math.erfc(2.415353 / math.sqrt(2)), abs=1e-6)
    assert worst["p"] == pytest.approx(0.015720, abs=1e-6)
    # C4.5 vs C4.5+m: 16 / 14 / 0.487950 = 2.342160, p = 0.019172.
    second = pairs[("C4.5+m", "C4.5")]
    assert second["p"] == pytest.approx(0.019172, abs=1e-6)
    # Holm over 6 pairs: 6 * 0.015720 = 0.094320, then max(0.094320, 5 * 0.019172 = 0.095862).
    assert worst["p-holm"] == pytest.approx(6 * worst["p"])
    assert second["p-holm"] == pytest.approx(5 * second["p"])
    assert not any(p["holm"] for p in result["pairs"])


def test_holm_step_down_by_hand():
    # sorted: 0.005 (x4 = 0.02), 0.01 (x3 = 0.03), 0.03 (x2 = 0.06), 0.04 (x1 = 0.04, but not
    # below the previous: 0.06); missing values stay missing and do not count.
    assert holm([0.01, 0.04, 0.03, 0.005, None, math.nan]) == pytest.approx(
        [0.03, 0.06, 0.06, 0.02, None, None])
    assert holm([0.5, 0.9]) == [1.0, 1.0]  # capped at 1
    assert holm([]) == []


def test_friedman_edge_cases():
    # Every scenario ranks the methods alike, without ties: chi2_F = N (k - 1), F_F infinite.
    same = {s: {"a": 0.9, "b": 0.8, "c": 0.7} for s in ("s1", "s2", "s3")}
    result = friedman(same)
    assert result["chi2"] == pytest.approx(3 * 2)
    assert math.isinf(result["ff"]) and result["ff-p"] == 0.0
    assert friedman_statistics([2.0, 2.0, 2.0], 5) == (0.0, 0.0)  # all tied: no evidence
    # A method missing in one scenario is left out; one scenario or one method gives nothing.
    partial = {"s1": {"a": 0.9, "b": 0.8, "c": 0.7}, "s2": {"a": 0.5, "b": 0.6}}
    assert friedman(partial)["left-out"] == ["c"]
    assert friedman({"s1": {"a": 0.9, "b": 0.8}}) is None
    assert friedman({"s1": {"a": 0.9}, "s2": {"a": 0.5}}) is None


def test_nemenyi_groups_by_hand():
    # a 1.0, b 1.5, c 2.6, d 3.9 with CD 1.25: a-b (0.5) and b-c (1.1) are within CD, a-c
    # (1.6) and c-d (1.3) are not.
    assert nemenyi_groups({"d": 3.9, "a": 1.0, "c": 2.6, "b": 1.5}, 1.25) == [["a", "b"],
                                                                             ["b", "c"]]
    assert nemenyi_groups({"a": 1.0, "b": 3.0}, 1.25) == []


def test_a_perplexity_and_a_loss_get_intervals_in_their_ranges():
    assert [metric_scale(m) for m in ("personal-acc", "global-ppl", "personal-loss",
                                      "seconds-per-round")] == [
        "fraction", "above-one", "positive", None]
    assert [higher_is_better(m) for m in ("personal-acc", "personal-ppl", "personal-loss")] == [
        True, False, False]
    ppl = [1.02, 1.5, 3.0]
    mean, low, high, _ = mean_ci(ppl)
    assert low < 1.0  # the plain interval leaves the range: a perplexity is at least 1
    # by hand: y = log(ppl - 1) = (log 0.02, log 0.5, log 2), t_{0.975, 2} = 4.302653
    ys = [math.log(0.02), math.log(0.5), math.log(2.0)]
    centre = sum(ys) / 3
    sd = math.sqrt(sum((y - centre) ** 2 for y in ys) / 2)
    half = 4.302653 * sd / math.sqrt(3)
    _, low, high, _ = mean_ci(ppl, scale=metric_scale("personal-ppl"))
    assert low == pytest.approx(1 + math.exp(centre - half), rel=1e-6) and low > 1.0
    assert high == pytest.approx(1 + math.exp(centre + half), rel=1e-6)
    loss = [0.01, 0.4, 1.2]
    assert mean_ci(loss)[1] < 0.0 < mean_ci(loss, scale="positive")[1]
    with pytest.raises(ValueError, match=r"above-one interval needs values in \[1, inf\]"):
        mean_ci([0.5, 2.0], scale="above-one")
