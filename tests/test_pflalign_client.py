"""pFLAlign's client and server halves without Ray: state, offsets, messages."""

import math

import numpy as np
import pytest
import torch
from conftest import needs_fashion_mnist
from flwr.app import RecordDict

from clients.base import ClientState, RoundInput
from clients.pflalign import FIT_EVAL, OFFSET, OPTIMIZER, PFLAlignClient
from pflalign.config import Settings
from pflalign.methods import METHODS
from pflalign.results import Reporter
from strategies.base import ClientInfo, Update
from strategies.pflalign import PFLAlignStrategy

SMALL = {"num-clients": 2, "max-samples": 400, "local-steps": 3, "batch-size": 16,
         "methods": "pflalign", "seed": 1}


def _client(records: RecordDict, cid: int = 0, **changes) -> PFLAlignClient:
    settings = Settings({**SMALL, **changes})
    return PFLAlignClient(settings, cid, ClientState(records, "pflalign"), torch.device("cpu"))


def _global(client: PFLAlignClient, shift: float = 0.0) -> dict[str, torch.Tensor]:
    return {k: v + shift if v.is_floating_point() else v
            for k, v in client.new_model().state_dict().items()}


@needs_fashion_mnist
def test_client_state_persists_across_rounds_and_non_participation():
    records = RecordDict()
    client = _client(records)
    theta_g1 = _global(client)
    out1 = client.fit(RoundInput(1, {"arrays": theta_g1}))
    offset = client.state.get_arrays(OFFSET)
    for name, value in offset.items():  # Delta = theta_end - theta_g (1.7)
        torch.testing.assert_close(value, out1.state[name] - theta_g1[name])
    saved_p = client.state.get_arrays(OPTIMIZER)["fc.weight.P"].clone()
    assert float(saved_p.abs().sum()) > 0

    # round 2: this client is not sampled; nothing touches its state. Round 3: a new global model.
    client = _client(records)
    assert torch.equal(client.state.get_arrays(OPTIMIZER)["fc.weight.P"], saved_p)
    theta_g3 = _global(client, shift=0.01)
    out3 = client.fit(RoundInput(3, {"arrays": theta_g3}))
    # a fresh client (no state) given the same global model ends elsewhere
    fresh = _client(RecordDict()).fit(RoundInput(3, {"arrays": theta_g3}))
    assert not torch.equal(out3.state["fc.weight"], fresh.state["fc.weight"])


@needs_fashion_mnist
def test_round_starts_from_global_plus_offset_and_gamma_zero_keeps_it():
    records = RecordDict()
    client = _client(records, **{"pflalign-gamma": "zero", "pflalign-lr": 1e-9})
    theta_g = _global(client)
    client.fit(RoundInput(1, {"arrays": theta_g}))
    delta = {k: torch.full_like(v, 0.01) for k, v in client.state.get_arrays(OFFSET).items()}
    client.state.set_arrays(OFFSET, delta)
    new_global = _global(client, shift=0.001)
    out = _client(records, **{"pflalign-gamma": "zero", "pflalign-lr": 1e-9}).fit(
        RoundInput(2, {"arrays": new_global}))
    for name, value in delta.items():  # negligible step, gamma = 0: theta_end = theta_g + Delta
        torch.testing.assert_close(out.state[name], new_global[name] + value, atol=1e-6, rtol=0)


@needs_fashion_mnist
def test_gamma_one_with_tiny_lr_removes_the_offset():
    records = RecordDict()
    kwargs = {"pflalign-gamma": "one", "pflalign-lr": 1e-9}
    client = _client(records, **kwargs)
    theta_g = _global(client)
    client.state.set_arrays(OFFSET, {n: torch.full_like(p, 0.2)
                                     for n, p in client.new_model().named_parameters()})
    out = _client(records, **kwargs).fit(RoundInput(1, {"arrays": theta_g}))
    for name, _ in client.new_model().named_parameters():
        torch.testing.assert_close(out.state[name], theta_g[name], atol=1e-5, rtol=0)


@needs_fashion_mnist
def test_personalize_off_never_stores_an_offset():
    records = RecordDict()
    client = _client(records, **{"pflalign-personalize": False})
    client.fit(RoundInput(1, {"arrays": _global(client)}))
    assert client.state.get_arrays(OFFSET) is None


@needs_fashion_mnist
def test_evaluation_reports_post_local_next_and_global_models():
    records = RecordDict()
    client = _client(records)
    theta_g = _global(client)
    never = client.evaluate(RoundInput(1, {"arrays": theta_g}))
    assert never["personal-correct"] == never["global-correct"] == never["next-correct"]
    client.fit(RoundInput(1, {"arrays": theta_g}, {"evaluate-after-fit": True}))
    stored = client.state.get_metrics(FIT_EVAL)
    after = _client(records).evaluate(RoundInput(1, {"arrays": theta_g}))
    assert after["personal-correct"] == stored["correct"]
    assert after["num-test"] == stored["count"]
    # next = theta_g + Delta = theta_end (Delta was measured against this same theta_g)
    assert after["next-correct"] == stored["correct"]


# --- the server half --------------------------------------------------------------------------
def _strategy(mode: str, **changes) -> PFLAlignStrategy:
    settings = Settings({"methods": "pflalign", "num-clients": 4, "pflalign-state": mode,
                         **changes})
    rng = np.random.default_rng(0)
    initial = {"w": rng.normal(size=(3, 2)).astype(np.float32),
               "bn.running_mean": np.zeros(2, np.float32)}
    strategy = PFLAlignStrategy(settings, METHODS["pflalign"], initial, Reporter(quiet=True),
                                trainable=("w",))
    strategy.clients = {i: ClientInfo(i, 100 + i, 10 * (i + 1), 5, False) for i in range(4)}
    return strategy


def test_server_mode_keeps_offsets_and_sends_personalized_initialization():
    strategy = _strategy("server")
    theta_g = {k: v.copy() for k, v in strategy.global_state.items()}
    end = {0: {"w": theta_g["w"] + 1.0, "bn.running_mean": np.ones(2, np.float32)},
           2: {"w": theta_g["w"] - 2.0, "bn.running_mean": np.ones(2, np.float32)}}
    updates = [Update(c, 10.0 * (c + 1), {}, s) for c, s in end.items()]
    new = strategy.aggregate(1, updates)
    strategy.global_state = new
    strategy._global_record = None
    assert set(strategy.offsets) == {0, 2}
    np.testing.assert_allclose(strategy.offsets[0]["w"], np.ones((3, 2)), rtol=1e-6)
    assert "bn.running_mean" not in strategy.offsets[0]  # trainable entries only (A6)
    assert strategy.round_diagnostics(1)["delta-norm"] == pytest.approx(
        (math.sqrt(6) + 2 * math.sqrt(6)) / 2)
    records = strategy.train_records(0)
    np.testing.assert_allclose(records["arrays"]["w"].numpy(), new["w"] + 1.0, rtol=1e-6)
    np.testing.assert_allclose(records["arrays"]["bn.running_mean"].numpy(),
                               new["bn.running_mean"])  # buffers from the global model
    np.testing.assert_allclose(records["offset"]["w"].numpy(), np.ones((3, 2)), rtol=1e-6)
    assert set(strategy.train_records(1)) == {"arrays"}  # never trained: Delta = 0
    assert set(strategy.eval_records(2)) == {"arrays", "personal"}


def test_client_mode_sends_only_the_global_model():
    strategy = _strategy("client")
    update = Update(0, 10.0, {}, {k: v + 1 for k, v in strategy.global_state.items()})
    strategy.aggregate(1, [update])
    assert strategy.offsets == {}
    assert set(strategy.train_records(0)) == {"arrays"}
    assert set(strategy.eval_records(0)) == {"arrays"}


def test_evaluate_after_fit_flags_the_last_training_before_each_evaluation():
    strategy = _strategy("client", **{"rounds": 10, "eval-every": 4, "fraction-train": 0.5})
    evals = [4, 8, 10]
    for rnd in range(1, 11):
        for cid in strategy.sample(rnd):
            next_eval = min(e for e in evals if e >= rnd)
            expected = not any(cid in strategy.sample(r) for r in range(rnd + 1, next_eval + 1))
            assert strategy.train_config(cid, rnd)["evaluate-after-fit"] == expected


@needs_fashion_mnist
def test_local_batch_norm_keeps_the_clients_own_buffers():
    records = RecordDict()
    kwargs = {"model": "cnn-bn", "pflalign-bn": "local"}
    client = _client(records, **kwargs)
    theta_g = _global(client)
    out = client.fit(RoundInput(1, {"arrays": theta_g}))
    buffers = client.state.get_arrays("buffers")
    assert set(buffers) == {k for k in theta_g if "running" in k or "num_batches" in k}
    torch.testing.assert_close(buffers["features.1.running_mean"],
                               out.state["features.1.running_mean"])
    # next round: the model uses the client's buffers, not the global model's
    fresh_global = {k: (torch.zeros_like(v) if "running_mean" in k else v)
                    for k, v in theta_g.items()}
    model = _client(records, **kwargs)._model(fresh_global)
    torch.testing.assert_close(model.state_dict()["features.1.running_mean"],
                               buffers["features.1.running_mean"])
    # with global BN (the default, A6) the buffers come from the global model
    glob = _client(RecordDict(), model="cnn-bn")
    glob.fit(RoundInput(1, {"arrays": theta_g}))
    assert glob.state.get_arrays("buffers") is None
    assert torch.count_nonzero(glob._model(fresh_global).state_dict()[
        "features.1.running_mean"]) == 0
