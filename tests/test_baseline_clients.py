"""The baselines' client and server rules without an engine: invariants, state, what is sent."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import needs_fashion_mnist
from harness import build, evaluate, global_state, persist, server, train, train_metrics

from pflalign.methods.apfl import APFLClientState
from pflalign.methods.ditto import DittoClientState
from pflalign.methods.registry import METHODS, method_overrides
from pflalign.methods.scaffold import CONTROL, CONTROL_DELTA, ScaffoldClientState
from pflalign.models.registry import batch_norm_keys, head_keys
from pflalign.outputs.results import Reporter
from pflalign.round.loop import RoundLoop
from pflalign.run.config import ConfigError, build_settings
from pflalign.training.loops import STREAM_PERSONAL
from pflalign.training.runs import LocalRun, complete
from pflalign.wire.messages import Exchange, Received, Reply, Update
from pflalign.wire.protocol import MODEL

pytestmark = needs_fashion_mnist

SMALL = {"num-clients": 2, "max-samples": 400, "local-steps": 4, "batch-size": 16, "seed": 1}


def _build(name, cid=0, **changes):
    return build(name, SMALL, cid, **changes)


def _distance(a, b, keys):
    return float(sum(((a[k] - b[k]) ** 2).sum() for k in keys)) ** 0.5


def _params(client):
    return [n for n, _ in client.new_model().named_parameters()]


def _fedavg(theta, server_round=1):
    method, client = _build("fedavg")
    return train(method, client, server_round, {MODEL: theta})[0].model


def test_fedprox_with_mu_zero_is_fedavg_exactly_and_mu_pulls_towards_the_global_model():
    _, client = _build("fedavg")
    theta = global_state(client)
    plain = _fedavg(theta)
    zero = train(*_build("fedprox", **{"fedprox-mu": 0.0}), 1, {MODEL: theta})[0]
    for key, value in plain.items():
        assert torch.equal(zero.model[key], value)
    pulled = train(*_build("fedprox", **{"fedprox-mu": 10.0}), 1, {MODEL: theta})[0]
    keys = _params(client)
    assert _distance(pulled.model, theta, keys) < 0.8 * _distance(plain, theta, keys)


def test_scaffold_first_round_is_fedavg_and_stores_the_option_two_control_variate():
    method, client = _build("scaffold")
    theta = global_state(client)
    out, state = train(method, client, 1, {MODEL: theta})
    plain = _fedavg(theta)
    for key, value in plain.items():  # c = c_i = 0: the corrected gradient is the gradient
        assert torch.equal(out.model[key], value)
    steps, lr = out.metrics["local-steps"], client.training.lr
    stored = state.control
    for name in _params(client):  # c_i+ = 0 - 0 + (x - y) / (K lr), and dc = c_i+ - 0
        expected = (theta[name] - out.model[name]) / (steps * lr)
        torch.testing.assert_close(stored[name], expected)
        torch.testing.assert_close(out.arrays[CONTROL_DELTA][name], expected)


def test_scaffold_round_two_uses_the_control_variates():
    method, client = _build("scaffold")
    theta = global_state(client)
    _, state = train(method, client, 1, {MODEL: theta})
    c_i = state.control
    c = {k: torch.zeros_like(v) for k, v in c_i.items()}
    with_c = train(method, client, 2, {MODEL: theta, CONTROL: c}, state)[0]
    without = train(method, client, 2, {MODEL: theta, CONTROL: c})[0]
    assert not torch.equal(with_c.model["fc.weight"], without.model["fc.weight"])


def test_scaffold_step_and_control_update_with_nonzero_variates_by_hand():
    method, client = _build("scaffold", **{"local-steps": 1})
    theta = global_state(client)
    names = _params(client)
    c_i = {n: torch.full_like(theta[n], 0.02) for n in names}
    c = {n: torch.full_like(theta[n], -0.01) for n in names}
    out, state = train(method, client, 2, {MODEL: theta, CONTROL: c},
                       ScaffoldClientState(control=c_i))
    (x, y), = list(client.batches(2))
    model = client.new_model(theta)
    grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
    lr = 0.05
    for name, g in zip(names, grads, strict=True):
        # y = x - lr (g - c_i + c); c_i+ = c_i - c + (x - y) / lr = g; dc = c_i+ - c_i
        step = theta[name] - lr * (g - c_i[name] + c[name])
        torch.testing.assert_close(out.model[name], step, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state.control[name], g, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(out.arrays[CONTROL_DELTA][name], g - c_i[name], rtol=1e-3,
                                   atol=1e-4)


def test_scaffold_and_apfl_refuse_momentum_before_any_data_is_read():
    for entry in ("scaffold(momentum=0.9)", "scaffold(weight-decay=0.01)"):
        with pytest.raises(ConfigError, match="plain SGD"):
            build_settings({"methods": f"fedavg,{entry}"})
    with pytest.raises(ConfigError, match="apfl updates its personal model by plain SGD"):
        build_settings({"methods": "apfl", "momentum": 0.5})
    build_settings({"methods": "fedavg(momentum=0.9),scaffold,apfl(weight-decay=0.01)"})


def test_ditto_uploads_the_fedavg_model_and_a_large_lambda_pulls_the_personal_model_on():
    _, reference = _build("fedavg")
    theta = global_state(reference)
    plain = _fedavg(theta)
    distances = {}
    for lam in (0.0, 19.0):  # lr * lambda = 0.95: a strong contraction towards w_global
        method, client = _build("ditto", **{"ditto-lambda": lam})
        assert method.params.lambda_ == lam
        out, state = train(method, client, 1, {MODEL: theta})
        for key, value in plain.items():
            assert torch.equal(out.model[key], value)
        distances[lam] = _distance(state.personal, theta, _params(reference))
    assert distances[0.0] > 0 and distances[19.0] < 0.5 * distances[0.0]


def test_ditto_with_lambda_zero_trains_the_personal_model_as_plain_sgd():
    method, client = _build("ditto", **{"ditto-lambda": 0.0})
    theta = global_state(client)
    _, state = train(method, client, 1, {MODEL: theta})
    reference = client.new_model(theta)
    client.train_split(reference, 1, stream=STREAM_PERSONAL, epochs=1)
    for key, value in reference.state_dict().items():
        assert torch.equal(state.personal[key], value)


def test_ditto_new_client_fits_a_personal_model_at_evaluation():
    method, client = _build("ditto")
    theta = global_state(client)
    state = DittoClientState()
    metrics = evaluate(method, client, 1, {MODEL: theta}, state)
    untrained = client.test(client.new_model(theta))
    # one proximal epoch on its own data from the (untrained) global model lowers its test loss
    assert metrics["personal-loss"] < 0.9 * untrained.loss_sum / untrained.count
    assert state.personal is None and state.to_arrays() == {}  # evaluation does not store state


def test_fedper_keeps_the_head_and_uploads_the_body():
    method, client = _build("fedper")
    full = global_state(client)
    head = head_keys(client.layout)
    body = {k: v for k, v in full.items() if k not in head}
    out, state = train(method, client, 1, {MODEL: body})
    assert set(out.model) == set(body)
    kept = state.personal
    assert set(kept) == set(head) and not torch.equal(kept["fc.weight"], full["fc.weight"])
    # next round: the client's own head on the new global body
    method, client = _build("fedper")
    state = persist(state)
    had = state.personal is not None
    model = client.new_model(method._start(client.initial_state(), Received(2, {MODEL: body}),
                                           state))
    assert had and torch.equal(model.state_dict()["fc.weight"], kept["fc.weight"])
    assert torch.equal(model.state_dict()["fc1.1.weight"], body["fc1.1.weight"])


def test_fedrep_head_training_on_cached_features_equals_training_through_the_frozen_body():
    method, client = _build("fedrep", **{"local-steps": 0})
    head = head_keys(client.layout)
    run = LocalRun(client.initial_state(), trainable=head, stream=3, epochs=2)
    assert client.last_layer_owning(client.new_model(), head) is not None  # the features path
    fast = client.execute(run, 1).model
    client.last_layer_owning = lambda model, keys: None  # force the generic path
    slow = client.execute(run, 1).model
    for key, value in fast.items():
        torch.testing.assert_close(value, slow[key], rtol=1e-4, atol=1e-5)
    initial = client.initial_state()
    assert not torch.equal(fast["fc.weight"], initial["fc.weight"])
    assert torch.equal(fast["fc1.1.weight"], initial["fc1.1.weight"])  # body frozen


def test_fedrep_body_phase_leaves_the_head_alone():
    method, client = _build("fedrep")
    head = head_keys(client.layout)
    body = tuple(n for n, _ in client.layout.named_parameters() if n not in head)
    before = client.initial_state()
    after = client.execute(LocalRun(before, trainable=body, stream=1, epochs=1), 1).model
    assert all(torch.equal(after[k], before[k]) for k in head)
    assert not torch.equal(after["fc1.1.weight"], before["fc1.1.weight"])


def test_fedbn_runs_on_cnn_bn_and_keeps_every_batch_norm_entry_local():
    settings = build_settings(SMALL)
    overrides = method_overrides(METHODS["fedbn"], settings.run.model, {})
    assert overrides == {"model": "cnn-bn"}
    with pytest.raises(ConfigError, match="batch norm"):
        method_overrides(METHODS["fedbn"], "mlp", {})
    method, client = _build("fedbn", model="cnn-bn")
    bn = batch_norm_keys(client.layout)
    shared = {k: v for k, v in global_state(client).items() if k not in bn}
    out, state = train(method, client, 1, {MODEL: shared})
    assert set(out.model) == set(shared)
    kept = state.personal
    assert set(kept) == set(bn) and int(kept["features.1.num_batches_tracked"]) == 4


def test_apfl_with_alpha_zero_and_no_adaptation_is_fedavg():
    _, reference = _build("fedavg")
    theta = global_state(reference)
    plain = _fedavg(theta)
    fixed = {"apfl-alpha": 0.0, "apfl-adaptive": False}
    method, client = _build("apfl", **fixed)
    out, state = train(method, client, 1, {MODEL: theta})
    for key, value in plain.items():
        assert torch.equal(out.model[key], value)
    method, client = _build("apfl", **fixed)
    metrics = evaluate(method, client, 2, {MODEL: theta}, state)
    assert metrics["personal-correct"] == metrics["global-correct"]


def test_apfl_one_step_by_hand():
    method, client = _build("apfl", **{"local-steps": 1, "apfl-alpha": 0.3,
                                       "apfl-alpha-lr": 0.5})
    w0 = global_state(client)
    names = _params(client)
    v0 = {k: (v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(9))
              if k in names else v) for k, v in w0.items()}
    out, state = train(method, client, 1, {MODEL: w0}, APFLClientState(personal=v0))
    (x, y), = list(client.batches(1))
    w_model, mixed = client.new_model(w0), client.new_model(w0)
    with torch.no_grad():
        for name, p in mixed.named_parameters():
            p.copy_(0.3 * v0[name] + 0.7 * w0[name])
    g_w = torch.autograd.grad(F.cross_entropy(w_model(x), y), list(w_model.parameters()))
    g_bar = torch.autograd.grad(F.cross_entropy(mixed(x), y), list(mixed.parameters()))
    alpha_grad = sum(float(((v0[n] - w0[n]) * g).sum()) for n, g in zip(names, g_bar,
                                                                         strict=True))
    v1 = state.personal
    for name, gw, gb in zip(names, g_w, g_bar, strict=True):
        torch.testing.assert_close(out.model[name], w0[name] - 0.05 * gw, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v1[name], v0[name] - 0.05 * 0.3 * gb, rtol=1e-5, atol=1e-6)
    alpha = state.alpha
    assert alpha == pytest.approx(min(1.0, max(0.0, 0.3 - 0.5 * alpha_grad)), abs=1e-6)
    assert alpha != pytest.approx(0.3)


def test_apfl_learns_alpha_within_the_unit_interval():
    method, client = _build("apfl")
    theta = global_state(client)
    _, state = train(method, client, 1, {MODEL: theta})
    alpha1 = state.alpha
    _, state = train(*_build("apfl"), 2, {MODEL: theta}, state)
    alpha2 = state.alpha
    # the first step has v = w (zero gradient); later steps move alpha
    assert 0.0 <= alpha1 <= 1.0 and alpha1 != 0.5
    assert 0.0 <= alpha2 <= 1.0 and alpha2 != alpha1


def test_perfedavg_meta_step_by_hand():
    method, client = _build("perfedavg", **{"local-steps": 2})
    theta = global_state(client)
    out = train(method, client, 1, {MODEL: theta})[0]
    (x1, y1), (x2, y2) = list(client.batches(1))
    model = client.new_model(theta)
    params = list(model.parameters())
    alpha, beta = method.params.alpha, method.params.beta
    assert (alpha, beta) == (0.01, 0.05)
    grads = torch.autograd.grad(F.cross_entropy(model(x1), y1), params)
    adapted = client.new_model(theta)
    with torch.no_grad():
        for p, g in zip(adapted.parameters(), grads, strict=True):
            p -= alpha * g
    meta = torch.autograd.grad(F.cross_entropy(adapted(x2), y2), list(adapted.parameters()))
    for (name, p), g in zip(model.named_parameters(), meta, strict=True):
        torch.testing.assert_close(out.model[name], (p - beta * g).detach(), rtol=1e-5,
                                   atol=1e-6)
    assert out.metrics["local-steps"] == 1


def test_pfedme_one_batch_one_inner_step_by_hand():
    lam, plr, lr = 15.0, 0.05, 0.05
    method, client = _build("pfedme", **{"local-steps": 1, "pfedme-k": 1})
    theta = global_state(client)
    out, state = train(method, client, 1, {MODEL: theta})
    (x, y), = list(client.batches(1))
    model = client.new_model(theta)
    grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
    # theta_1 = w - plr grad (the proximal term is 0 at theta = w); w_1 = w - lr lam (w - theta_1)
    for (name, p), g in zip(model.named_parameters(), grads, strict=True):
        torch.testing.assert_close(out.model[name], (p - lr * lam * plr * g).detach(),
                                   rtol=1e-4, atol=1e-6)
    personal = state.personal
    torch.testing.assert_close(personal["fc.bias"], theta["fc.bias"] - plr * grads[-1])


def test_pfedme_two_inner_steps_by_hand():
    lam, plr, lr = 15.0, 0.05, 0.05
    method, client = _build("pfedme", **{"local-steps": 1, "pfedme-k": 2})
    w = global_state(client)
    out, state = train(method, client, 1, {MODEL: w})
    (x, y), = list(client.batches(1))
    names = _params(client)
    theta = client.new_model(w)
    for _ in range(2):  # theta -= plr (grad f(theta) + lam (theta - w))
        grads = torch.autograd.grad(F.cross_entropy(theta(x), y), list(theta.parameters()))
        with torch.no_grad():
            for (name, p), g in zip(theta.named_parameters(), grads, strict=True):
                p -= plr * (g + lam * (p - w[name]))
    theta_state = theta.state_dict()
    for name in names:  # w <- w - lr lam (w - theta)
        torch.testing.assert_close(out.model[name], w[name] - lr * lam * (w[name] - theta_state[
            name]), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(state.personal[name], theta_state[name], rtol=1e-4,
                                   atol=1e-6)


def test_fedala_merges_the_top_layer_with_learned_weights_and_takes_the_global_body():
    method, client = _build("fedala")
    theta = global_state(client)
    _, state = train(method, client, 1, {MODEL: theta})
    own = state.model
    assert state.weights is None  # first round: no local model, no ALA
    new_global = global_state(client, shift=0.05)
    method, client = _build("fedala")
    merged_state, weights, passes = complete(method.adapt(client, own, new_global, state.weights),
                                             lambda run: client.execute(run, 2))
    assert set(weights) == {"fc.weight", "fc.bias"} and passes >= 1
    assert all(float(w.min()) >= 0 and float(w.max()) <= 1 for w in weights.values())
    assert any(float(w.min()) < 1 for w in weights.values())  # W has learned something
    assert torch.equal(merged_state["fc1.1.weight"], new_global["fc1.1.weight"])
    expected = own["fc.weight"] + (new_global["fc.weight"] - own["fc.weight"]) * weights[
        "fc.weight"]
    torch.testing.assert_close(merged_state["fc.weight"], expected)
    # the round's training keeps the learned W in the client's state
    _, after = train(method, client, 2, {MODEL: new_global}, state)
    assert set(after.weights) == set(weights)
    assert all(torch.equal(after.weights[k], w) for k, w in weights.items())


# --- server rules ------------------------------------------------------------------------------
def _server(name, num_clients=4, num_train=lambda c: 10, **changes):
    settings = build_settings({**SMALL, "num-clients": num_clients, **changes})
    method, runtime, model = server(name, settings, num_clients, num_train=num_train)
    return method, runtime, method.init_server(runtime, model)


class _Replies:
    """An engine that answers every exchange with the given replies."""

    def __init__(self, replies):
        self.replies = replies

    def exchange(self, action, messages):
        return Exchange(list(self.replies), 0, 0)


def _reply(cid, arrays, examples=10, **records):
    return Reply(sender=cid, who=f"client {cid}",
                 metrics=train_metrics(cid, examples),
                 arrays={MODEL: arrays, **records})


def test_fedper_server_never_sends_or_averages_the_head():
    method, runtime, state = _server("fedper")
    sent = method.train_payload(runtime, state, 0, 1).arrays[MODEL]
    assert "fc.weight" not in sent and "fc1.1.weight" in sent
    assert "fc.weight" not in runtime.flat.keys


def test_fedbn_server_refuses_a_model_without_batch_norm():
    with pytest.raises(ValueError, match="batch norm"):
        _server("fedbn")  # the run's model (no batch norm), not fedbn's cnn-bn


def test_pfedme_server_mixes_the_weighted_average_with_beta():
    for beta in (1.0, 0.5):
        method, runtime, state = _server("pfedme", **{"pfedme-beta": beta})
        assert method.params.beta == beta
        start = {k: v.copy() for k, v in state.model.items()}
        ones = {k: np.full_like(v, 1.0) for k, v in start.items()}
        fives = {k: np.full_like(v, 5.0) for k, v in start.items()}
        new, _ = method.aggregate(runtime, state, 1, [Update(0, 30, {}, ones),
                                                      Update(1, 10, {}, fives)])
        average = (30 * 1.0 + 10 * 5.0) / 40  # 2.0
        np.testing.assert_allclose(new.model["fc.bias"],
                                   (1 - beta) * start["fc.bias"] + beta * average, rtol=1e-6)


def test_scaffold_server_sends_c_and_updates_it_from_the_control_deltas():
    method, runtime, state = _server("scaffold", num_clients=4,
                                     num_train=lambda c: 30 if c == 0 else 10)
    assert CONTROL in method.train_payload(runtime, state, 0, 1).arrays
    x = {k: v.copy() for k, v in state.model.items()}
    delta = {k: np.full_like(x[k], 2.0) for k in runtime.trainable}
    y1 = {k: v + 1.0 for k, v in x.items()}
    y2 = {k: v + 3.0 for k, v in x.items()}
    federation = RoundLoop(runtime, method, _Replies([
        _reply(0, y1, examples=30, **{CONTROL_DELTA: delta}),
        _reply(1, y2, examples=10, **{CONTROL_DELTA: delta}),
        _reply(2, y1)]), Reporter(quiet=True))  # no control-delta: rejected, the rest aggregated
    federation.state = state
    metrics, _, _ = federation.train_round(1)
    assert metrics["rejected"] == 1 and metrics["clients-trained"] == 2
    np.testing.assert_allclose(federation.state.model["fc.bias"], x["fc.bias"] + 1.5, rtol=1e-6)
    control = method.train_payload(runtime, federation.state, 0, 2).arrays[CONTROL]
    np.testing.assert_allclose(control["fc.bias"], 4.0 / 4)  # c + sum(dc) / N
    assert set(control) == set(runtime.trainable)
    assert all(isinstance(v, np.ndarray) for v in control.values())


def test_fedala_scores_the_merge_of_the_current_global_model_without_storing_it():
    method, client = _build("fedala")
    theta = global_state(client)
    _, state = train(method, client, 1, {MODEL: theta})
    method, client = _build("fedala")
    new_global = global_state(client, shift=0.05)
    before = {k: v.clone() for k, v in state.model.items()}
    metrics = evaluate(method, client, 3, {MODEL: new_global}, state)
    merged, _, _ = complete(_build("fedala")[0].adapt(client, before, new_global, state.weights),
                            lambda run: client.execute(run, 3))
    expected = client.test(merged)
    assert (metrics["personal-correct"], metrics["personal-loss"]) == (
        expected.correct, expected.loss_sum / expected.count)
    assert state.weights is None  # evaluation stored nothing
    assert all(torch.equal(v, before[k]) for k, v in state.model.items())
