import json

import pytest

from pflalign.report import load, summarize


def _write(path, methods):
    path.mkdir()
    (path / "results.json").write_text(json.dumps({"methods": {
        name: {"final": final} for name, final in methods.items()}}))


def test_summary_is_mean_and_std_over_runs(tmp_path):
    _write(tmp_path / "a", {"fedavg": {"personal-acc": 0.70, "seconds-per-round": 2.0,
                                       "bytes-up": 2_000_000, "bytes-down": 10_000_000},
                            "local": {"personal-acc": 0.90}})
    _write(tmp_path / "b", {"fedavg": {"personal-acc": 0.80, "seconds-per-round": 4.0,
                                       "bytes-up": 4_000_000, "bytes-down": 30_000_000}})
    text = summarize(load([tmp_path / "a", tmp_path / "b"]))
    fedavg = next(line for line in text.splitlines() if line.startswith("fedavg"))
    assert "75.00 ± 5.00" in fedavg and "3.00" in fedavg and " 2 " in fedavg
    assert fedavg.split()[-2:] == ["3.0", "20.0"]  # MB up, MB down: means over the runs
    local = next(line for line in text.splitlines() if line.startswith("local"))
    assert "90.00 ± 0.00" in local and " 1 " in local
    markdown = summarize(load([tmp_path / "a"]), markdown=True)
    assert markdown.splitlines()[0].startswith("| method | runs | personal")


def test_missing_results_are_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="No results.json"):
        load([tmp_path / "nothing"])
