"""eval-fraction: a seeded sample of clients in the evaluation rounds before the last, every
client in the last; what is trained never depends on it."""

from __future__ import annotations

from conftest import needs_fashion_mnist

from pflalign.engines.sequential import SequentialEngine
from pflalign.outputs.results import Reporter
from pflalign.run.config import build_settings
from pflalign.run.driver import run_methods, simulate
from pflalign.server.sampling import EVAL_SAMPLING_STREAM, sample_clients

BASE = {"engine": "sequential", "num-clients": 10, "max-samples": 2000, "rounds": 3,
        "eval-every": 1, "fraction-train": 0.3, "local-steps": 3, "seed": 4,
        "methods": "fedavg,ditto"}


class _Recording(SequentialEngine):
    """The sequential engine, recording the clients of every evaluation exchange."""

    evaluated: list[tuple[str, list[int]]] = []

    def exchange(self, action, messages):
        if action == "evaluate":
            _Recording.evaluated.append((str(messages[0].config["method"]),
                                         sorted(m.client for m in messages)))
        return super().exchange(action, messages)


def _without(row: dict, keys: set[str]) -> dict:
    return {k: v for k, v in row.items() if k not in keys and "seconds" not in k}


@needs_fashion_mnist
def test_a_sample_is_evaluated_before_the_last_round_and_training_is_unchanged(tmp_path):
    full = run_methods(build_settings({**BASE, "out-dir": str(tmp_path / "full")}),
                       SequentialEngine, Reporter(quiet=True))
    _Recording.evaluated = []
    part = run_methods(build_settings({**BASE, "eval-fraction": 0.3,
                                       "out-dir": str(tmp_path / "part")}),
                       _Recording, Reporter(quiet=True))
    expected = [sample_clients(range(10), 0.3, 4, r, EVAL_SAMPLING_STREAM) for r in (1, 2)]
    assert expected[0] != expected[1] and all(len(e) == 3 for e in expected)
    for method in ("fedavg", "ditto"):  # the same sample for every method; everyone last
        assert [c for m, c in _Recording.evaluated if m == method] == [*expected,
                                                                      list(range(10))]
        a, b = full["methods"][method], part["methods"][method]
        assert [r["eval-clients"] for r in b["rounds"]] == [3, 3, 10]
        # the training rows are the same bit for bit; the last round's evaluation too
        evaluation = {k for r in a["rounds"] + b["rounds"] for k in r
                      if k.startswith(("personal", "global", "eval", "evaluated", "unseen"))}
        # a sample's rows estimate the whole population's accuracy, with its interval
        sampled = b["rounds"][0]
        assert sampled["eval-population"] == 10
        assert sampled["personal-acc-ci-low"] <= sampled["personal-acc"] <= sampled[
            "personal-acc-ci-high"]
        assert "eval-population" not in b["rounds"][-1]
        for ra, rb in zip(a["rounds"], b["rounds"], strict=True):
            assert _without(ra, evaluation | {"bytes-up", "bytes-down"}) == _without(
                rb, evaluation | {"bytes-up", "bytes-down"})
            assert ra["bytes-up"] == rb["bytes-up"]
        assert _without(a["rounds"][-1], set()) == _without(b["rounds"][-1], set())
        final = {k for k in a["final"] if "seconds" in k or k.startswith("bytes")}
        assert _without(a["final"], final) == _without(b["final"], final)
        assert a["clients"] == b["clients"]


@needs_fashion_mnist
def test_eval_at_start_adds_round_zero_and_changes_nothing_after_it(tmp_path):
    """eval-at-start: a row for round 0 whose personal accuracy is the initial model's for every
    method that evaluates it as it is (FedAvg, Local, pFLAlign with a zero offset: one number),
    every later row as without it, and the same rows on the sequential and batched engines."""
    base = {**BASE, "rounds": 2, "methods": "fedavg,local,pflalign"}
    rows = {}
    for engine in ("sequential", "batched"):
        for start in (False, True):
            settings = build_settings({**base, "engine": engine, "eval-at-start": start,
                                       "out-dir": str(tmp_path / f"{engine}-{start}")})
            results = simulate(settings, Reporter(quiet=True))
            rows[engine, start] = {
                label: [{k: v for k, v in row.items() if "seconds" not in k}
                        for row in entry["rounds"]]
                for label, entry in results["methods"].items()}
    with_start, without = rows["sequential", True], rows["sequential", False]
    assert rows["batched", True] == with_start and rows["batched", False] == without
    assert {label: r[0]["round"] for label, r in with_start.items()} == dict.fromkeys(
        with_start, 0)
    assert len({r[0]["personal-acc"] for r in with_start.values()}) == 1
    assert "train-loss" not in with_start["fedavg"][0]
    assert {label: r[1:] for label, r in with_start.items()} == without
