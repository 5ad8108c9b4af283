"""The evaluation audit: the server recomputes sampled clients' evaluation replies, rejects a
claim that disagrees, and reproduces every honest one exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import needs_fashion_mnist
from harness import server
from test_robustness import BASE, _run

from pflalign.engines.faults import malicious_clients
from pflalign.outputs.results import comparison_table
from pflalign.round.features.audit import AUDIT_STREAM, Audit, audit_sample, disagreement
from pflalign.run.config import build_settings

# --- the rules, by hand ----------------------------------------------------------------------


def test_the_sample_is_keyed_by_the_secret_and_round_and_takes_a_ceiling_share():
    clients = [4, 1, 9, 7, 3, 8, 2]
    drawn = audit_sample(clients, 0.2, secret=5, server_round=3)
    rng = np.random.default_rng([5, 3, AUDIT_STREAM])
    assert drawn == sorted(int(c) for c in rng.choice(sorted(clients), size=2, replace=False))
    assert len(drawn) == math.ceil(0.2 * 7) == 2
    assert drawn == audit_sample(list(reversed(clients)), 0.2, secret=5, server_round=3)
    assert len(audit_sample(clients, 0.01, 5, 3)) == 1  # at least one client
    assert audit_sample(clients, 0.0, 5, 3) == []
    assert audit_sample(clients, 0.2, 5, 3, everyone=True) == sorted(clients)
    assert audit_sample(clients, 0.0, 5, 3, everyone=True) == []  # 0: nothing is audited
    rounds = {tuple(audit_sample(clients, 0.2, 5, r)) for r in range(1, 30)}
    assert len(rounds) > 5  # a new draw every round


def test_counts_must_match_exactly_and_losses_to_the_tolerance():
    counts = {"personal-correct"}.__contains__
    honest = {"personal-correct": 40, "num-test": 50, "personal-loss": 0.5}
    assert disagreement(honest, dict(honest), counts) is None
    assert disagreement({**honest, "personal-loss": 0.5 * (1 + 1e-7)}, honest, counts) is None
    assert "personal-loss = 0.51 claimed, 0.5 recomputed" in disagreement(
        {**honest, "personal-loss": 0.51}, honest, counts)
    assert "personal-correct = 41 claimed, 40 recomputed" in disagreement(
        {**honest, "personal-correct": 41}, honest, counts)
    assert "global-correct is extra in the reply" in disagreement(
        {**honest, "global-correct": 3}, honest, counts)


# --- in a real (sequential-engine) simulation -------------------------------------------------

ATTACKER = {"malicious-clients": 1, "attack": "perfect-eval", "rounds": 4}


def _eval_rows(result: dict) -> list[dict]:
    return [r for r in result["rounds"] if "eval-clients" in r]


@needs_fashion_mnist
@pytest.mark.parametrize("method", ["ditto"])
def test_a_perfect_accuracy_claim_is_rejected_and_the_metrics_are_the_honest_clients(method):
    """Every audited round catches the claim, and the reported accuracies equal those of the
    honest clients' replies alone (from a run without the attacker's lie, whose model is the
    same: the lie is in evaluation only); honest clients with state (Ditto's personal model) or
    fine-tuning at evaluation are reproduced exactly (0 of them rejected)."""
    attacker = next(iter(malicious_clients(build_settings({**BASE, **ATTACKER}))))
    clean, clean_models = _run(method, rounds=4, **{"eval-audit-fraction": 1.0})
    faked, faked_models = _run(method, **ATTACKER, **{"eval-audit-fraction": 1.0})
    for a, b in zip(clean_models, faked_models, strict=True):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    assert [r["eval-audit-rejected"] for r in _eval_rows(clean)] == [0, 0]
    assert [r["eval-audited"] for r in _eval_rows(clean)] == [6, 6]
    assert [r["eval-audit-rejected"] for r in _eval_rows(faked)] == [1, 1]
    honest = [c for c in clean["clients"] if c["id"] != attacker]
    correct = sum(round(c["personal-acc"] * c["num-test"]) for c in honest)
    assert faked["final"]["personal-acc"] == correct / sum(c["num-test"] for c in honest)
    assert [c["id"] for c in faked["clients"]] == [c["id"] for c in honest]
    assert faked["final"]["evaluated"] == 5


@needs_fashion_mnist
def test_at_the_default_fraction_the_claim_is_caught_exactly_where_it_is_sampled():
    """eval-audit-fraction = 0.2 of 6 clients audits 2 a round (drawn by the run's secret key)
    and every client in the last round: the lie stands in the other rounds, and only there."""
    changes = {**ATTACKER, "rounds": 6, "eval-every": 1}
    attacker = next(iter(malicious_clients(build_settings({**BASE, **changes}))))
    faked, _ = _run("fedavg", **changes)
    caught = [r["eval-audit-rejected"] for r in _eval_rows(faked)]
    sampled = [int(attacker in audit_sample(range(6), 0.2, faked["audit-secret"], r,
                                            everyone=r == 6)) for r in range(1, 7)]
    assert caught == sampled and caught[-1] == 1 and 0 < sum(caught) < 6
    assert [r["eval-audited"] for r in _eval_rows(faked)] == [2, 2, 2, 2, 2, 6]
    assert all(r["evaluated"] == 6 - c for r, c in zip(_eval_rows(faked), caught, strict=True))


@needs_fashion_mnist
def test_the_draw_is_keyed_by_a_secret_no_client_knows_which_the_results_give_to_repeat_it():
    """Each run of one config draws its own key (a client knowing the config and seed cannot
    predict the audited rounds); the key in a run's results repeats it exactly."""
    changes = {**ATTACKER, "rounds": 3, "eval-every": 1}
    first, _ = _run("fedavg", **changes)
    again, _ = _run("fedavg", **changes, **{"audit-secret": first["audit-secret"]})
    method, runtime, _ = server("fedavg", build_settings({**BASE, **changes,
                                                          "methods": "fedavg"}), 6)
    assert Audit(runtime, method, None, print).secret not in (first["audit-secret"], 0)
    assert again["audit-secret"] == first["audit-secret"]
    assert [r["eval-audit-rejected"] for r in _eval_rows(again)] == [
        r["eval-audit-rejected"] for r in _eval_rows(first)]
    untimed = [{k: v for k, v in run["final"].items() if "seconds" not in k}
               for run in (first, again)]
    assert untimed[0] == untimed[1]


@needs_fashion_mnist
def test_without_an_audit_the_table_says_accuracies_are_self_reported():
    result, _ = _run("fedavg", **{"eval-audit-fraction": 0.0})
    assert result["final"]["eval-audited"] == 0
    table = comparison_table({"fedavg": result})
    assert "fedavg: accuracies are self-reported by the clients" in table
    audited, _ = _run("fedavg", **{"malicious-clients": 1, "attack": "perfect-eval"})
    table = comparison_table({"fedavg": audited})
    assert "fedavg: 1 of 6 clients' last evaluations disagreed" in table
    assert "self-reported" not in table


@needs_fashion_mnist
@pytest.mark.parametrize("method", ["fedavg", "ditto"])
def test_the_training_audit_catches_a_sign_flip_within_the_norm_bound(method):
    """A reversed update has an honest norm, so no bound sees it; recomputing the training reply
    does: with train-audit-fraction = 1 every flip is rejected and the global model is that of
    the run where the attacker never answers. Honest replies (Ditto's with its personal model in
    its state) are reproduced exactly."""
    changes = {"rounds": 2, "eval-every": 2, "malicious-clients": 1,
               "train-audit-fraction": 1.0}
    flipped, models = _run(method, **changes, attack="signflip")
    silent, reference = _run(method, **changes, attack="hang")
    assert [r["train-audit-rejected"] for r in flipped["rounds"]] == [1, 1]
    assert [r["train-audited"] for r in flipped["rounds"]] == [6, 6]
    assert [r["train-audited"] for r in silent["rounds"]] == [5, 5]
    assert [r["rejected"] for r in flipped["rounds"]] == [r["timeouts"] for r in silent["rounds"]]
    for a, b in zip(models, reference, strict=True):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    unaudited, _ = _run(method, **{**changes, "train-audit-fraction": 0.0}, attack="signflip")
    assert [r["rejected"] for r in unaudited["rounds"]] == [0, 0]  # within the bound
