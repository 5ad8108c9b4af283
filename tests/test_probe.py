"""The probe's cases, as an outside client would run them: a tampering client (tests/tampering.py)
serves the project's own handlers and changes their replies, through the real ClientApp path
under Flower and through the sequential engine. Every case is contained: the metrics (and, in the
sequential engine, the global model after every round) equal, bit for bit, those of the run in
which those clients' tampered replies are dropped instead, and each is counted as rejected."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
from conftest import ROOT, needs_fashion_mnist
from tampering import CASES, DROPPED, tampering_handle

from pflalign.engines import sequential as sequential_engine
from pflalign.methods.registry import METHODS
from pflalign.outputs.results import Reporter
from pflalign.round.feature import RoundFeature
from pflalign.round.loop import RoundLoop
from pflalign.run.config import build_settings
from pflalign.run.driver import initial_model, template_model
from pflalign.server.runtime import ServerRuntime

pytestmark = needs_fashion_mnist

#: pFLAlign (client state, next-correct), every client trains every round, every reply audited
#: (the training audit is what catches the sign-flip); 3 honest clients beside one per case
PROBE = {"methods": "pflalign", "num-clients": 3 + len(CASES), "max-samples": 3000,
         "fraction-train": 1.0, "rounds": 2, "eval-every": 1, "local-steps": 3, "seed": 1,
         "eval-audit-fraction": 1.0, "train-audit-fraction": 1.0, "round-timeout": 60.0}
TAMPERED = {3 + i: case for i, case in enumerate(CASES)}
PROBE_CLIENTS = range(PROBE["num-clients"])
REFERENCE = {cid: DROPPED[case] for cid, case in TAMPERED.items()}
#: the replies rejected each round: every training case's and the bad state's training reply;
#: the perfect evaluation's and the bad state's evaluation reply
TRAIN_CASES = sum(1 for action in CASES.values() if action in ("train", "state"))
EVAL_CASES = sum(1 for action in CASES.values() if action in ("evaluate", "state"))
#: the entries that count what was refused, the bytes of what was sent up, and how close the
#: kept updates came to the norm bound (whose reference, the round's median, the scaled upload
#: shifts) differ between a tampered run and its reference by design; wall-clock seconds differ
#: between any two runs
COUNTS = {"failures", "timeouts", "rejected", "eval-failures", "eval-rejected", "eval-audited",
          "eval-audit-rejected", "train-audited", "train-audit-rejected", "bytes-up",
          "norm-ratio-max"}


def _metrics(entry: dict) -> dict:
    def strip(row: dict) -> dict:
        return {k: v for k, v in row.items() if k not in COUNTS and not k.endswith("seconds")
                and k != "seconds-per-round"}
    return {"rounds": [strip(r) for r in entry["rounds"]], "final": strip(entry["final"]),
            "clients": entry["clients"]}


def _sequential(cases: dict[int, str], monkeypatch) -> tuple[dict, list[dict]]:
    monkeypatch.setattr(sequential_engine, "handle",
                        tampering_handle(cases, sequential_engine.handle))
    settings = build_settings({**PROBE, "engine": "sequential"})
    model, trainable = initial_model(settings)
    server = ServerRuntime(settings, "pflalign", model, trainable, template_model(settings),
                           10)
    models = []

    class Record(RoundFeature):
        name = "record-models"

        def before_training(self, federation, server_round):
            models.append({k: v.copy() for k, v in federation.state.model.items()})
            return {}, 0, 0

    loop = RoundLoop(server, METHODS["pflalign"].build(settings),
                     sequential_engine.SequentialEngine(settings), Reporter(quiet=True),
                     features=[Record()])
    result = loop.run(model)
    monkeypatch.undo()
    return result, [*models[1:], loop.state.model]


def _counted(result: dict) -> None:
    for row in result["rounds"]:
        assert row["rejected"] == TRAIN_CASES and row["failures"] == 0, row
        assert row["clients-trained"] == len(PROBE_CLIENTS) - TRAIN_CASES, row
        assert row["eval-rejected"] == EVAL_CASES, row
        assert row["evaluated"] == len(PROBE_CLIENTS) - EVAL_CASES, row


def test_every_case_is_contained_in_the_sequential_engine(monkeypatch):
    tampered, models = _sequential(TAMPERED, monkeypatch)
    reference, reference_models = _sequential(REFERENCE, monkeypatch)
    _counted(tampered)
    assert _metrics(tampered) == _metrics(reference)
    for a, b in zip(models, reference_models, strict=True):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


DRIVER = ("import json, sys\n"
          f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
          "from pflalign.run.config import build_settings\n"
          "from pflalign.outputs.results import Reporter\n"
          "from strategies.simulation import simulate\n"
          "from tampering import tampering_app\n"
          "cases = {int(k): v for k, v in json.loads(sys.argv[2]).items()}\n"
          "simulate(build_settings(json.loads(sys.argv[1])), Reporter(quiet=True),\n"
          "         client_app=tampering_app(cases))\n")


def _flower(cases: dict[int, str], out) -> dict:
    settings = {**PROBE, "engine": "flower", "out-dir": str(out)}
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(settings), json.dumps(cases)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "results.json").read_text())["methods"]["pflalign"]


def test_every_case_is_contained_through_the_flower_client_app(tmp_path, monkeypatch):
    """The reference is the sequential engine's run with those replies dropped: the engines
    give identical metrics (tests/test_baselines_simulation.py), and the sequential engine's
    tampered run equals it too (above)."""
    tampered = _flower(TAMPERED, tmp_path / "tampered")
    _counted(tampered)
    assert _metrics(tampered) == _metrics(_sequential(REFERENCE, monkeypatch)[0])
    # and it is, counts and all, the sequential engine's tampered run
    sequential, _ = _sequential(TAMPERED, monkeypatch)
    assert [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in tampered["rounds"]
            ] == [{k: v for k, v in r.items() if not k.endswith("seconds")}
                  for r in sequential["rounds"]]
