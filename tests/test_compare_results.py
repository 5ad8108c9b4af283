"""scripts/compare_results.py's grouping of differences by method and metric."""

import pytest

from scripts.compare_results import by_metric, compare


def _results(loss: float, median: float, acc: float) -> dict:
    row = {"round": 1, "train-loss": loss, "train-loss-median": median, "personal-acc": acc}
    return {"config": {}, "methods": {"m": {"rounds": [row], "final": {}, "clients": []}}}


def test_differences_group_by_method_and_metric_with_the_largest_relative_difference():
    diffs, checked = compare(_results(2.0, 4.0, 0.5), _results(2.0002, 4.0001, 0.5))
    assert checked == 4 and len(diffs) == 2
    (line,) = by_metric(diffs)
    assert line.startswith("[m] 'train-loss': 2 values differ, largest relative difference ")
    assert float(line.rsplit(" ", 1)[1]) == pytest.approx(1e-4, rel=1e-2)
    assert by_metric(["partition summaries differ"]) == ["partition summaries differ"]
