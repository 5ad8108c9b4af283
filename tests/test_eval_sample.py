"""eval-clients: the final evaluation of a seeded sample of the clients, and its interval for the
whole population (a ratio estimator with the finite-population correction)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from harness import three_engines

from pflalign.outputs.report import write_report
from pflalign.run.config import build_settings
from pflalign.run.driver import simulate
from pflalign.server.metrics import ratio_interval
from pflalign.server.sampling import EVAL_ALL_UP_TO, draw_eval_population


def test_the_interval_by_hand_on_three_clients():
    # y = correct, x = test samples, of 3 clients sampled from 10: R = 6 / 8; the residuals
    # y - R x are -0.5, 0.5, 0, so s^2 = 0.25; (1 - 3/10) / 3 * 0.25 = 0.058333...; mean(x) = 8/3;
    # t(0.975, 2) = 4.302652729749464
    half = 4.302652729749464 * math.sqrt(0.7 / 3 * 0.25) / (8 / 3)
    low, high = ratio_interval([1, 2, 3], [2, 2, 4], 10, bounds=None)
    assert low == pytest.approx(0.75 - half, rel=1e-12)
    assert high == pytest.approx(0.75 + half, rel=1e-12)
    assert ratio_interval([1, 2, 3], [2, 2, 4], 10) == (pytest.approx(0.75 - half), 1.0)
    # the whole population: no sampling error; one client: no interval
    assert ratio_interval([1, 2, 3], [2, 2, 4], 3) == (0.75, 0.75)
    assert all(math.isnan(v) for v in ratio_interval([1], [2], 10))


def test_the_interval_covers_a_planted_populations_pooled_accuracy_about_95_percent():
    rng = np.random.default_rng(0)
    size = 5000
    tests = np.maximum(1, rng.lognormal(3.0, 1.0, size).round())  # heavy-tailed test sizes
    accuracy = rng.beta(2.0, 3.0, size)
    correct = rng.binomial(tests.astype(int), accuracy).astype(float)
    truth = correct.sum() / tests.sum()
    covered = widths = 0.0
    draws = 400
    for _ in range(draws):
        picked = rng.choice(size, 300, replace=False)
        low, high = ratio_interval(correct[picked], tests[picked], size)
        covered += low <= truth <= high
        widths += high - low
    assert 0.92 <= covered / draws <= 0.98
    assert 0.02 < widths / draws < 0.2


def test_the_sample_is_the_seeds_own_and_none_when_everyone_fits():
    clients = range(20000)
    drawn = draw_eval_population(clients, [], 500, seed=3)
    assert len(drawn) == len(set(drawn)) == 500 and drawn == sorted(drawn)
    assert drawn == draw_eval_population(reversed(clients), [], 500, seed=3)  # order-free
    assert drawn != draw_eval_population(clients, [], 500, seed=4)
    assert draw_eval_population(range(500), [], 500, seed=3) is None
    # eval-clients = 0: everyone up to EVAL_ALL_UP_TO, a sample of that many above
    assert draw_eval_population(range(EVAL_ALL_UP_TO), [], 0, seed=0) is None
    assert len(draw_eval_population(range(EVAL_ALL_UP_TO + 1), [], 0, seed=0)) == EVAL_ALL_UP_TO
    # seen and unseen apart: in proportion, the smaller kind at least 100 (at most half)
    mixed = draw_eval_population(range(100_000), range(100_000, 100_150), 10_000, seed=0)
    assert len(mixed) == 10_000 and sum(c >= 100_000 for c in mixed) == 100
    assert [c for c in mixed if c < 100_000] == draw_eval_population(
        range(100_000), [], 9_900, seed=0)  # the seen draw is the seen clients' own
    small = draw_eval_population(range(120), range(120, 130), 40, seed=2)
    assert len(small) == 40 and set(range(120, 130)) <= set(small)


SYNTHETIC = {"dataset": "synthetic", "partition": "natural", "model": "mlp", "num-clients": 120,
             "num-unseen-clients": 10, "fraction-train": 0.05, "local-steps": 3, "rounds": 2,
             "eval-every": 2, "methods": "fedavg,pflalign", "save-models": "none",
             "seed": 2}


def test_every_engine_scores_the_same_sample_and_the_interval_covers_the_full_evaluation(
        tmp_path):
    sampled = three_engines({**SYNTHETIC, "eval-clients": 40}, tmp_path / "sampled", 40)
    flower = json.loads((tmp_path / "sampled" / "f" / "results.json").read_text())
    full = simulate(build_settings({**SYNTHETIC, "engine": "batched",
                                    "out-dir": str(tmp_path / "full")}))
    population = draw_eval_population(range(120), range(120, 130), 40, seed=2)
    for method in ("fedavg", "pflalign"):
        ours = sampled["methods"][method]
        ids = [c["id"] for c in ours["clients"]]
        assert sorted(ids) == population  # every client of the sample answered
        assert [c["id"] for c in flower["methods"][method]["clients"]] == ids
        final, whole = ours["final"], full["methods"][method]["final"]
        assert final["evaluated"] == final["eval-clients"] == 40
        seen = [c for c in ours["clients"] if not c["unseen"]]
        assert final["eval-population"] == 130 and whole["evaluated"] == 130
        assert final["personal-acc"] == pytest.approx(
            sum(c["personal-acc"] * c["num-test"] for c in seen)
            / sum(c["num-test"] for c in seen), rel=1e-12)
        # the same training: only the evaluation differs
        assert [r["train-loss"] for r in ours["rounds"]] == [
            r["train-loss"] for r in full["methods"][method]["rounds"]]
        assert final["personal-acc-ci-low"] <= whole["personal-acc"] <= final[
            "personal-acc-ci-high"]
        assert "personal-acc-ci-low" not in whole and "eval-population" not in whole
    report = write_report(tmp_path / "report", sampled)[0].read_text()
    final = sampled["methods"]["fedavg"]["final"]
    low, high = (100 * final[f"personal-acc-ci-{end}"] for end in ("low", "high"))
    assert (f"fedavg: personal-acc {100 * final['personal-acc']:.4g}% from 40 sampled of 130 "
            f"clients (eval-clients); 95% interval for the whole population [{low:.4g}, "
            f"{high:.4g}]%") in report


def test_results_json_keeps_a_seeded_sample_of_a_long_client_list_and_writes_all_beside(
        tmp_path):
    import gzip

    from pflalign.outputs.results import CLIENTS_IN_RESULTS, write_results

    many = [{"id": i, "num-train": i % 7 + 1, "num-test": 2}
            for i in range(CLIENTS_IN_RESULTS + 50)]
    few = many[:30]
    results = {"config": {"seed": 5}, "partition": {"dataset": "synthetic", "clients": many},
               "methods": {"fedavg(lr=0.1)": {"final": {}, "clients": many},
                           "local": {"final": {}, "clients": few}}}
    written = json.loads(write_results(tmp_path, results).read_text())
    partition, entry = written["partition"], written["methods"]["fedavg(lr=0.1)"]
    for record, name in ((partition, "partition.json.gz"), (entry, entry["clients-file"])):
        assert len(record["clients"]) == CLIENTS_IN_RESULTS
        assert record["clients-total"] == len(many) and record["clients-file"] == name
        ids = [c["id"] for c in record["clients"]]
        assert ids == sorted(set(ids)) and set(ids) < set(range(len(many)))
        with gzip.open(tmp_path / name, "rt") as handle:
            assert json.load(handle) == many
    assert entry["clients-file"].startswith("clients/") and partition["clients"] == entry[
        "clients"]  # one draw: the same clients in both
    assert written["methods"]["local"]["clients"] == few  # short lists stay whole
    assert "clients-total" not in written["methods"]["local"]
    assert results["partition"]["clients"] is many  # the run's own record is left whole
    again = json.loads(write_results(tmp_path / "again", results).read_text())
    assert again["partition"]["clients"] == partition["clients"]  # the seed's own draw
