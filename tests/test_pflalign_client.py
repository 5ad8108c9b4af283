"""pFLAlign's client and server rules without an engine: state, offsets, messages."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from conftest import needs_fashion_mnist
from harness import build, evaluate, global_state, persist, server, train

from pflalign.methods.pflalign import EVALUATE_AFTER_FIT, OFFSET, PERSONAL, PFLAlignClientState
from pflalign.run.config import build_settings
from pflalign.wire.messages import Update
from pflalign.wire.protocol import MODEL

SMALL = {"num-clients": 2, "max-samples": 400, "local-steps": 3, "batch-size": 16,
         "methods": "pflalign", "seed": 1}


def _build(cid: int = 0, **changes):
    return build("pflalign", SMALL, cid, **changes)


@needs_fashion_mnist
def test_client_state_persists_across_rounds_and_non_participation():
    method, client = _build()
    theta_g1 = global_state(client)
    out1, state = train(method, client, 1, {MODEL: theta_g1})
    offset = state.offset
    for name, value in offset.items():  # Delta = theta_end - theta_g (1.7)
        torch.testing.assert_close(value, out1.model[name] - theta_g1[name])
    saved_p = state.optimizer["fc.weight.P"].clone()
    assert float(saved_p.abs().sum()) > 0

    # round 2: this client is not sampled; nothing touches its state. Round 3: a new global model.
    method, client = _build()
    state = persist(state)
    assert torch.equal(state.optimizer["fc.weight.P"], saved_p)
    theta_g3 = global_state(client, shift=0.01)
    out3 = train(method, client, 3, {MODEL: theta_g3}, state)[0]
    # a fresh client (no state) given the same global model ends elsewhere
    fresh = train(*_build(), 3, {MODEL: theta_g3})[0]
    assert not torch.equal(out3.model["fc.weight"], fresh.model["fc.weight"])


@needs_fashion_mnist
def test_round_starts_from_global_plus_offset_and_gamma_zero_keeps_it():
    kwargs = {"pflalign-gamma": "zero", "pflalign-lr": 1e-9}
    method, client = _build(**kwargs)
    theta_g = global_state(client)
    _, state = train(method, client, 1, {MODEL: theta_g})
    delta = {k: torch.full_like(v, 0.01) for k, v in state.offset.items()}
    state = dataclasses.replace(state, offset=delta)
    new_global = global_state(client, shift=0.001)
    out = train(*_build(**kwargs), 2, {MODEL: new_global}, state)[0]
    for name, value in delta.items():  # negligible step, gamma = 0: theta_end = theta_g + Delta
        torch.testing.assert_close(out.model[name], new_global[name] + value, atol=1e-6, rtol=0)


@needs_fashion_mnist
def test_gamma_one_with_tiny_lr_removes_the_offset():
    kwargs = {"pflalign-gamma": "one", "pflalign-lr": 1e-9}
    method, client = _build(**kwargs)
    theta_g = global_state(client)
    state = PFLAlignClientState(offset={n: torch.full_like(p, 0.2)
                                        for n, p in client.new_model().named_parameters()})
    out = train(*_build(**kwargs), 1, {MODEL: theta_g}, state)[0]
    for name, _ in client.new_model().named_parameters():
        torch.testing.assert_close(out.model[name], theta_g[name], atol=1e-5, rtol=0)


@needs_fashion_mnist
def test_personalize_off_never_stores_an_offset():
    method, client = _build(**{"pflalign-personalize": False})
    _, state = train(method, client, 1, {MODEL: global_state(client)})
    assert state.offset is None


@needs_fashion_mnist
def test_evaluation_reports_post_local_next_and_global_models():
    method, client = _build()
    theta_g = global_state(client)
    never = evaluate(method, client, 1, {MODEL: theta_g})
    assert never["personal-correct"] == never["global-correct"] == never["next-correct"]
    _, state = train(method, client, 1, {MODEL: theta_g}, config={EVALUATE_AFTER_FIT: True})
    assert state.fit_correct is not None and state.fit_count is not None
    method, client = _build()
    after = evaluate(method, client, 1, {MODEL: theta_g}, state)
    assert after["personal-correct"] == state.fit_correct
    assert after["num-test"] == state.fit_count
    # next = theta_g + Delta = theta_end (Delta was measured against this same theta_g)
    assert after["next-correct"] == state.fit_correct


# --- the server rules -------------------------------------------------------------------------
def _server(mode: str, **changes):
    settings = build_settings({"methods": "pflalign", "num-clients": 4, "pflalign-state": mode,
                         **changes})
    rng = np.random.default_rng(0)
    initial = {"w": rng.normal(size=(3, 2)).astype(np.float32),
               "bn.running_mean": np.zeros(2, np.float32)}
    method, runtime, model = server("pflalign", settings, 4, initial, trainable=("w",),
                                    num_train=lambda c: 10 * (c + 1))
    return method, runtime, method.init_server(runtime, model)


def test_server_mode_keeps_offsets_and_sends_personalized_initialization():
    method, runtime, state = _server("server")
    theta_g = {k: v.copy() for k, v in state.model.items()}
    end = {0: {"w": theta_g["w"] + 1.0, "bn.running_mean": np.ones(2, np.float32)},
           2: {"w": theta_g["w"] - 2.0, "bn.running_mean": np.ones(2, np.float32)}}
    updates = [Update(c, 10.0 * (c + 1), {}, s) for c, s in end.items()]
    state, diagnostics = method.aggregate(runtime, state, 1, updates)
    new = state.model
    assert set(state.offsets) == {0, 2}
    np.testing.assert_allclose(state.offsets[0]["w"], np.ones((3, 2)), rtol=1e-6)
    assert "bn.running_mean" not in state.offsets[0]  # trainable entries only (A6)
    assert diagnostics["delta-norm"] == pytest.approx((math.sqrt(6) + 2 * math.sqrt(6)) / 2)
    records = method.train_payload(runtime, state, 0, 2).arrays
    np.testing.assert_allclose(records[MODEL]["w"], new["w"] + 1.0, rtol=1e-6)
    np.testing.assert_allclose(records[MODEL]["bn.running_mean"],
                               new["bn.running_mean"])  # buffers from the global model
    np.testing.assert_allclose(records[OFFSET]["w"], np.ones((3, 2)), rtol=1e-6)
    assert set(method.train_payload(runtime, state, 1, 2).arrays) == {MODEL}  # never trained
    assert set(method.eval_payload(runtime, state, 2, 2).arrays) == {MODEL, PERSONAL}


def test_client_mode_sends_only_the_global_model():
    method, runtime, state = _server("client")
    update = Update(0, 10.0, {}, {k: v + 1 for k, v in state.model.items()})
    state, _ = method.aggregate(runtime, state, 1, [update])
    assert state.offsets == {}
    assert set(method.train_payload(runtime, state, 0, 2).arrays) == {MODEL}
    assert set(method.eval_payload(runtime, state, 0, 2).arrays) == {MODEL}


def test_evaluate_after_fit_flags_the_last_training_before_each_evaluation():
    method, runtime, state = _server("client", **{"rounds": 10, "eval-every": 4,
                                                  "fraction-train": 0.5})
    evals = [4, 8, 10]
    for rnd in range(1, 11):
        for cid in runtime.sample(rnd):
            next_eval = min(e for e in evals if e >= rnd)
            expected = not any(cid in runtime.sample(r) for r in range(rnd + 1, next_eval + 1))
            payload = method.train_payload(runtime, state, cid, rnd)
            assert payload.config[EVALUATE_AFTER_FIT] == expected
            assert method.last_training_before_evaluation(runtime, cid, rnd) == expected


@needs_fashion_mnist
def test_local_batch_norm_keeps_the_clients_own_buffers():
    kwargs = {"model": "cnn-bn", "pflalign-bn": "local"}
    method, client = _build(**kwargs)
    theta_g = global_state(client)
    out, state = train(method, client, 1, {MODEL: theta_g})
    buffers = state.buffers
    assert set(buffers) == {k for k in theta_g if "running" in k or "num_batches" in k}
    torch.testing.assert_close(buffers["features.1.running_mean"],
                               out.model["features.1.running_mean"])
    # next round: the model starts from the client's buffers, not the global model's
    fresh_global = {k: (torch.zeros_like(v) if "running_mean" in k else v)
                    for k, v in theta_g.items()}

    def round_two_start(method, client, state) -> dict:
        starts, execute = [], client.execute
        client.execute = lambda run, r: starts.append(dict(run.start)) or execute(run, r)
        train(method, client, 2, {MODEL: fresh_global}, state)
        return starts[0]

    method, client = _build(**kwargs)
    torch.testing.assert_close(round_two_start(method, client, state)[
        "features.1.running_mean"], buffers["features.1.running_mean"])
    # with global BN (the default, A6) the buffers come from the global model
    glob, glob_client = _build(model="cnn-bn")
    _, glob_state = train(glob, glob_client, 1, {MODEL: theta_g})
    assert glob_state.buffers is None
    assert torch.count_nonzero(round_two_start(glob, glob_client, glob_state)[
        "features.1.running_mean"]) == 0
