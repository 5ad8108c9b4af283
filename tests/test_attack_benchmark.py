"""benchmarks/attacks.py's report: the figures it reads from each study (honest clients only),
the paired changes, and the verdict, on planted study results (the studies themselves take
hours; their runs are the project's own, tested elsewhere)."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import attacks as bench  # noqa: E402

from pflalign.engines.faults import malicious_clients  # noqa: E402
from pflalign.run.config import build_settings, resolve  # noqa: E402

SEEDS = (0, 1, 2)


def _study(accuracy, asr=None) -> dict:
    """A study of three seeds; ``accuracy(label, seed, client)`` gives each client's."""
    runs = []
    for seed in SEEDS:
        methods = {}
        for label in ("fedavg", 'fedavg(aggregation="median")'):
            clients = [{"id": c, "num-test": 10, "personal-acc": accuracy(label, seed, c),
                        **({"personal-backdoor-asr": asr} if asr is not None else {})}
                       for c in range(20)]
            methods[label] = {"clients": clients,
                              "rounds": [{"defence-seconds": 0.5}, {"defence-seconds": 0.7}]
                              if "median" in label else [{}]}
        runs.append({"seed": seed, "scenario": "", "methods": methods})
    return {"kind": "study", "runs": runs}


def _report(tmp_path, monkeypatch, studies: dict) -> str:
    """The report of FedAvg under mean and median, for the attacks ``studies`` holds (each
    study by its folder's name), at 20% attackers on dir-0.1."""
    attacks = ",".join(name.rsplit("-", 1)[0] for name in studies if name != "clean")
    monkeypatch.setattr(bench, "cached_study", lambda path, args, tag: studies[path.name])
    monkeypatch.setattr(sys, "argv", [
        "attacks.py", "--out", str(tmp_path), "--scenarios", "dir-0.1", "--methods", "fedavg",
        "--defences", "mean,median", "--attacks", attacks, "--attackers", "0.2"])
    bench.main()
    return (tmp_path / "attacks.md").read_text()


def test_the_report_reads_honest_clients_pairs_by_seed_and_gives_the_verdict(
        tmp_path, monkeypatch, capsys):
    base = dict(resolve(ROOT / "configs" / "scenarios" / "dir-0.1.toml").to_dict())
    attackers = {s: malicious_clients(build_settings({**base, "attackers": 0.2,
                                                      "attack": "ipm", "seed": s}))
                 for s in SEEDS}

    def clean(label, seed, client):  # the median's cost: -0.1, 0, +0.1 points by seed
        return 0.8 if label == "fedavg" else 0.8 + 0.001 * (seed - 1)

    def attacked(label, seed, client):
        if client in attackers[seed]:
            return 0.0  # an attacker's own clients never count
        return 0.5 if label == "fedavg" else 0.79 + 0.001 * (seed - 1)

    report = _report(tmp_path, monkeypatch, {"clean": _study(clean), "ipm-0.2": _study(attacked),
                                             "backdoor-0.2": _study(clean, asr=0.25)})
    # FedAvg's mean loses 30 points to IPM on the honest clients (the attackers' own clients,
    # at 0, are left out), the median 1; the backdoor's success rate is read as it is
    assert ("| fedavg | mean | -30.00 [-30.00, -30.00] | ASR 25.00 [25.00, 25.00] |"
            in report)
    assert "| fedavg | median | -1.00 [-1.00, -1.00] | ASR 25.00" in report
    # the median's honest cost holds 0 (t-interval of -0.1, 0, 0.1 points); 0.6 s a round
    assert "| fedavg | median | 80.00 [79.75, 80.25] | " in report
    assert "0.00 [-0.25, 0.25] |" in report  # (printed -0.00: a float's rounding)
    assert "0.60 [0.60, 0.60] |" in report
    assert ("- `median`: honest cost within the seeds' noise everywhere; every attack within 5 "
            "points" in report)
    assert "Recommended default: `median`" in report
    assert "Recommended default: `median`" in capsys.readouterr().out


def test_entries_and_paired_changes():
    assert bench.entry("fedrep", "krum") == "fedrep(aggregation=krum)"
    assert bench.entry("fedrep", "krum", label=True) == 'fedrep(aggregation="krum")'
    assert bench.entry("ditto", "update-clip") == "ditto(update-clip=1)"
    # the labels are those a real study's results carry (a float override as 1.0)
    assert bench.entry("ditto", "update-clip", label=True) == "ditto(update-clip=1.0)"
    assert bench.entry("ditto", "mean") == "ditto"
    clean = {s: {"acc": 0.8} for s in SEEDS}
    attacked = {s: {"acc": 0.7 + 0.01 * s} for s in SEEDS}
    assert bench.paired(attacked, clean, "acc") == pytest.approx([-0.1, -0.09, -0.08])


def test_a_defence_an_attack_breaks_is_named_and_none_is_recommended(tmp_path, monkeypatch):
    def clean(label, seed, client):
        return 0.8

    def attacked(label, seed, client):
        return 0.5 if label == "fedavg" else 0.71

    report = _report(tmp_path, monkeypatch, {"clean": _study(clean),
                                             "ipm-0.2": _study(attacked)})
    assert "- `median`: honest cost within the seeds' noise everywhere; broken by ipm (fedavg, " \
           "dir-0.1: -9.0)" in report
    assert "Recommended default: none meets both conditions." in report
