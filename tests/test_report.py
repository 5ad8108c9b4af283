"""pflalign.outputs.report: the mean ± std table over runs, and a study's report.md with its
plots."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, needs_fashion_mnist

from pflalign.outputs.report import load, summarize, summarize_study, write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOT_KINDS = ("accuracy", "clients", "paired", "partition", "diagnostics", "bytes")


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


# ---------------------------------------------------------------------------------------------
# A synthetic study: 2 scenarios x 3 seeds x 3 methods, in the layout simulate.py writes
# ---------------------------------------------------------------------------------------------

#: Final personal-acc per (scenario, method), one value per seed 0, 1, 2.
FINALS = {
    "dir-0.1": {"fedavg": [0.70, 0.74, 0.72], "pflalign": [0.80, 0.83, 0.81],
                "local": [0.75, 0.70, 0.78]},
    "shards": {"fedavg": [0.50, 0.52, 0.51], "pflalign": [0.60, 0.50, 0.62],
               "local": [0.65, 0.66, 0.64]},
}
SEEDS = (0, 1, 2)
CLIENT_OFFSETS = (-0.2, -0.1, 0.0, 0.05, 0.1, 0.15)


def _synthetic_run(scenario: str, seed: int) -> dict:
    clients = [{"id": i, "unseen": False, "num-train": 100 + 10 * i, "num-test": 30,
                "rotation": 0.0, "train-labels": [(7 * i + 3 * j + seed) % 40 for j in range(10)],
                "test-labels": [3] * 10} for i in range(len(CLIENT_OFFSETS))]
    methods = {}
    for label, finals in FINALS[scenario].items():
        acc = finals[seed]
        rounds = []
        for r in (1, 2, 3, 4):
            row = {"round": r, "train-loss": 2.0 / r, "round-seconds": 0.5,
                   "bytes-up": 1_000_000, "bytes-down": 4_000_000}
            if r % 2 == 0:  # evaluated every second round only
                row.update({"personal-acc": acc * r / 4, "global-acc": acc * r / 5})
            if label == "pflalign":
                row.update({"mean-P": 0.05 + 0.01 * r, "mean-gamma": 0.5 - 0.01 * r,
                            "delta-norm": 0.5 * r + 0.1 * seed, "update-cosine": 0.4 + 0.1 * r})
            rounds.append(row)
        final = {"personal-acc": acc, "personal-acc-bottom10": acc - 0.3,
                 "bytes-up": 4_000_000 if label != "local" else 0,
                 "bytes-down": 16_000_000 if label != "local" else 0,
                 "seconds-per-round": 0.5}
        if label != "local":
            final["global-acc"] = acc * 0.8
        methods[label] = {
            "method": label, "overrides": {}, "rounds": rounds, "final": final,
            "clients": [{"id": c["id"], "unseen": False, "num-train": c["num-train"],
                         "num-test": 30, "personal-acc": min(1.0, max(0.0, acc + off))}
                        for c, off in zip(clients, CLIENT_OFFSETS, strict=True)]}
    return {"config": {"seed": seed, "rounds": 4, "methods": "fedavg,pflalign,local"},
            "versions": {"python": "3"}, "started": "2025-01-01T00:00:00+0000",
            "partition": {"dataset": "synthetic", "samples": 1000, "num-train-clients": 6,
                          "num-unseen-clients": 0, "clients": clients},
            "methods": methods, "seconds": 1.0, "scenario": scenario, "seed": seed,
            "setting": {}}


def _synthetic_study() -> dict:
    tune = {"trials": 2, "tune-seeds": [100, 101], "validation-fraction": 0.2,
            "objective": "personal-acc", "methods": {"pflalign": {
                "space": {"pflalign-lr": [1.0, 3.0]}, "chosen": {"pflalign-lr": 3.0},
                "default": {"pflalign-lr": 3.0},
                "trials": [{"params": {"pflalign-lr": 1.0}, "score": 0.612, "scores": [0.6, 0.624]},
                           {"params": {"pflalign-lr": 3.0}, "score": 0.655,
                            "scores": [0.65, 0.66]}]}}}
    return {"schema-version": 2, "kind": "study", "command": "simulate.py --seeds 0,1,2",
            "protocol": {"seeds": list(SEEDS), "reference": "fedavg", "metric": "personal-acc",
                         "scenarios": list(FINALS), "sweep": {}, "tune": tune},
            "runs": [_synthetic_run(scenario, seed) for scenario in FINALS for seed in SEEDS]}


def _check_png(path) -> None:
    """A valid, non-empty PNG with a real picture: signature, > 50 x 50 pixels, > 1 colour."""
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 50 and image.shape[1] > 50, (path, image.shape)
    pixels = image.reshape(image.shape[0] * image.shape[1], -1)
    assert (pixels != pixels[0]).any(), path  # more than one distinct colour


def _report_cli(directory, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pflalign.outputs.report", str(directory), *extra],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def _section(text: str, heading: str) -> str:
    """The text of a Markdown section, up to the next heading of the same or higher level."""
    level = heading.split()[0]
    start = text.index(heading + "\n")
    ends = [text.find(f"\n{'#' * n} ", start + 1) for n in range(1, len(level) + 1)]
    ends = [e for e in ends if e != -1]
    return text[start:min(ends) if ends else len(text)]


@pytest.fixture(scope="module")
def synthetic_report(tmp_path_factory):
    directory = tmp_path_factory.mktemp("study")
    (directory / "results.json").write_text(json.dumps(_synthetic_study()))
    result = _report_cli(directory)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return directory, result.stdout


def test_study_report_has_every_section_and_the_right_numbers(synthetic_report):
    directory, stdout = synthetic_report
    text = (directory / "report.md").read_text()
    for heading in ("# Study report", "## Protocol", "### Tuning", "#### pflalign",
                    "## Leaderboard", "## dir-0.1", "## shards", "### Final metrics",
                    "### Paired differences vs fedavg",
                    "### Each method vs the best other method", "### Plots"):
        assert f"\n{heading}\n" in f"\n{text}", heading
    assert "Student-t" in text and "n - 1 degrees of freedom" in text and "logit" in text
    protocol = _section(text, "## Protocol")
    assert "Seeds: 0, 1, 2 (n = 3)" in protocol and "Reference method: fedavg" in protocol
    assert "| 2 | pflalign-lr=3.0 | 65.50 | 65.00, 66.00 | ✓ |" in protocol
    assert "Chosen: pflalign-lr=3.0" in protocol and "tuning seeds: 100, 101" in protocol

    # fedavg on dir-0.1: mean of 70, 74, 72 = 72.00; an accuracy, so the t interval is taken
    # on the logits 0.847298, 1.045969, 0.944462: mean 0.945909, s = 0.099343,
    # s / sqrt(3) = 0.057356, t(0.975, 2) = 4.302653 -> half width 0.246782 ->
    # [expit(0.699127), expit(1.192691)] = [66.80, 76.72] % (the plain one: [67.03, 76.97]).
    mean = 100 * sum(FINALS["dir-0.1"]["fedavg"]) / 3
    assert f"{mean:.2f}" == "72.00"
    board = _section(text, "## Leaderboard")
    fedavg_row = next(line for line in board.splitlines() if line.startswith("| fedavg |"))
    assert "| 72.00 [66.80, 76.72] | 42.00 | 3 |" in fedavg_row  # worst decile 72 - 30
    assert "Scenarios: dir-0.1, shards; seeds 0, 1, 2; tuned (2 trials" in board
    assert fedavg_row.endswith("| 3.00 |")  # last in both scenarios
    pflalign_row = next(line for line in board.splitlines() if line.startswith("| pflalign |"))
    assert pflalign_row.endswith("| 1.50 |")  # first on dir-0.1, second on shards
    assert stdout.startswith("| method |") and "report.md" in stdout

    dir01 = _section(text, "## dir-0.1")
    paired = _section(dir01, "### Paired differences vs fedavg")
    # pflalign - fedavg on dir-0.1: +10, +9, +9 pp: mean +9.33, wins 3/3, CI excludes 0.
    row = next(line for line in paired.splitlines() if line.startswith("| pflalign |"))
    assert "| +9.33 |" in row and "| 3/3 | yes |" in row and "+10.00, +9.00, +9.00" in row
    row = next(line for line in paired.splitlines() if line.startswith("| local |"))
    assert "| 2/3 | no |" in row
    best = _section(dir01, "### Each method vs the best other method")
    assert "| pflalign | local | +7.00 |" in best  # 80/83/81 vs 75/70/78
    assert "**pflalign** leads local by +7.00 pp" in best
    # Each table's caption says what that table is, and names its scenario, seeds and tuning.
    context = "dir-0.1; seeds 0, 1, 2; tuned (2 trials per method"
    assert "Each method minus fedavg" in paired and context in paired
    assert "Each method minus the best of the other methods" in best and context in best
    assert "minus fedavg" not in best
    assert context in _section(dir01, "### Final metrics")
    figures = [line for line in _section(dir01, "### Plots").splitlines()
               if line.startswith("*")]
    assert len(figures) == len(PLOT_KINDS)
    assert all("(dir-0.1), seeds 0, 1, 2, tuned (2 trials" in line for line in figures)
    shards = _section(text, "## shards")
    assert "**local** leads pflalign by" in shards and "not significant" in shards


def test_study_report_plots_are_valid_pngs(synthetic_report):
    directory, _ = synthetic_report
    text = (directory / "report.md").read_text()
    plots = sorted((directory / "plots").glob("*.png"))
    expected = {f"{kind}-{scenario}.png" for kind in PLOT_KINDS for scenario in FINALS}
    assert {p.name for p in plots} == expected | {"cd.png"}  # 2 scenarios: a CD diagram
    for path in plots:
        assert f"](plots/{path.name})" in text  # embedded as a relative link
        _check_png(path)


def test_summarize_study_is_json_and_pairs_seeds_and_clients():
    summary = summarize_study(_synthetic_study())
    json.dumps(summary, allow_nan=False)
    assert summary["reference"] == "fedavg" and summary["methods"] == ["fedavg", "pflalign",
                                                                       "local"]
    assert summary["average-rank"] == {"fedavg": 3.0, "pflalign": 1.5, "local": 1.5}
    group = summary["groups"][0]
    assert (group["scenario"], group["setting"], group["seeds"]) == ("dir-0.1", {}, [0, 1, 2])
    assert group["ranking"] == ["pflalign", "local", "fedavg"] and group["best"] == "pflalign"
    fedavg, pflalign = group["methods"]["fedavg"], group["methods"]["pflalign"]
    acc = fedavg["metrics"]["personal-acc"]
    assert acc["values"] == [0.70, 0.74, 0.72] and acc["seeds"] == [0, 1, 2]
    assert acc["mean"] == pytest.approx(0.72) and acc["n"] == 3
    # The logit-scale interval (tests/test_stats.py works it out): [0.667994, 0.767222].
    assert (acc["low"], acc["high"]) == pytest.approx((0.667994, 0.767222), abs=1e-6)
    assert fedavg["vs-reference"] is None and fedavg["rank"] == 3
    assert "unseen-acc" not in fedavg["metrics"]  # no values: left out
    vs = pflalign["vs-reference"]
    assert vs["diffs"] == pytest.approx([0.10, 0.09, 0.09]) and vs["significant"] is True
    assert pflalign["vs-best-other"]["other"] == "local"
    clients = pflalign["clients-vs-reference"]
    # Client offsets are the same in both methods except where clipped at 0 or 1.
    assert clients["n-pairs"] == 18 and len(clients["clients"]) == 6
    assert clients["clients-ahead"] == 6
    assert pflalign["total-bytes"]["mean"] == pytest.approx(20_000_000)
    assert group["methods"]["local"]["metrics"].get("global-acc") is None


def test_summary_has_the_verdict_across_scenarios():
    summary = summarize_study(_synthetic_study())
    json.dumps(summary, allow_nan=False)
    result = summary["friedman"]
    # Means: dir-0.1 pflalign 81.33 > local 74.33 > fedavg 72.00; shards local 65.00 >
    # pflalign 57.33 > fedavg 51.00: average ranks pflalign 1.5, local 1.5, fedavg 3.
    assert result["average-rank"] == {"pflalign": 1.5, "local": 1.5, "fedavg": 3.0}
    assert (result["n"], result["k"]) == (2, 3)
    # chi2_F = 12 * 2 / (3 * 4) * (1.5^2 + 1.5^2 + 3^2 - 3 * 4^2 / 4) = 2 * 1.5 = 3, 2 df:
    # p = exp(-3 / 2) = 0.223130. F_F = (2 - 1) * 3 / (2 * 2 - 3) = 3 with (2, 2) df, whose
    # survival function is 1 / (1 + F): p = 0.25.
    assert result["chi2"] == pytest.approx(3.0)
    assert result["chi2-p"] == pytest.approx(math.exp(-1.5))
    assert result["ff"] == pytest.approx(3.0) and result["ff-df"] == [2, 2]
    assert result["ff-p"] == pytest.approx(0.25)
    # se = sqrt(3 * 4 / (6 * 2)) = 1, so CD = q_0.05(k = 3) = 2.343 (Demsar's Table 5a).
    assert result["se"] == pytest.approx(1.0)
    assert result["cd"] == pytest.approx(2.343, abs=1e-3)
    assert result["groups"] == [["pflalign", "local", "fedavg"]]
    # Pairs: pflalign-local 0 ranks apart (z = 0, p = 1); each vs fedavg 1.5 apart: z = 1.5,
    # p = 2 (1 - Phi(1.5)) = 0.133614; Holm over 3: 3 * 0.133614 = 0.400843 for both (the
    # second, 2 * 0.133614, is raised to the first), then 1.
    pairs = {(p["a"], p["b"]): p for p in result["pairs"]}
    assert pairs[("pflalign", "local")]["p"] == pytest.approx(1.0)
    assert pairs[("pflalign", "fedavg")]["z"] == pytest.approx(1.5)
    assert pairs[("pflalign", "fedavg")]["p"] == pytest.approx(0.133614, abs=1e-6)
    assert pairs[("pflalign", "fedavg")]["p-holm"] == pytest.approx(0.400843, abs=1e-6)
    assert pairs[("local", "fedavg")]["p-holm"] == pytest.approx(0.400843, abs=1e-6)
    assert pairs[("pflalign", "local")]["p-holm"] == pytest.approx(1.0)
    # Paired t tests vs fedavg (2 df, p = 1 - |t| / sqrt(2 + t^2)):
    #   dir-0.1 pflalign +10, +9, +9: t = 28.0 -> p = 0.001273
    #   dir-0.1 local +5, -4, +6: t = 0.733799 -> p = 0.539434
    #   shards pflalign +10, -2, +11: t = 1.516365 -> p = 0.268690
    #   shards local +15, +14, +13: t = 24.248711 -> p = 0.001696
    # Holm over 4: 4 * 0.001273 = 0.005092; 3 * 0.001696 = 0.005089 is raised to it;
    # 2 * 0.268690 = 0.537379; 1 * 0.539434.
    holm = summary["holm-vs-reference"]
    assert holm["m"] == 4
    got = {(t["group"], t["method"]): (t["p"], t["p-holm"]) for t in holm["tests"]}
    expected = {("dir-0.1", "pflalign"): (0.001273, 0.005092),
                ("dir-0.1", "local"): (0.539434, 0.539434),
                ("shards", "pflalign"): (0.268690, 0.537379),
                ("shards", "local"): (0.001696, 0.005092)}
    assert got.keys() == expected.keys()
    for key, (p_raw, p_holm) in expected.items():
        assert got[key] == pytest.approx((p_raw, p_holm), abs=1e-6), key
    vs = summary["groups"][1]["methods"]["local"]["vs-reference"]
    assert vs["p-holm"] == got[("shards", "local")][1]


def test_study_report_has_the_verdict_across_scenarios(synthetic_report):
    directory, _ = synthetic_report
    text = (directory / "report.md").read_text()
    verdict = _section(text, "## Across scenarios: Friedman, Nemenyi, Holm")
    assert "Friedman: χ²_F = 3.00 with 2 df, p = 0.2231" in verdict
    assert "Iman–Davenport: F_F = 3.00 with (2, 2) df, p = 0.2500" in verdict
    assert "not rejected at α = 0.05" in verdict and "CD = q" in verdict and "= 2.34" in verdict
    assert "| pflalign | 1.500 |" in verdict and "| fedavg | 3.000 |" in verdict
    assert "| pflalign | fedavg | 1.500 | 1.50 | 0.1336 | 0.4008 | no | no |" in verdict
    assert "dir-0.1, shards; seeds 0, 1, 2; tuned" in verdict
    assert "![Critical-difference diagram" in verdict and "](plots/cd.png)" in verdict
    holm = _section(verdict, "### Paired t tests vs fedavg, all groups")
    assert "| shards | local | +14.00 | [+11.52, +16.48] | 3/3 | 0.0017 | 0.0051 |" in holm
    paired = _section(_section(text, "## shards"), "### Paired differences vs fedavg")
    row = next(line for line in paired.splitlines() if line.startswith("| local |"))
    assert "| 3/3 | yes | 0.0017 | 0.0051 |" in row
    assert "over all 4 paired tests against fedavg" in paired


#: A planted copy of the suite's pathological-2 numbers (docs/experiments/suite-untuned/report.md):
#: personal-acc per seed whose plain t intervals were printed as 94.20 [86.95, 101.45]
#: (pflalign) and 91.95 [83.00, 100.90] (local); their worst deciles too.
PATHOLOGICAL = {
    "pathological-2": {"fedavg": [0.6217, 0.5100, 0.5261], "pflalign": [0.9471, 0.9106, 0.9683],
                       "local": [0.8969, 0.9006, 0.9611]},
    "dir-0.1": FINALS["dir-0.1"],
}


def test_no_accuracy_interval_in_the_report_leaves_0_100(tmp_path, monkeypatch):
    import re

    monkeypatch.setitem(FINALS, "pathological-2", PATHOLOGICAL["pathological-2"])
    runs = [_synthetic_run(scenario, seed) for scenario in PATHOLOGICAL for seed in SEEDS]
    for run in runs:  # worst deciles close to 100% and to 0%, spread wide
        for label, result in run["methods"].items():
            result["final"]["personal-acc-bottom10"] = {"pflalign": (0.98, 0.75, 0.99),
                                                        "local": (0.70, 0.02, 0.65),
                                                        "fedavg": (0.2, 0.3, 0.0)}[label][
                run["seed"]]
    doc = {"schema-version": 2, "kind": "study", "command": "test",
           "protocol": {"seeds": list(SEEDS), "reference": "fedavg", "metric": "personal-acc",
                        "scenarios": list(PATHOLOGICAL), "sweep": {}, "tune": None},
           "runs": runs}
    written = write_report(tmp_path, doc)
    text = written[0].read_text()
    # Every "mean [low, high]" cell with an unsigned mean is an accuracy in % (differences are
    # printed with a sign and without a mean in front).
    cells = re.findall(r"(?<![\d.+-])(\d+\.\d+) \[(-?\d+\.\d+), (-?\d+\.\d+)\]", text)
    assert len(cells) >= 20
    for mean, low, high in cells:
        assert 0.0 <= float(low) <= float(mean) <= float(high) <= 100.0, (mean, low, high)
    board = _section(text, "## Leaderboard")
    row = next(line for line in board.splitlines() if line.startswith("| pflalign |"))
    assert "| 94.20 [81.92, 98.58] |" in row  # tests/test_stats.py works this one out
    row = next(line for line in board.splitlines() if line.startswith("| local |"))
    assert "| 91.95 [74.19, 98.19] |" in row
    assert "101.45" not in text and "100.90" not in text
    assert "Tuning: none" in text and "seeds 0, 1, 2; no tuning" in board
    # The JSON summary holds the same bounded intervals.
    summary = summarize_study(doc)
    for group in summary["groups"]:
        for entry in group["methods"].values():
            for key, ci in entry["metrics"].items():
                if ci["low"] is not None:
                    assert 0 <= ci["low"] <= ci["mean"] <= ci["high"] <= 1, (key, ci)
    # The plots' accuracy bands are the bounded ones too.
    from pflalign.outputs import plots

    group_runs = {run["seed"]: run for run in runs if run["scenario"] == "pathological-2"}
    for label in ("pflalign", "local", "fedavg"):
        for _, (m, low, high, _) in plots._per_round(group_runs, label, "personal-acc"):
            assert 0 <= low <= m <= high <= 1
    assert (tmp_path / "plots" / "cd.png").is_file()
    _check_png(tmp_path / "plots" / "cd.png")


def test_plots_without_data_are_not_written(tmp_path):
    run = _synthetic_run("dir-0.1", 0)
    run["methods"] = {"fedavg": run["methods"]["fedavg"]}
    for row in run["methods"]["fedavg"]["rounds"]:
        row.pop("personal-acc", None)
    del run["partition"]
    doc = {"kind": "study", "protocol": {"seeds": [0], "reference": "fedavg",
                                         "metric": "personal-acc"}, "runs": [run]}
    written = write_report(tmp_path, doc)
    assert written[0] == tmp_path / "report.md"
    assert sorted(p.name for p in written[1:]) == ["bytes-dir-0.1.png", "clients-dir-0.1.png"]
    for path in written[1:]:
        _check_png(path)
    text = written[0].read_text()
    assert "### Paired differences" not in text and "accuracy-" not in text


def test_single_run_document_and_reference_override(tmp_path):
    run = _synthetic_run("dir-0.1", 2)
    for key in ("scenario", "seed", "setting"):
        del run[key]
    run.update({"schema-version": 2, "kind": "run"})
    summary = summarize_study(run, reference="local")
    assert summary["reference"] == "local" and len(summary["groups"]) == 1
    group = summary["groups"][0]
    assert (group["scenario"], group["seeds"]) == ("", [2])
    entry = group["methods"]["pflalign"]
    assert entry["metrics"]["personal-acc"]["low"] is None  # one seed: no interval
    assert entry["vs-reference"]["diffs"] == pytest.approx([0.81 - 0.78])
    assert entry["vs-reference"]["significant"] is False
    (tmp_path / "results.json").write_text(json.dumps(run))
    result = _report_cli(tmp_path, "--reference", "local")
    assert result.returncode == 0, result.stderr[-3000:]
    text = (tmp_path / "report.md").read_text()
    assert "# Run report" in text and "### Paired differences vs local" in text
    bad = _report_cli(tmp_path, "--reference", "nope")
    assert bad.returncode == 2 and "Unknown reference method 'nope'" in bad.stderr


# ---------------------------------------------------------------------------------------------
# Real runs: two seeds of simulate.py (sequential engine), assembled into a study
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_study(tmp_path_factory):
    runs = []
    for seed in (0, 1):
        out = tmp_path_factory.mktemp(f"seed{seed}")
        result = subprocess.run(
            [sys.executable, str(ROOT / "simulate.py"), "--set", "engine=sequential",
             "--set", "rounds=2", "--set", "max-samples=2000", "--set", "num-clients=6",
             "--set", "eval-every=1", "--set", f"seed={seed}", "--methods", "fedavg,pflalign",
             "--out", str(out), "--overwrite", "--quiet"],
            capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        run = json.loads((out / "results.json").read_text())
        run.update({"scenario": "dir-0.1", "seed": seed, "setting": {}})
        runs.append(run)
    doc = {"schema-version": 2, "kind": "study", "command": "test",
           "protocol": {"seeds": [0, 1], "reference": "fedavg", "metric": "personal-acc",
                        "scenarios": ["dir-0.1"], "sweep": {}, "tune": None}, "runs": runs}
    directory = tmp_path_factory.mktemp("real-study")
    (directory / "results.json").write_text(json.dumps(doc))
    return directory, doc


#: Paths opened for reading while recording (None: not recording). An audit hook cannot be
#: removed, so one hook is installed once and switched by this list.
_OPENED: list[tuple[str, str]] | None = None
_HOOKED = False


def _audit(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open":
        _OPENED.append((str(args[0]), str(args[1])))  # (path, mode; None for os.open)


@needs_fashion_mnist
def test_real_study_report_reads_only_results_json(real_study, tmp_path):
    global _OPENED, _HOOKED
    from pflalign.outputs.report import main

    source, doc = real_study
    shutil.copy(source / "results.json", tmp_path / "results.json")  # nothing else comes along
    if not _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED = True
    _OPENED = []
    try:
        main([str(tmp_path)])
    finally:
        opened, _OPENED = _OPENED, None
    roots = [str(tmp_path.parent), str(source)]  # this session's folders: every run, the study
    reads = {path for path, mode in opened if any(path.startswith(r) for r in roots)
             and not any(flag in mode for flag in "wax+")}
    assert reads == {str(tmp_path / "results.json")}

    text = (tmp_path / "report.md").read_text()
    finals = [run["methods"]["pflalign"]["final"]["personal-acc"] for run in doc["runs"]]
    row = next(line for line in _section(text, "## Leaderboard").splitlines()
               if line.startswith("| pflalign |"))
    assert f"| {100 * sum(finals) / 2:.2f} [" in row
    names = {p.name for p in (tmp_path / "plots").glob("*.png")}
    assert names == {f"{kind}-dir-0.1.png" for kind in PLOT_KINDS}
    for name in sorted(names):
        _check_png(tmp_path / "plots" / name)


@needs_fashion_mnist
def test_real_report_opens_with_what_ran(real_study, tmp_path):
    """report.md's first section names the dataset (with its content fingerprint), the model
    and its size, the partition, clients, rounds, local work, each method's resolved
    hyperparameters, the engine, seeds and versions, as the runs' results.json recorded them."""
    from pflalign.run.config import build_settings
    from pflalign.run.driver import template_model

    source, doc = real_study
    shutil.copy(source / "results.json", tmp_path / "results.json")
    write_report(tmp_path, doc)
    text = (tmp_path / "report.md").read_text()
    assert text.index("## Setup") < text.index("## Protocol") < text.index("## Leaderboard")
    setup = _section(text, "## Setup")
    run = doc["runs"][0]
    config = build_settings({k: v for k, v in run["config"].items() if k != "out-dir"})
    size = sum(p.numel() for p in template_model(config)().parameters())
    assert run["methods"]["fedavg"]["model"] == {"name": "cnn", "parameters": size}
    fingerprints = [r["partition"]["fingerprint"] for r in doc["runs"]]
    assert len(set(fingerprints)) == 2  # max-samples draws another subset per seed
    assert f"- Dataset: fashion-mnist, 2,000 samples in use, content fingerprint " \
           f"`{fingerprints[0]}`" in setup
    assert f"- Model: cnn ({size:,} trainable parameters)" in setup
    assert "- Partition: dirichlet (dirichlet-alpha = 0.1, min-samples-per-client" in setup
    assert "- Clients: 6 training" in setup and "- Rounds: 2, evaluated every 1" in setup
    assert "- Engine: sequential; seeds: 0, 1" in setup
    assert f"flwr {run['versions']['flwr']}" in setup and f"torch {run['versions']['torch']}" \
        in setup
    rows = {line.split(" | ")[0][2:]: line for line in setup.splitlines() if line.startswith("| ")}
    assert "pflalign-lr = 3.0" in rows["pflalign"] and "lr = 0.05" in rows["fedavg"]
    assert run["methods"]["pflalign"]["hyperparameters"]["pflalign-gamma"] == "adaptive"


def test_setup_marks_tuned_values_and_one_seed_prints_no_empty_tests(tmp_path):
    doc = _synthetic_study()
    for run in doc["runs"]:
        run["config"].update({"dataset": "synthetic", "partition": "dirichlet",
                              "dirichlet-alpha": 0.3, "num-clients": 6, "engine": "batched"})
        for label, entry in run["methods"].items():
            entry["hyperparameters"] = {"lr": 0.05} if label != "pflalign" else {
                "pflalign-lr": 3.0, "pflalign-beta": 0.9}
    text = format_text(doc)
    setup = _section(text, "## Setup")
    assert "| pflalign | pflalign | pflalign-lr = 3.0 *, pflalign-beta = 0.9 |" in setup
    assert "(* chosen by tuning on validation data)" in setup
    assert "- Partition: dirichlet (dirichlet-alpha = 0.3" in setup
    one = _synthetic_run("dir-0.1", 0)
    for key in ("scenario", "seed", "setting"):
        del one[key]
    one.update({"schema-version": 2, "kind": "run"})
    one["config"]["dataset"] = "my-table"
    single = format_text(one)
    assert "Holm" not in single and "over all 0" not in single and "p (Holm)" not in single
    assert "## my-table" in single  # a single run's group is named by its dataset, not 'run'
    assert "(one seed per method: no interval and no test)" in single


def format_text(doc: dict) -> str:
    from pflalign.outputs.report import format_report
    return format_report(summarize_study(doc), doc)


def test_accuracy_at_equal_simulated_time_reads_each_seed_as_time_budget_does(tmp_path):
    """The simulated-time plot's points: at each time some seed evaluated (within the span every
    seed covers), each seed's last evaluation by then, averaged over seeds."""
    from pflalign.outputs import plots

    def run(points):
        return {"methods": {"fedavg": {"rounds": [
            {"round": i + 1, "sim-time": t, "personal-acc": a} for i, (t, a) in
            enumerate(points)] + [{"round": 99, "sim-time": 1.0}]}}}  # a row without accuracy

    runs = {0: run([(3600.0, 0.5), (7200.0, 0.7)]),
            1: run([(1800.0, 0.4), (5400.0, 0.6), (9000.0, 0.8)])}
    series = plots.per_time(runs, "fedavg", "personal-acc")
    assert [hours for hours, _ in series] == [1.0, 1.5, 2.0]
    assert [ci[0] for _, ci in series] == pytest.approx([0.45, 0.55, 0.65])
    path = plots.plot_accuracy_time(tmp_path / "simtime.png", runs, ["fedavg"],
                                    {"fedavg": "C0"}, "t")
    _check_png(path)
    for rows in (runs[0]["methods"]["fedavg"]["rounds"], runs[1]["methods"]["fedavg"]["rounds"]):
        for row in rows:
            row.pop("sim-time")
    assert plots.per_time(runs, "fedavg", "personal-acc") == []
    assert plots.plot_accuracy_time(tmp_path / "none.png", runs, ["fedavg"],
                                    {"fedavg": "C0"}, "t") is None


def test_a_study_by_perplexity_ranks_low_first_and_keeps_its_intervals_above_one(tmp_path):
    """--metric personal-ppl: the same study with each final perplexity 1 + 10 (1 - acc), which
    orders the methods as their accuracies do, so the ranks must equal the accuracy study's."""
    doc = _synthetic_study()
    doc["protocol"]["metric"] = "personal-ppl"
    doc["protocol"]["tune"] = None
    for run in doc["runs"]:
        for entry in run["methods"].values():
            entry["final"]["personal-ppl"] = 1.0 + 10.0 * (1.0 - entry["final"]["personal-acc"])
            for row in entry["rounds"]:
                row["personal-ppl"] = 12.0 - row["round"]
            entry["rounds"].insert(0, {"round": 0, "personal-ppl": 12.0})  # eval-at-start
    summary = summarize_study(doc)
    by_accuracy = summarize_study(_synthetic_study())
    assert summary["friedman"]["average-rank"] == by_accuracy["friedman"]["average-rank"]
    for group, accuracy_group in zip(summary["groups"], by_accuracy["groups"], strict=True):
        for label, entry in group["methods"].items():
            assert entry["rank"] == accuracy_group["methods"][label]["rank"]
            ci = entry["metrics"]["personal-ppl"]
            assert 1.0 < ci["low"] <= ci["mean"] <= ci["high"]
            if entry["vs-reference"]:  # a win is a seed with a lower perplexity
                vs, acc_vs = entry["vs-reference"], accuracy_group["methods"][label]["vs-reference"]
                assert (vs["wins"], vs["losses"]) == (acc_vs["wins"], acc_vs["losses"])
                assert vs["wins"] == sum(d < 0 for d in vs["diffs"])
    write_report(tmp_path, doc)
    text = (tmp_path / "report.md").read_text()
    assert "final `personal-ppl`" in text
    for scenario in FINALS:  # the metric per round, from the round-0 evaluation
        _check_png(tmp_path / "plots" / f"metric-{scenario}.png")
        assert f"personal-ppl per round ({scenario})" in text


def test_a_suite_tuned_per_scenario_lists_every_methods_trials_per_scenario(tmp_path):
    doc = _synthetic_study()
    tune = doc["protocol"]["tune"]
    tune["draw"] = "Optuna: configured values first, then TPE"
    tune["scenarios"] = {scenario: {"pflalign": dict(tune["methods"]["pflalign"],
                                                     space={"pflalign-lr": "log-uniform [1, 10]"})}
                         for scenario in FINALS}
    del tune["methods"]
    write_report(tmp_path, doc)
    text = (tmp_path / "report.md").read_text()
    assert "- Trials: Optuna: configured values first, then TPE" in text
    for scenario in FINALS:
        section = _section(text, f"#### {scenario}")
        assert ("| pflalign | `pflalign-lr` ∈ log-uniform [1, 10] | pflalign-lr=3.0 | 65.50 | "
                "pflalign-lr=1.0: 61.20; pflalign-lr=3.0: 65.50 ✓ |") in section


def _tuned_at(chosen_lr: float) -> dict:
    """A planted tuned suite: pflalign's trials at lr 0.01, 0.05 and 0.198 of log-uniform
    [0.005, 0.2], the one at ``chosen_lr`` scoring best."""
    doc = _synthetic_study()
    trials = [{"params": {"lr": lr}, "score": 0.7 if lr == chosen_lr else 0.6 + lr,
               "scores": [0.6, 0.6]} for lr in (0.05, 0.198, 0.01)]
    trials.append({"params": {"lr": 0.198}, "score": None, "scores": [None, 0.6]})  # failed
    doc["protocol"]["tune"]["scenarios"] = {scenario: {"pflalign": {
        "space": {"lr": "log-uniform [0.005, 0.2]"}, "default": {"lr": 0.05},
        "chosen": {"lr": chosen_lr}, "trials": trials}} for scenario in FINALS}
    del doc["protocol"]["tune"]["methods"]
    return doc


def test_a_tuned_choice_at_its_ranges_edge_is_flagged_with_its_trials(tmp_path):
    write_report(tmp_path / "edge", _tuned_at(0.198))
    text = (tmp_path / "edge" / "report.md").read_text()
    assert "**Choices at a range's edge** (within 5% of its width" in text
    for scenario in FINALS:
        assert (f"- pflalign on {scenario}: `lr` = 0.198, at the high end of log-uniform "
                "[0.005, 0.2]; its trials (`lr`: validation `personal-acc`): 0.01: 61.00, "
                "0.05: 65.00, 0.198: 70.00 ✓, 0.198: -") in text
        assert "| lr=0.198 ⚠ lr at the high end |" in _section(text, f"#### {scenario}")
    write_report(tmp_path / "inside", _tuned_at(0.05))
    text = (tmp_path / "inside" / "report.md").read_text()
    assert "range's edge" not in text and "⚠" not in text


def test_the_edge_of_a_search_range_by_hand():
    from pflalign.settings.params import Search, edges, log_range, uniform_range

    lr = log_range(0.005, 0.2)  # 5% of ln(40) is 0.1844: the ends 0.006013 and 0.1663
    assert [lr.edge(v) for v in (0.005, 0.006, 0.0061, 0.05, 0.166, 0.167, 0.2)] == [
        "low", "low", None, None, None, "high", "high"]
    beta = uniform_range(0.8, 0.95)  # 5% of 0.15 is 0.0075: the ends 0.8075 and 0.9425
    assert [beta.edge(v) for v in (0.807, 0.808, 0.942, 0.943)] == ["low", None, None, "high"]
    assert Search(choices=(0.1, 1.0)).edge(1.0) is None
    assert Search.parse(lr.describe()) == lr and Search.parse("{0.1, 1.0}") is None
    assert edges({"lr": "log-uniform [0.005, 0.2]", "mu": "{0.0, 0.1}", "beta": [0.8, 0.9]},
                 {"lr": 0.19, "mu": 0.1, "beta": 0.9}) == {"lr": "high"}  # a grid: no edge


def test_versions_name_the_commit_that_ran():
    from pflalign.outputs.results import versions

    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    commit = versions()["commit"]
    assert commit in (head, f"{head}+modified")
    changed = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain",
                              "--untracked-files=no"], capture_output=True, text=True).stdout
    assert commit.endswith("+modified") == bool(changed.strip())


def test_a_long_run_says_after_its_first_round_how_long_the_rest_takes(capsys):
    from pflalign.outputs.results import Reporter, estimate_line

    line = estimate_line("pflalign", {"round": 1, "round-seconds": 30.0}, 11)
    assert line == ("[pflalign] round 1 took 30 s, so the other 10 rounds take about 5 min; "
                    "local-steps (optimizer steps per round), local-epochs, fraction-train and "
                    "max-samples bound a round's work.")
    assert estimate_line("a", {"round": 1, "round-seconds": 30.0}, 5) is None  # 120 s: short
    assert estimate_line("a", {"round": 2, "round-seconds": 300.0}, 50) is None  # once
    assert estimate_line("a", {"round": 1, "round-seconds": 3000.0}, 6).endswith(
        "about 4.2 h; local-steps (optimizer steps per round), local-epochs, fraction-train "
        "and max-samples bound a round's work.")
    Reporter().round("x", {"round": 1, "round-seconds": 61.0, "bytes-up": 0, "bytes-down": 0},
                     3)
    out = capsys.readouterr().out.splitlines()
    assert out[1] == ("[x] round 1 took 61 s, so the other 2 rounds take about 2 min; "
                      "local-steps (optimizer steps per round), local-epochs, fraction-train "
                      "and max-samples bound a round's work.")


def test_the_partition_heatmap_names_clients_and_classes(tmp_path, monkeypatch):
    from pflalign.outputs import plots

    drawn = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.append(fig) or path)
    run = {"seed": 0, "partition": {"dataset": "shapes", "class-names": ["circle", "square"],
                                    "clients": [
        {"id": 0, "name": "carol", "unseen": False, "train-labels": [3, 1]},
        {"id": 1, "name": "alice", "unseen": True, "train-labels": [0, 4]}]}}
    plots.plot_partition(tmp_path / "p.png", run, "t")
    (ax, _) = drawn[0].axes  # the heatmap and its colour bar
    assert [t.get_text() for t in ax.get_yticklabels()] == ["carol", "alice*"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["circle", "square"]
    del run["partition"]["class-names"]
    for client in run["partition"]["clients"]:
        del client["name"]
    plots.plot_partition(tmp_path / "q.png", run, "t")
    (ax, _) = drawn[1].axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "1*"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1"]
