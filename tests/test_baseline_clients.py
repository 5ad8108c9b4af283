"""The baselines' client and server halves without Ray: invariants, state, what is sent."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import needs_fashion_mnist
from flwr.app import ArrayRecord, Message, Metadata, MetricRecord, RecordDict

from clients.apfl import ALPHA, APFLClient
from clients.base import ClientState, RoundInput
from clients.ditto import PERSONAL, DittoClient
from clients.fedala import MODEL, WEIGHTS, FedALAClient
from clients.fedavg import FedAvgClient
from clients.fedbn import FedBNClient
from clients.fedper import FedPerClient
from clients.fedprox import FedProxClient
from clients.fedrep import FedRepClient
from clients.perfedavg import PerFedAvgClient
from clients.pfedme import PFedMeClient
from clients.scaffold import CONTROL, CONTROL_DELTA, ScaffoldClient
from pflalign.config import ConfigError, Settings
from pflalign.methods import METHODS, method_overrides
from pflalign.models import batch_norm_keys, head_keys
from pflalign.results import Reporter
from pflalign.train import STREAM_PERSONAL
from strategies.base import ClientInfo, to_record
from strategies.partial import BatchNormStrategy, HeadStrategy
from strategies.pfedme import PFedMeStrategy
from strategies.scaffold import ScaffoldStrategy

pytestmark = needs_fashion_mnist

SMALL = {"num-clients": 2, "max-samples": 400, "local-steps": 4, "batch-size": 16, "seed": 1}


def _client(cls, records=None, cid=0, **changes):
    settings = Settings({**SMALL, **changes})
    return cls(settings, cid, ClientState(RecordDict() if records is None else records, "m"),
               torch.device("cpu"))


def _global(client, shift=0.0):
    return {k: v + shift if v.is_floating_point() else v
            for k, v in client.new_model().state_dict().items()}


def _distance(a, b, keys):
    return float(sum(((a[k] - b[k]) ** 2).sum() for k in keys)) ** 0.5


def _params(client):
    return [n for n, _ in client.new_model().named_parameters()]


def test_fedprox_with_mu_zero_is_fedavg_exactly_and_mu_pulls_towards_the_global_model():
    fedavg = _client(FedAvgClient)
    theta = _global(fedavg)
    plain = fedavg.fit(RoundInput(1, {"arrays": theta})).state
    zero = _client(FedProxClient, **{"fedprox-mu": 0.0}).fit(RoundInput(1, {"arrays": theta}))
    for key, value in plain.items():
        assert torch.equal(zero.state[key], value)
    pulled = _client(FedProxClient, **{"fedprox-mu": 10.0}).fit(RoundInput(1, {"arrays": theta}))
    keys = _params(fedavg)
    assert _distance(pulled.state, theta, keys) < 0.8 * _distance(plain, theta, keys)


def test_scaffold_first_round_is_fedavg_and_stores_the_option_two_control_variate():
    records = RecordDict()
    client = _client(ScaffoldClient, records)
    theta = _global(client)
    out = client.fit(RoundInput(1, {"arrays": theta}))
    plain = _client(FedAvgClient).fit(RoundInput(1, {"arrays": theta})).state
    for key, value in plain.items():  # c = c_i = 0: the corrected gradient is the gradient
        assert torch.equal(out.state[key], value)
    steps, lr = out.metrics["local-steps"], float(client.settings["lr"])
    stored = client.state.get_arrays(CONTROL)
    for name in _params(client):  # c_i+ = 0 - 0 + (x - y) / (K lr), and dc = c_i+ - 0
        expected = (theta[name] - out.state[name]) / (steps * lr)
        torch.testing.assert_close(stored[name], expected)
        torch.testing.assert_close(out.records[CONTROL_DELTA][name], expected)


def test_scaffold_round_two_uses_the_control_variates():
    records = RecordDict()
    theta = _global(_client(ScaffoldClient))
    _client(ScaffoldClient, records).fit(RoundInput(1, {"arrays": theta}))
    c_i = _client(ScaffoldClient, records).state.get_arrays(CONTROL)
    c = {k: torch.zeros_like(v) for k, v in c_i.items()}
    with_c = _client(ScaffoldClient, records).fit(RoundInput(2, {"arrays": theta, CONTROL: c}))
    without = _client(ScaffoldClient).fit(RoundInput(2, {"arrays": theta, CONTROL: c}))
    assert not torch.equal(with_c.state["fc.weight"], without.state["fc.weight"])


def test_scaffold_step_and_control_update_with_nonzero_variates_by_hand():
    records = RecordDict()
    client = _client(ScaffoldClient, records, **{"local-steps": 1})
    theta = _global(client)
    names = _params(client)
    c_i = {n: torch.full_like(theta[n], 0.02) for n in names}
    c = {n: torch.full_like(theta[n], -0.01) for n in names}
    client.state.set_arrays(CONTROL, c_i)
    out = client.fit(RoundInput(2, {"arrays": theta, CONTROL: c}))
    (x, y), = list(client.batches(2))
    model = client.new_model(theta)
    grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
    lr = 0.05
    for name, g in zip(names, grads, strict=True):
        # y = x - lr (g - c_i + c); c_i+ = c_i - c + (x - y) / lr = g; dc = c_i+ - c_i
        step = theta[name] - lr * (g - c_i[name] + c[name])
        torch.testing.assert_close(out.state[name], step, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(client.state.get_arrays(CONTROL)[name], g, rtol=1e-3,
                                   atol=1e-4)
        torch.testing.assert_close(out.records[CONTROL_DELTA][name], g - c_i[name], rtol=1e-3,
                                   atol=1e-4)


def test_scaffold_refuses_momentum():
    client = _client(ScaffoldClient, momentum=0.9)
    with pytest.raises(ValueError, match="plain SGD"):
        client.fit(RoundInput(1, {"arrays": _global(client)}))


def test_ditto_uploads_the_fedavg_model_and_a_large_lambda_pulls_the_personal_model_on():
    theta = _global(_client(FedAvgClient))
    plain = _client(FedAvgClient).fit(RoundInput(1, {"arrays": theta})).state
    distances = {}
    for lam in (0.0, 19.0):  # lr * lambda = 0.95: a strong contraction towards w_global
        records = RecordDict()
        out = _client(DittoClient, records, **{"ditto-lambda": lam}).fit(
            RoundInput(1, {"arrays": theta}))
        for key, value in plain.items():
            assert torch.equal(out.state[key], value)
        personal = ClientState(records, "m").get_arrays(PERSONAL)
        distances[lam] = _distance(personal, theta, _params(_client(FedAvgClient)))
    assert distances[0.0] > 0 and distances[19.0] < 0.5 * distances[0.0]


def test_ditto_with_lambda_zero_trains_the_personal_model_as_plain_sgd():
    records = RecordDict()
    client = _client(DittoClient, records, **{"ditto-lambda": 0.0})
    theta = _global(client)
    client.fit(RoundInput(1, {"arrays": theta}))
    reference = client.new_model(theta)
    client.local_train(reference, 1, stream=STREAM_PERSONAL, epochs=1)
    for key, value in reference.state_dict().items():
        assert torch.equal(client.state.get_arrays(PERSONAL)[key], value)


def test_ditto_new_client_fits_a_personal_model_at_evaluation():
    client = _client(DittoClient)
    theta = _global(client)
    metrics = client.evaluate(RoundInput(1, {"arrays": theta}))
    untrained = client.test(client.new_model(theta))
    # one proximal epoch on its own data from the (untrained) global model lowers its test loss
    assert metrics["personal-loss"] < 0.9 * untrained.loss_sum / untrained.count
    assert client.state.get_arrays(PERSONAL) is None  # evaluation does not store state


def test_fedper_keeps_the_head_and_uploads_the_body():
    records = RecordDict()
    client = _client(FedPerClient, records)
    full = _global(client)
    head = head_keys(client.template())
    body = {k: v for k, v in full.items() if k not in head}
    out = client.fit(RoundInput(1, {"arrays": body}))
    assert set(out.state) == set(body)
    kept = client.state.get_arrays("personal")
    assert set(kept) == set(head) and not torch.equal(kept["fc.weight"], full["fc.weight"])
    # next round: the client's own head on the new global body
    model, had = _client(FedPerClient, records)._model(RoundInput(2, {"arrays": body}))
    assert had and torch.equal(model.state_dict()["fc.weight"], kept["fc.weight"])
    assert torch.equal(model.state_dict()["fc1.1.weight"], body["fc1.1.weight"])


def test_fedrep_head_training_on_cached_features_equals_training_through_the_frozen_body():
    client = _client(FedRepClient, **{"local-steps": 0})
    head = head_keys(client.template())
    fast, slow = client.new_model(), client.new_model()
    client.train_part(fast, head, 1, stream=3, epochs=2)
    client.last_layer_owning = lambda model, keys: None  # force the generic path
    client.train_part(slow, head, 1, stream=3, epochs=2)
    for key, value in fast.state_dict().items():
        torch.testing.assert_close(value, slow.state_dict()[key], rtol=1e-4, atol=1e-5)
    assert not torch.equal(fast.state_dict()["fc.weight"], client.new_model().state_dict()[
        "fc.weight"])
    assert torch.equal(fast.state_dict()["fc1.1.weight"],
                       client.new_model().state_dict()["fc1.1.weight"])  # body frozen


def test_fedrep_body_phase_leaves_the_head_alone():
    client = _client(FedRepClient)
    model = client.new_model()
    head = head_keys(model)
    body = tuple(n for n, _ in model.named_parameters() if n not in head)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    client.train_part(model, body, 1, stream=1, epochs=1)
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in head)
    assert not torch.equal(after["fc1.1.weight"], before["fc1.1.weight"])
    assert all(p.requires_grad for p in model.parameters())  # unfrozen again


def test_fedbn_runs_on_cnn_bn_and_keeps_every_batch_norm_entry_local():
    settings = Settings(SMALL)
    overrides = method_overrides(METHODS["fedbn"], settings, {})
    assert overrides == {"model": "cnn-bn"}
    with pytest.raises(ConfigError, match="batch norm"):
        method_overrides(METHODS["fedbn"], Settings({**SMALL, "model": "mlp"}), {})
    records = RecordDict()
    client = _client(FedBNClient, records, model="cnn-bn")
    bn = batch_norm_keys(client.template())
    shared = {k: v for k, v in _global(client).items() if k not in bn}
    out = client.fit(RoundInput(1, {"arrays": shared}))
    assert set(out.state) == set(shared)
    kept = client.state.get_arrays("personal")
    assert set(kept) == set(bn) and int(kept["features.1.num_batches_tracked"]) == 4


def test_apfl_with_alpha_zero_and_no_adaptation_is_fedavg():
    theta = _global(_client(FedAvgClient))
    plain = _client(FedAvgClient).fit(RoundInput(1, {"arrays": theta})).state
    fixed = {"apfl-alpha": 0.0, "apfl-adaptive": False}
    records = RecordDict()
    client = _client(APFLClient, records, **fixed)
    out = client.fit(RoundInput(1, {"arrays": theta}))
    for key, value in plain.items():
        assert torch.equal(out.state[key], value)
    metrics = _client(APFLClient, records, **fixed).evaluate(RoundInput(2, {"arrays": theta}))
    assert metrics["personal-correct"] == metrics["global-correct"]


def test_apfl_one_step_by_hand():
    records = RecordDict()
    client = _client(APFLClient, records, **{"local-steps": 1, "apfl-alpha": 0.3,
                                             "apfl-alpha-lr": 0.5})
    w0 = _global(client)
    names = _params(client)
    v0 = {k: (v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(9))
              if k in names else v) for k, v in w0.items()}
    client.state.set_arrays(PERSONAL, v0)
    out = client.fit(RoundInput(1, {"arrays": w0}))
    (x, y), = list(client.batches(1))
    w_model, mixed = client.new_model(w0), client.new_model(w0)
    with torch.no_grad():
        for name, p in mixed.named_parameters():
            p.copy_(0.3 * v0[name] + 0.7 * w0[name])
    g_w = torch.autograd.grad(F.cross_entropy(w_model(x), y), list(w_model.parameters()))
    g_bar = torch.autograd.grad(F.cross_entropy(mixed(x), y), list(mixed.parameters()))
    alpha_grad = sum(float(((v0[n] - w0[n]) * g).sum()) for n, g in zip(names, g_bar,
                                                                         strict=True))
    v1 = ClientState(records, "m").get_arrays(PERSONAL)
    for name, gw, gb in zip(names, g_w, g_bar, strict=True):
        torch.testing.assert_close(out.state[name], w0[name] - 0.05 * gw, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v1[name], v0[name] - 0.05 * 0.3 * gb, rtol=1e-5, atol=1e-6)
    alpha = ClientState(records, "m").get_metrics(ALPHA)["alpha"]
    assert alpha == pytest.approx(min(1.0, max(0.0, 0.3 - 0.5 * alpha_grad)), abs=1e-6)
    assert alpha != pytest.approx(0.3)


def test_apfl_refuses_momentum():
    client = _client(APFLClient, momentum=0.5)
    with pytest.raises(ValueError, match="momentum"):
        client.fit(RoundInput(1, {"arrays": _global(client)}))


def test_apfl_learns_alpha_within_the_unit_interval():
    records = RecordDict()
    client = _client(APFLClient, records)
    theta = _global(client)
    client.fit(RoundInput(1, {"arrays": theta}))
    alpha1 = ClientState(records, "m").get_metrics(ALPHA)["alpha"]
    _client(APFLClient, records).fit(RoundInput(2, {"arrays": theta}))
    alpha2 = ClientState(records, "m").get_metrics(ALPHA)["alpha"]
    # the first step has v = w (zero gradient); later steps move alpha
    assert 0.0 <= alpha1 <= 1.0 and alpha1 != 0.5
    assert 0.0 <= alpha2 <= 1.0 and alpha2 != alpha1


def test_perfedavg_meta_step_by_hand():
    client = _client(PerFedAvgClient, **{"local-steps": 2})
    theta = _global(client)
    out = client.fit(RoundInput(1, {"arrays": theta}))
    (x1, y1), (x2, y2) = list(client.batches(1))
    model = client.new_model(theta)
    params = list(model.parameters())
    alpha, beta = client.settings["perfedavg-alpha"], client.settings["perfedavg-beta"]
    assert (alpha, beta) == (0.01, 0.05)
    grads = torch.autograd.grad(F.cross_entropy(model(x1), y1), params)
    adapted = client.new_model(theta)
    with torch.no_grad():
        for p, g in zip(adapted.parameters(), grads, strict=True):
            p -= alpha * g
    meta = torch.autograd.grad(F.cross_entropy(adapted(x2), y2), list(adapted.parameters()))
    for (name, p), g in zip(model.named_parameters(), meta, strict=True):
        torch.testing.assert_close(out.state[name], (p - beta * g).detach(), rtol=1e-5,
                                   atol=1e-6)
    assert out.metrics["local-steps"] == 1


def test_pfedme_one_batch_one_inner_step_by_hand():
    lam, plr, lr = 15.0, 0.05, 0.05
    client = _client(PFedMeClient, **{"local-steps": 1, "pfedme-k": 1})
    theta = _global(client)
    out = client.fit(RoundInput(1, {"arrays": theta}))
    (x, y), = list(client.batches(1))
    model = client.new_model(theta)
    grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
    # theta_1 = w - plr grad (the proximal term is 0 at theta = w); w_1 = w - lr lam (w - theta_1)
    for (name, p), g in zip(model.named_parameters(), grads, strict=True):
        torch.testing.assert_close(out.state[name], (p - lr * lam * plr * g).detach(),
                                   rtol=1e-4, atol=1e-6)
    personal = client.state.get_arrays("personal")
    torch.testing.assert_close(personal["fc.bias"], theta["fc.bias"] - plr * grads[-1])


def test_pfedme_two_inner_steps_by_hand():
    lam, plr, lr = 15.0, 0.05, 0.05
    client = _client(PFedMeClient, **{"local-steps": 1, "pfedme-k": 2})
    w = _global(client)
    out = client.fit(RoundInput(1, {"arrays": w}))
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
        torch.testing.assert_close(out.state[name], w[name] - lr * lam * (w[name] - theta_state[
            name]), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(client.state.get_arrays("personal")[name], theta_state[name],
                                   rtol=1e-4, atol=1e-6)


def test_fedala_merges_the_top_layer_with_learned_weights_and_takes_the_global_body():
    records = RecordDict()
    client = _client(FedALAClient, records)
    theta = _global(client)
    client.fit(RoundInput(1, {"arrays": theta}))
    own = client.state.get_arrays(MODEL)
    assert client.state.get_arrays(WEIGHTS) is None  # first round: no local model, no ALA
    new_global = _global(client, shift=0.05)
    merged, passes = _client(FedALAClient, records).adapt(own, new_global, 2)
    weights = ClientState(records, "m").get_arrays(WEIGHTS)
    assert set(weights) == {"fc.weight", "fc.bias"} and passes >= 1
    assert all(float(w.min()) >= 0 and float(w.max()) <= 1 for w in weights.values())
    assert any(float(w.min()) < 1 for w in weights.values())  # W has learned something
    state = merged.state_dict()
    assert torch.equal(state["fc1.1.weight"], new_global["fc1.1.weight"])
    expected = own["fc.weight"] + (new_global["fc.weight"] - own["fc.weight"]) * weights[
        "fc.weight"]
    torch.testing.assert_close(state["fc.weight"], expected)
    assert all(p.requires_grad for p in merged.parameters())


# --- server halves -----------------------------------------------------------------------------
def _strategy(cls, method, num_clients=4, **changes):
    settings = Settings({**SMALL, "num-clients": num_clients, **changes})
    model = FedAvgClient(settings, 0, ClientState(RecordDict(), "x"), torch.device("cpu"))
    state = {k: v.numpy() for k, v in model.new_model().state_dict().items()}
    strategy = cls(settings, METHODS[method], state, Reporter(quiet=True))
    strategy.clients = {c: ClientInfo(c, 100 + c, 10, 5, False) for c in range(num_clients)}
    strategy.node_to_client = {100 + c: c for c in range(num_clients)}
    return strategy


def _reply(strategy, cid, arrays, examples=10, **records):
    content = RecordDict({"metrics": MetricRecord({"partition-id": cid,
                                                   "num-examples": examples}),
                          "arrays": to_record(arrays), **{k: to_record(v)
                                                          for k, v in records.items()}})
    md = Metadata(run_id=1, message_id="", src_node_id=100 + cid, dst_node_id=0,
                  reply_to_message_id="m", group_id="", created_at=0.0, ttl=60,
                  message_type="train")
    return Message(metadata=md, content=content)


def test_head_strategy_never_sends_or_averages_the_head():
    strategy = _strategy(HeadStrategy, "fedper")
    sent = strategy.train_records(0)["arrays"]
    assert "fc.weight" not in sent and "fc1.1.weight" in sent
    assert "fc.weight" not in strategy.flat.keys


def test_batch_norm_strategy_refuses_a_model_without_batch_norm():
    with pytest.raises(ValueError, match="batch norm"):
        _strategy(BatchNormStrategy, "fedavg")


def test_pfedme_strategy_mixes_the_weighted_average_with_beta():
    for beta in (1.0, 0.5):
        strategy = _strategy(PFedMeStrategy, "pfedme", **{"pfedme-beta": beta})
        start = {k: v.copy() for k, v in strategy.global_state.items()}
        ones = {k: np.full_like(v, 1.0) for k, v in start.items()}
        fives = {k: np.full_like(v, 5.0) for k, v in start.items()}
        arrays, _ = strategy.aggregate_train(1, [_reply(strategy, 0, ones, examples=30),
                                                 _reply(strategy, 1, fives, examples=10)])
        average = (30 * 1.0 + 10 * 5.0) / 40  # 2.0
        np.testing.assert_allclose(arrays["fc.bias"].numpy(),
                                   (1 - beta) * start["fc.bias"] + beta * average, rtol=1e-6)


def test_scaffold_strategy_sends_c_and_updates_it_from_the_control_deltas():
    strategy = _strategy(ScaffoldStrategy, "scaffold", num_clients=4)
    assert CONTROL in strategy.train_records(0)
    x = {k: v.copy() for k, v in strategy.global_state.items()}
    delta = {k: np.full_like(x[k], 2.0) for k in strategy.trainable}
    y1 = {k: v + 1.0 for k, v in x.items()}
    y2 = {k: v + 3.0 for k, v in x.items()}
    arrays, metrics = strategy.aggregate_train(1, [
        _reply(strategy, 0, y1, examples=30, **{CONTROL_DELTA: delta}),
        _reply(strategy, 1, y2, examples=10, **{CONTROL_DELTA: delta}),
        _reply(strategy, 2, y1)])  # no control-delta: rejected, the rest aggregated
    assert metrics["failures"] == 1 and metrics["clients-trained"] == 2
    np.testing.assert_allclose(arrays["fc.bias"].numpy(), x["fc.bias"] + 1.5, rtol=1e-6)
    control = strategy.train_records(0)[CONTROL]
    np.testing.assert_allclose(control["fc.bias"].numpy(), 4.0 / 4)  # c + sum(dc) / N
    assert isinstance(control, ArrayRecord)


def test_fedala_scores_the_merge_of_the_current_global_model_without_storing_it():
    records = RecordDict()
    client = _client(FedALAClient, records)
    theta = _global(client)
    client.fit(RoundInput(1, {"arrays": theta}))
    client = _client(FedALAClient, records)
    new_global = _global(client, shift=0.05)
    before = {k: v.clone() for k, v in client.state.get_arrays(MODEL).items()}
    metrics = client.evaluate(RoundInput(3, {"arrays": new_global}))
    merged, _ = _client(FedALAClient, records).adapt(before, new_global, 3, save=False)
    expected = client.test(merged)
    assert (metrics["personal-correct"], metrics["personal-loss"]) == (
        expected.correct, expected.loss_sum / expected.count)
    assert client.state.get_arrays(WEIGHTS) is None  # evaluation stored nothing
    assert all(torch.equal(v, before[k]) for k, v in client.state.get_arrays(MODEL).items())
