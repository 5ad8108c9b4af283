"""The strict reply schema: every metric a method's replies carry is declared with its range
(:data:`pflalign.wire.protocol.TRAIN_METRICS`, ``EVAL_METRICS``, each method's ``train_metrics`` and
``eval_metrics``); a reply without a required metric, with one it does not declare, with a value
outside its range or with an array record the action does not have is rejected, naming the
client, in a warning of bounded length. The honest replies of every method through the real
ClientApp are checked in ``test_baselines_simulation.py``."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from conftest import needs_fashion_mnist
from harness import method_settings, server, train_metrics

from pflalign.server.validation import ClientFailure, ReplyValidator
from pflalign.wire.messages import Reply
from pflalign.wire.protocol import EVALUATE, LOSS_BOUND_FACTOR, MODEL, TRAIN

INITIAL = {"fc.weight": np.zeros((2, 3), np.float32), "fc.bias": np.zeros(2, np.float32)}


def _validator(name: str, classes: int = 10, **changes) -> tuple[object, ReplyValidator]:
    settings = method_settings(name, {"num-clients": 3, "methods": name, **changes})
    method, runtime, _ = server(name, settings, 3, INITIAL, tuple(INITIAL))
    runtime.num_classes = classes
    return method, ReplyValidator(runtime, lambda text: None)


def _train(method, validator, metrics, arrays=None):
    reply = Reply(0, "client 0", metrics=metrics,
                  arrays={MODEL: dict(INITIAL)} if arrays is None else arrays)
    return validator.validate(reply, {MODEL: validator.server.flat}, method.reply_metrics(TRAIN))


def _eval(method, validator, **metrics):
    reply = Reply(0, "client 0", metrics={"partition-id": 0, "num-test": 5,
                                          "personal-correct": 3, "personal-loss": 0.7, **metrics})
    return validator.validate(reply, {}, method.reply_metrics(EVALUATE))


def test_an_honest_reply_passes_and_each_missing_metric_is_named():
    method, validator = _validator("fedavg")
    metrics, arrays = _train(method, validator, train_metrics(0))
    assert metrics["train-loss"] == 0.5 and set(arrays) == {MODEL}
    for key in train_metrics(0):
        if key == "partition-id":
            continue
        honest = train_metrics(0)
        del honest[key]
        with pytest.raises(ClientFailure, match=f"client 0 replied without the metric '{key}'$"):
            _train(method, validator, honest)
    assert _eval(method, validator, **{"global-correct": 2, "global-loss": 0.9})
    with pytest.raises(ClientFailure, match="without the metric 'global-correct'"):
        _eval(method, validator, **{"global-loss": 0.9})


def test_metrics_and_records_a_method_does_not_have_are_rejected_in_a_short_line():
    method, validator = _validator("fedavg")
    many = {f"extra-{i}": 1.0 for i in range(1000)}
    with pytest.raises(ClientFailure) as caught:
        _train(method, validator, {**train_metrics(0), **many})
    text = str(caught.value)
    assert text.startswith("client 0 replied with 1000 metrics this action does not have: "
                           "'extra-0', 'extra-1'") and text.endswith("and 995 more")
    assert len(text) < 300
    with pytest.raises(ClientFailure, match="this action does not have: 'mean-P'"):
        _train(method, validator, train_metrics(0, **{"mean-P": 0.5}))  # pFLAlign's, not FedAvg's
    local, local_validator = _validator("local")
    with pytest.raises(ClientFailure, match="does not have: 'global-correct'"):
        _eval(local, local_validator, **{"global-correct": 2, "global-loss": 0.9})
    extra = {MODEL: dict(INITIAL), "blob": {"x": np.zeros(10, np.float32)}}
    with pytest.raises(ClientFailure, match="replied with 1 array record this action does not "
                                            "have: 'blob'"):
        _train(method, validator, train_metrics(0), extra)


@pytest.mark.parametrize("key,value,expected", [
    ("train-loss", 1e300, "expected 0 .. 230.259"),
    ("train-loss", -0.1, "expected 0 .. 230.259"),
    ("local-steps", 2.5, "expected an integer"),
    ("had-state", 2, "expected 0 .. 1"),
    ("client-seconds", 1e300, "expected 0 .. 1e+07"),
    ("num-examples", 0, "expected 1 .. inf"),
])
def test_values_outside_their_range_are_rejected(key, value, expected):
    method, validator = _validator("fedavg")
    pattern = f"client 0 reported {key} = .*, {re.escape(expected)}$"
    with pytest.raises(ClientFailure, match=pattern):
        _train(method, validator, {**train_metrics(0), key: value})


def test_the_loss_bound_is_a_multiple_of_log_classes():
    method, validator = _validator("fedavg", classes=80)
    bound = LOSS_BOUND_FACTOR * math.log(80)
    assert validator.loss_bound == pytest.approx(bound)
    _train(method, validator, train_metrics(0, loss=0.99 * bound))
    with pytest.raises(ClientFailure, match="train-loss"):
        _train(method, validator, train_metrics(0, loss=1.01 * bound))
    with pytest.raises(ClientFailure, match="personal-loss"):
        _eval(method, validator, **{"global-correct": 2, "global-loss": 0.9,
                                    "personal-loss": 1.01 * bound})


def test_pflalign_diagnostics_lie_in_their_ranges_and_are_required():
    method, validator = _validator("pflalign")
    honest = train_metrics(0, **{"mean-P": 0.4, "mean-gamma": 0.6})
    _train(method, validator, honest)
    for key, value in (("mean-P", 1e300), ("mean-P", -1e-3), ("mean-gamma", 1.5)):
        with pytest.raises(ClientFailure, match=f"reported {key} = "):
            _train(method, validator, {**honest, key: value})
    with pytest.raises(ClientFailure, match="without the metric 'mean-gamma'"):
        _train(method, validator, {k: v for k, v in honest.items() if k != "mean-gamma"})
    # GENIE's local update reports neither
    genie, genie_validator = _validator("pflalign-genie")
    _train(genie, genie_validator, train_metrics(0))
    with pytest.raises(ClientFailure, match="does not have: 'mean-P'"):
        _train(genie, genie_validator, honest)
    with pytest.raises(ClientFailure, match="without the metric 'next-correct'"):
        _eval(method, validator, **{"global-correct": 2, "global-loss": 0.9})
    with pytest.raises(ClientFailure, match="next-correct = 6, expected 0 .. 5"):
        _eval(method, validator, **{"global-correct": 2, "global-loss": 0.9, "next-correct": 6})


def test_a_huge_value_is_never_echoed_whole():
    method, validator = _validator("fedavg")
    with pytest.raises(ClientFailure) as caught:
        _train(method, validator, {**train_metrics(0), "train-loss": [0.5] * 1_000_000})
    assert str(caught.value) == ("client 0 reported a non-finite or non-scalar 'train-loss': a "
                                 "list of 1000000 items")
    with pytest.raises(ClientFailure) as caught:
        _train(method, validator, {**train_metrics(0), "x" * 20_000_000: 1.0})
    assert len(str(caught.value)) < 300


def test_a_saved_client_state_is_checked_before_a_checkpoint_stores_it():
    from pflalign.methods.pflalign import PFLAlignClientState
    from pflalign.server.validation import state_problem

    honest = {"offset/fc.weight": np.ones((2, 3), np.float32),
              "offset/fc.bias": np.ones(2, np.float32),
              "optimizer/fc.weight.v": np.ones((2, 3), np.float32),
              "optimizer/fc.weight.P": np.ones((2, 3), np.float32)}
    assert PFLAlignClientState.from_arrays(honest).offset is not None
    assert state_problem(PFLAlignClientState, honest, INITIAL) is None
    cases = {
        "evil/../../key": ({**honest, "offset/../../key": np.ones(2, np.float32)},
                           "is not a state name"),
        "nan": ({**honest, "offset/fc.bias": np.array([1.0, np.nan], np.float32)},
                "'offset/fc.bias' contains NaN or infinite values"),
        "shape": ({**honest, "optimizer/fc.weight.P": np.ones((3, 2), np.float32)},
                  "has shape (3, 2) and dtype float32; the model's 'fc.weight' has (2, 3)"),
        "dtype": ({**honest, "offset/fc.bias": np.ones(2, np.float64)}, "dtype float64"),
        "size": ({**honest, "optimizer/extra": np.zeros(1 << 19, np.float32)},
                 "it holds more than 1,048,832 bytes"),
        "field": ({**honest, "personal/fc.bias": np.ones(2, np.float32)},
                  "it is not a PFLAlignClientState: PFLAlignClientState has no field 'personal'"),
        "strings": ({**honest, "offset/fc.bias": np.array(["a", "b"])}, "has dtype <U1"),
    }
    for case, (arrays, expected) in cases.items():
        problem = state_problem(PFLAlignClientState, arrays, INITIAL)
        assert problem is not None and expected in problem, (case, problem)


@needs_fashion_mnist
def test_a_tampered_saved_state_is_refused_and_no_checkpoint_takes_it(tmp_path):
    import torch

    import pflalign.engines.sequential as sequential
    from pflalign.outputs.results import Reporter
    from pflalign.run.config import build_settings
    from pflalign.run.driver import run_methods
    from pflalign.wire.protocol import CLIENT_STATE, STATE

    warnings: list[str] = []

    class Warnings(Reporter):
        def warn(self, text: str) -> None:
            warnings.append(text)

    real = sequential.handle

    def handle(action, settings, cid, config, *rest, **kwargs):
        metrics, arrays, state = real(action, settings, cid, config, *rest, **kwargs)
        if action == STATE and cid == 1:
            arrays = {CLIENT_STATE: {**arrays[CLIENT_STATE],
                                     "personal/../../key": torch.zeros(3)}}
        return metrics, arrays, state

    settings = build_settings({"methods": "ditto", "rounds": 2, "num-clients": 3,
                               "max-samples": 600, "local-steps": 2, "fraction-train": 1.0,
                               "engine": "sequential", "checkpoint-every": 1,
                               "out-dir": str(tmp_path)})
    sequential.handle = handle
    try:
        results = run_methods(settings, sequential.SequentialEngine, Warnings(quiet=True))
    finally:
        sequential.handle = real
    assert [r["round"] for r in results["methods"]["ditto"]["rounds"]] == [1, 2]
    refused = [w for w in warnings if "no checkpoint after round" in w]
    assert refused and all("client 1's saved state was rejected: the array name "
                           "'personal/../../key' is not a state name" in w for w in refused)
