"""pflalign.outputs.stats against values computed by hand (or from closed forms)."""

from __future__ import annotations

import json
import math

import pytest

from pflalign.outputs.stats import (
    average_ranks,
    betainc,
    mean_ci,
    paired,
    paired_clients,
    ranks,
    t_cdf,
    t_critical,
    t_quantile,
)


@pytest.mark.parametrize(("df", "expected"), [(1, 12.7062), (2, 4.3027), (4, 2.7764),
                                              (10, 2.2281), (30, 2.0423)])
def test_two_sided_95_critical_values_match_the_tables(df, expected):
    assert t_critical(df, 0.95) == pytest.approx(expected, abs=1e-4)
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-4)
    assert t_quantile(0.025, df) == pytest.approx(-expected, abs=1e-4)


def test_t_matches_its_closed_forms():
    # df = 1 is the Cauchy distribution: F(t) = 1/2 + atan(t)/pi, so q(p) = tan(pi (p - 1/2)).
    for p in (0.6, 0.9, 0.975, 0.995):
        assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-10)
    # df = 2: F(t) = 1/2 + t / (2 sqrt(2 + t^2)), so q(p) = (2p - 1) sqrt(2 / (4 p (1 - p))).
    for p in (0.6, 0.9, 0.975, 0.995):
        assert t_quantile(p, 2) == pytest.approx((2 * p - 1) * math.sqrt(2 / (4 * p * (1 - p))),
                                                 rel=1e-10)
    assert t_cdf(0.0, 7) == 0.5 and t_quantile(0.5, 7) == 0.0
    assert t_cdf(-1.3, 5) == pytest.approx(1 - t_cdf(1.3, 5), abs=1e-15)
    assert t_cdf(t_quantile(0.9, 3.5), 3.5) == pytest.approx(0.9, abs=1e-12)
    # Large df approaches the normal: z(0.975) = 1.959964.
    assert t_critical(100_000) == pytest.approx(1.959964, abs=1e-4)


def test_incomplete_beta_closed_forms():
    for x in (0.0, 0.1, 0.5, 0.93, 1.0):
        assert betainc(1, 1, x) == pytest.approx(x, abs=1e-14)           # uniform
        assert betainc(3, 1, x) == pytest.approx(x ** 3, abs=1e-14)      # I_x(a, 1) = x^a
        assert betainc(1, 2.5, x) == pytest.approx(1 - (1 - x) ** 2.5, abs=1e-14)
    with pytest.raises(ValueError):
        betainc(0, 1, 0.5)


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
    json.dumps(result)  # JSON-able
    # Differences 0.10, 0.12, 0.11: mean 0.11, s = 0.01, s / sqrt(3) = 0.005774,
    # half width 4.302653 * 0.005774 = 0.024841 -> [0.085159, 0.134841]: excludes 0.
    strong = paired({0: 0.9, 1: 0.92, 2: 0.91}, {0: 0.8, 1: 0.8, 2: 0.8})
    assert strong["low"] == pytest.approx(0.085159, abs=1e-6)
    assert strong["significant"] is True and strong["wins"] == 3
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
