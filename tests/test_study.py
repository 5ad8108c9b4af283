"""Studies: seeds, sweeps, scenarios, equal-budget tuning on validation data, and resume."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, needs_fashion_mnist
from processes import kill_once

from pflalign.data import federated
from pflalign.data.federated import federated_dataset, validation_partition
from pflalign.methods.registry import METHODS
from pflalign.outputs.results import Reporter
from pflalign.process import caches
from pflalign.process.interrupt import Interrupted, request_stop, reset
from pflalign.run import tuning
from pflalign.run.config import (
    ConfigError,
    MethodChoice,
    build_settings,
    method_choices,
    parse_methods,
    resolve,
)
from pflalign.run.driver import simulate
from pflalign.run.study import (
    Plan,
    Study,
    entry,
    entry_label,
    method_budget,
    method_space,
    parse_seeds,
    parse_sweep,
    scenario_names,
    scenario_values,
    trial_score,
)
from pflalign.settings.params import choice, log_range
from pflalign.settings.schema import DATA_KEYS, Settings

TINY = {"engine": "sequential", "num-clients": 4, "max-samples": 800, "rounds": 2,
        "fraction-train": 0.5, "eval-every": 1, "methods": "fedavg,pflalign",
        "checkpoint-every": 1}


def run_group(settings: Settings, reporter: Reporter, resume: bool) -> dict:
    return simulate(settings, reporter, resume=resume)


def tiny_plan(tmp_path, **changes) -> Plan:
    values = build_settings(TINY).to_dict()
    values["out-dir"] = str(tmp_path)
    fields = {"scenarios": {"": values}, "seeds": (0, 1), "out_dir": str(tmp_path)}
    fields.update(changes)
    return Plan(**fields)


# --- parsing ------------------------------------------------------------------------------------
def test_seeds_parse_lists_and_ranges_and_reject_junk():
    assert parse_seeds("0,1,2") == (0, 1, 2)
    assert parse_seeds("3-5,1,4") == (3, 4, 5, 1)
    for bad in ("", "a", "-1", "5-3", "1.5"):
        with pytest.raises(ConfigError):
            parse_seeds(bad)


def test_sweep_values_are_validated_against_the_schema():
    assert parse_sweep(["lr=0.01,0.05", "fraction-train=0.5"]) == {
        "lr": (0.01, 0.05), "fraction-train": (0.5,)}
    with pytest.raises(ConfigError, match="out of range"):
        parse_sweep(["lr=0.01,-1"])
    with pytest.raises(ConfigError, match="--seeds"):
        parse_sweep(["seed=1,2"])
    with pytest.raises(ConfigError, match="Unknown config key"):
        parse_sweep(["learning-rate=0.1"])


def test_every_scenario_loads_and_the_suite_covers_the_regimes():
    names = scenario_names()
    assert {"dir-0.1", "dir-0.5", "pathological-2", "cross-device", "quantity",
            "rotated-unseen"} <= set(names)
    partitions = {n: scenario_values(n, [], {})["partition"] for n in names}
    assert partitions["pathological-2"] == "pathological"
    assert partitions["rotated-unseen"] == "rotated"
    cross = scenario_values("cross-device", ["rounds=3"], {})
    assert cross["num-clients"] >= 100 and cross["fraction-train"] <= 0.1
    assert cross["rounds"] == 3
    with pytest.raises(ConfigError, match="Unknown scenario"):
        scenario_values("no-such-scenario", [], {})


def test_the_language_suite_is_its_own_and_its_scenarios_load_by_name():
    assert scenario_names("language") == ["lora-shakespeare", "shakespeare"]
    assert not set(scenario_names("language")) & set(scenario_names())
    shakespeare = scenario_values("shakespeare", ["rounds=2"], {})
    assert (shakespeare["dataset"], shakespeare["partition"], shakespeare["rounds"]) == (
        "shakespeare", "natural", 2)
    assert scenario_values("lora-shakespeare", [], {})["model"] == "hf:smollm2-135m"
    with pytest.raises(ConfigError, match="Unknown suite 'vision'; the suites are: default, "
                                          "language"):
        scenario_names("vision")
    with pytest.raises(ConfigError, match=r"Unknown scenario 'dir-9'.*language: "
                                          "lora-shakespeare, shakespeare"):
        scenario_values("dir-9", [], {})


def test_tuning_and_evaluation_seeds_must_be_disjoint(tmp_path):
    with pytest.raises(ConfigError, match="overlap"):
        tiny_plan(tmp_path, tune=2, tune_seeds=(1, 7))
    with pytest.raises(ConfigError, match="--reference"):
        tiny_plan(tmp_path, reference="ditto")
    assert tiny_plan(tmp_path).reference == "fedavg"
    with pytest.raises(ConfigError, match="--tune chooses"):
        tiny_plan(tmp_path, tune=2, tune_seeds=(9,), sweep={"lr": (0.01, 0.1)})


def test_the_metric_is_checked_and_kept_in_the_plan(tmp_path):
    with pytest.raises(ConfigError, match="--metric 'accuracy' is not a metric a run reports "
                                          "at its end; choose one of personal-acc, "):
        tiny_plan(tmp_path, metric="accuracy")
    plan = tiny_plan(tmp_path, metric="personal-loss")
    plan.save()
    assert Plan.load(tmp_path).metric == "personal-loss"
    old = json.loads((tmp_path / "plan.json").read_text())
    del old["metric"]  # a plan written before --metric
    assert Plan.from_json(old).metric == "personal-acc"


@needs_fashion_mnist
def test_tuning_by_a_loss_minimizes_it(tmp_path):
    doc = Study(tiny_plan(tmp_path, seeds=(0,), tune=3, tune_seeds=(5,),
                          metric="personal-loss"), run_group, Reporter(quiet=True)).run()
    assert doc["protocol"]["metric"] == "personal-loss"
    for row in doc["protocol"]["tune"]["methods"].values():
        scores = [t["score"] for t in row["trials"]]
        assert len(scores) == 3 and len(set(scores)) == 3
        assert row["chosen"] == row["trials"][scores.index(min(scores))]["params"]
    import optuna
    storage = f"sqlite:///{tmp_path / 'tuning' / 'config' / 'optuna.db'}"
    assert {s.direction for s in optuna.get_all_study_summaries(storage)} == {
        optuna.study.StudyDirection.MINIMIZE}


def test_a_trial_whose_final_evaluation_rejected_a_reply_fails(tmp_path, monkeypatch, capsys):
    """A client whose personal model diverged reports a non-finite loss, and its reply is
    rejected: the trial's metric would cover only the other clients (in the tuned suite a
    learning rate that diverged on 27 of 30 clients scored 100% on the other 3), so the trial
    fails instead, and the report marks test runs whose final evaluation left clients out."""
    from tampering import tampering_handle

    from pflalign.engines import sequential as sequential_engine
    from pflalign.outputs.report import leaderboard_text, summarize_study

    monkeypatch.setattr(sequential_engine, "handle",
                        tampering_handle({1: "nan-eval-loss"}, sequential_engine.handle))
    doc = Study(tiny_plan(tmp_path, seeds=(0,), tune=2, tune_seeds=(5,)), run_group,
                Reporter(quiet=True)).run()
    rows = doc["protocol"]["tune"]["methods"]
    assert set(rows) == {"fedavg", "pflalign"}
    for row in rows.values():
        assert [(t["scores"], t["score"]) for t in row["trials"]] == [([None], None)] * 2
        assert row["chosen"] == row["trials"][0]["params"]  # nothing scored: the first trial
    warnings = capsys.readouterr().err
    assert warnings.count("the final evaluation rejected 1 of 4 clients' replies") == 4
    groups = summarize_study(doc)["groups"]
    assert [(p["method"], p["seed"], p["evaluated"], p["eval-clients"])
            for p in groups[0]["partial"]] == [("fedavg", 0, 3, 4), ("pflalign", 0, 3, 4)]
    text = leaderboard_text(doc)
    assert text.count(" †") == 2 and "fedavg seed 0: 3 of 4 clients (1 replies rejected)" in text


def test_a_trial_score_is_the_final_metric_unless_a_reply_was_rejected():
    final = {"personal-acc": 0.8, "evaluated": 3, "eval-clients": 4, "eval-failures": 1,
             "eval-rejected": 0}
    assert trial_score(final, "personal-acc") == 0.8  # a client that did not answer: kept
    assert trial_score({**final, "eval-rejected": 1}, "personal-acc") is None
    assert trial_score({**final, "personal-acc": float("nan")}, "personal-acc") is None
    assert trial_score({"personal-loss": 0.3}, "personal-loss") == 0.3
    assert trial_score({"personal-loss": 0.3}, "personal-acc") is None


# --- trials -------------------------------------------------------------------------------------
def test_a_methods_space_is_its_declared_ranges_less_what_its_entry_fixes():
    settings = build_settings({"methods": "fedprox"})
    space, configured = method_space(method_choices(settings)[0], settings)
    assert space == {"lr": log_range(0.005, 1.0), "fedprox-mu": log_range(0.001, 1.0)}
    assert configured == {"lr": 0.05, "fedprox-mu": 0.01}
    assert method_budget(space, 7) == 7
    fixed = build_settings({"methods": "fedprox(fedprox-mu=0.5),local(lr=0.1)"})
    (mu_fixed, _), (nothing, _) = (method_space(c, fixed) for c in method_choices(fixed))
    assert list(mu_fixed) == ["lr"]
    assert nothing == {} and method_budget(nothing, 7) == 1  # runs once, as configured
    text = entry(method_choices(fixed)[0], {"lr": 0.0123})
    assert text == "fedprox(fedprox-mu=0.5,lr=0.0123)"
    assert parse_methods(text)[0].label == entry_label(method_choices(fixed)[0], {"lr": 0.0123})


def test_a_search_is_a_checked_range_or_set():
    assert log_range(0.01, 1.0).contains(0.01) and not log_range(0.01, 1.0).contains(1.5)
    assert choice(0.0, 0.1).contains(0.0) and not choice(0.0, 0.1).contains(0.2)
    assert log_range(0.005, 0.2).describe() == "log-uniform [0.005, 0.2]"
    assert choice(0.0, 0.1, 1.0).describe() == "{0.0, 0.1, 1.0}"
    for bad in (lambda: log_range(0.0, 1.0), lambda: log_range(1.0, 1.0),
                lambda: choice(1, 1)):
        with pytest.raises(ValueError):
            bad()


def _asked(search: tuning.MethodSearch, scores: list[float]) -> list[dict]:
    points = []
    for number, score in enumerate(scores):
        points.append(search.point(number))
        search.tell(number, score)
    return points


def test_trials_start_at_the_configured_values_then_follow_the_seeded_sampler(tmp_path):
    space = {"lr": log_range(0.005, 0.2), "fedprox-mu": log_range(0.001, 1.0)}
    configured = {"lr": 0.05, "fedprox-mu": 0.01}
    scores = [0.5, 0.6, 0.4, 0.7, 0.55, 0.65]

    def search(folder, seed=100):
        return tuning.MethodSearch(tmp_path / folder / "optuna.db", "fedprox", space,
                                   configured, budget=6, seed=seed)

    points = _asked(search("a"), scores)
    assert points[0] == configured
    assert len({tuple(p.values()) for p in points}) == 6
    assert all(0.005 <= p["lr"] <= 0.2 and 0.001 <= p["fedprox-mu"] <= 1.0 for p in points)
    assert _asked(search("b"), scores) == points  # seeded: the same trials, told the same
    assert _asked(search("c", seed=101), scores)[1:] != points[1:]
    # a new process on the same storage reads the trials back, and asks the next one as the
    # first process would have: ask trial 3 of a copy that stopped after telling trial 2
    stopped = search("d")
    _asked(stopped, scores[:3])
    stopped.point(3)  # asked, never told (killed while it ran)
    again = search("d")
    assert [again.point(n) for n in range(4)] == points[:4]
    again.tell(3, scores[3])
    assert [again.point(4)] == [points[4]]
    assert tuning.startup_trials(6) == 2 and tuning.startup_trials(20) == 5
    # configured values outside the space are not a trial
    outside = tuning.MethodSearch(tmp_path / "e" / "optuna.db", "fedprox", space,
                                  {"lr": 0.5, "fedprox-mu": 0.01}, budget=3, seed=100)
    assert outside.point(0)["lr"] <= 0.2


def test_a_variant_without_the_preconditioner_searches_the_sgd_rate():
    assert "lr" in METHODS["pflalign-sgd"].search_space
    assert "pflalign-lr" not in METHODS["pflalign-sgd"].search_space
    assert set(METHODS["pflalign"].search_space) == {"pflalign-lr", "pflalign-beta"}


# --- validation data ----------------------------------------------------------------------------
@needs_fashion_mnist
def test_the_validation_split_comes_from_training_data_only():
    base = resolve(None, ["max-samples=3000", "num-clients=6"])
    test_mode = federated_dataset(base).partition
    val_mode = federated_dataset(base.replace({"evaluate-on": "validation"})).partition
    for c in range(6):
        train, val = val_mode.train[c], val_mode.test[c]
        assert len(val) >= 1 and not np.intersect1d(train, val).size
        assert np.array_equal(np.sort(np.concatenate([train, val])), test_mode.train[c])
        assert not np.intersect1d(val, test_mode.test[c]).size
    labels = federated_dataset(base).dataset.labels[federated_dataset(base).pool]
    again = validation_partition(test_mode, labels, 0.2, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(again.test, val_mode.test, strict=True))


@needs_fashion_mnist
def test_tuning_never_reads_test_data(tmp_path, monkeypatch):
    """Tuning twice, the second time with every test image of the partition replaced by noise:
    every trial's validation scores and every choice are identical. A selection that read a
    test metric, or a trial that trained or evaluated on a test sample, would differ."""
    plan_args = {"seeds": (0,), "tune": 2, "tune_seeds": (5,)}
    clean = Study(tiny_plan(tmp_path / "clean", **plan_args), run_group,
                  Reporter(quiet=True)).run()

    real_build = federated._build.__wrapped__

    def poisoned(key: tuple) -> federated.FederatedDataset:
        built = real_build(key)
        cfg = dict(zip(DATA_KEYS, key, strict=True))
        test_key = tuple("test" if k == "evaluate-on" else v for k, v in cfg.items())
        test_split = real_build(test_key)
        images = built.dataset.images.copy()
        rng = np.random.default_rng(0)
        for idx in test_split.partition.test:
            rows = test_split.pool[idx]
            images[rows] = rng.integers(0, 256, images[rows].shape, dtype=np.uint8)
        return dataclasses.replace(built, dataset=dataclasses.replace(built.dataset,
                                                                      images=images))

    caches.reset()
    monkeypatch.setattr(federated, "_build", poisoned)
    try:
        dirty = Study(tiny_plan(tmp_path / "dirty", **plan_args), run_group,
                      Reporter(quiet=True)).run()
    finally:
        monkeypatch.undo()
        caches.reset()
    tuned, poisoned_tuned = clean["protocol"]["tune"], dirty["protocol"]["tune"]
    assert tuned["methods"] == poisoned_tuned["methods"]
    for label in ("fedavg", "pflalign"):
        row = tuned["methods"][label]
        assert len(row["trials"]) == 2 and all(math.isfinite(t["score"]) for t in row["trials"])
        assert row["chosen"] == max(row["trials"], key=lambda t: t["score"])["params"]
    # ...while the evaluation on test data does see the noise
    acc = [doc["runs"][0]["methods"]["fedavg"]["final"]["personal-acc"] for doc in (clean, dirty)]
    assert acc[0] != acc[1]


# --- a study end to end, and its resume ---------------------------------------------------------
@needs_fashion_mnist
def test_a_study_over_seeds_and_a_sweep_and_its_resume_after_a_stop(tmp_path, monkeypatch):
    plan = tiny_plan(tmp_path / "whole", sweep={"lr": (0.02, 0.05)})
    whole = Study(plan, run_group, Reporter(quiet=True)).run()
    assert [(r["setting"]["lr"], r["seed"]) for r in whole["runs"]] == [
        (0.02, 0), (0.02, 1), (0.05, 0), (0.05, 1)]
    # the runs are the plain runs of each seed and setting
    plain = simulate(build_settings({**TINY, "lr": 0.05, "seed": 1,
                                          "out-dir": str(tmp_path / "plain")}),
                                Reporter(quiet=True))
    assert (whole["runs"][3]["methods"]["pflalign"]["final"]["personal-acc"]
            == plain["methods"]["pflalign"]["final"]["personal-acc"])
    for name in ("results.json", "results.csv", "report.md", "plan.json"):
        assert (tmp_path / "whole" / name).is_file()
    # stop after the second group has run a round, then resume: the same numbers
    stopped = tiny_plan(tmp_path / "stopped", sweep={"lr": (0.02, 0.05)})
    reporter = Reporter(quiet=True)
    calls = []

    def stopping_group(settings, rep, resume):
        calls.append(settings["out-dir"])
        if len(calls) == 2:
            rep_round = rep.round

            def round_then_stop(label, row, rounds):
                rep_round(label, row, rounds)
                request_stop()
            monkeypatch.setattr(rep, "round", round_then_stop)
        return run_group(settings, rep, resume)

    with pytest.raises(Interrupted):
        Study(stopped, stopping_group, reporter).run()
    reset()
    monkeypatch.undo()
    resumed = Study(Plan.load(tmp_path / "stopped"), run_group, Reporter(quiet=True),
                    resume=True).run()

    def metrics(doc):
        return [{label: {k: v for k, v in m["final"].items() if "seconds" not in k}
                 for label, m in run["methods"].items()} for run in doc["runs"]]
    assert metrics(resumed) == metrics(whole)
    on_disk = json.loads((tmp_path / "stopped" / "results.json").read_text())
    assert metrics(on_disk) == metrics(whole)


def test_entry_labels_round_trip_through_the_parser():
    choice = MethodChoice("fedavg", "fedavg")
    assert entry(choice, {}) == "fedavg"
    assert entry_label(choice, {"lr": 0.1}) == "fedavg(lr=0.1)"


def test_the_command_line_refuses_bad_study_options_in_one_line(tmp_path, capsys):
    import simulate

    cases = [
        (["--resume", str(tmp_path / "nothing")], "no plan.json"),
        (["--seeds", "0,1", "--tune", "2", "--tune-seeds", "1"], "overlap"),
        (["--scenario", "no-such"], "Unknown scenario"),
        (["--seeds", "0,x"], "--seeds takes"),
        (["--reference", "ditto", "--methods", "fedavg,local"], "--reference 'ditto'"),
        (["--sweep", "lr=0.1,0.1"], "lists a value twice"),
    ]
    for argv, message in cases:
        assert simulate.main([*argv, "--out", str(tmp_path / "out")]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "out").exists()  # nothing was started


# --- tuning: an equal budget, and a resume after SIGKILL ----------------------------------------
def _tune_command(out, resume: bool) -> list[str]:
    if resume:
        return [sys.executable, str(ROOT / "simulate.py"), "--resume", str(out), "--quiet"]
    overrides = [f"{k}={v}" for k, v in TINY.items() if k != "methods"]
    return [sys.executable, str(ROOT / "simulate.py"), "--methods",
            "fedavg,pflalign,fedavg(lr=0.02)", "--tune", "3", "--tune-seeds", "5",
            "--seeds", "0", "--out", str(out), "--quiet",
            *[a for o in overrides for a in ("--set", o)]]


@needs_fashion_mnist
def test_tuning_gives_every_method_the_same_trials_and_rounds_and_resumes_after_sigkill(
        tmp_path):
    """Three trials for each method with a space (one for fedavg(lr=0.02), which has none), each
    trial a run of the same two rounds; a tuning killed with SIGKILL while its second trial runs
    and resumed gives the same trials, scores, choices and test metrics as one never killed."""
    whole = subprocess.run(_tune_command(tmp_path / "whole", False), cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0, whole.stderr[-3000:]
    doc = json.loads((tmp_path / "whole" / "results.json").read_text())
    tuned = doc["protocol"]["tune"]["methods"]
    assert {label: len(row["trials"]) for label, row in tuned.items()} == {
        "fedavg": 3, "pflalign": 3, "fedavg(lr=0.02)": 1}
    assert tuned["fedavg"]["trials"][0]["params"] == {"lr": 0.05}  # the configured values first
    assert tuned["fedavg"]["space"] == {"lr": "log-uniform [0.005, 1]"}
    rounds: dict[str, list[int]] = {}
    for path in sorted((tmp_path / "whole" / "tuning" / "config").glob("trial-*/seed-5")):
        for label, entry_ in json.loads((path / "results.json").read_text())["methods"].items():
            rounds.setdefault(label.split("(")[0] if label != "fedavg(lr=0.02)" else label,
                              []).append(len(entry_["rounds"]))
    assert rounds == {"fedavg": [2, 2, 2], "pflalign": [2, 2, 2], "fedavg(lr=0.02)": [2]}
    import optuna
    storage = f"sqlite:///{tmp_path / 'whole' / 'tuning' / 'config' / 'optuna.db'}"
    assert {s.study_name: s.n_trials for s in optuna.get_all_study_summaries(storage)} == {
        "fedavg": 3, "pflalign": 3, "fedavg(lr=0.02)": 0}

    log = tmp_path / "killed.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(_tune_command(tmp_path / "killed", False), cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT)
    target = tmp_path / "killed" / "tuning" / "config" / "trial-1" / "seed-5" / "checkpoints"
    kill_once(proc, lambda: target.exists() and any(target.iterdir()), log, timeout=300)
    resumed = subprocess.run(_tune_command(tmp_path / "killed", True), cwd=ROOT,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = json.loads((tmp_path / "killed" / "results.json").read_text())
    assert again["protocol"]["tune"]["methods"] == tuned

    def finals(d):
        return {label: {k: v for k, v in m["final"].items() if "seconds" not in k}
                for label, m in d["runs"][0]["methods"].items()}
    assert finals(again) == finals(doc)
