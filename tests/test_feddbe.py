"""FedDBE's rules against hand-computed values, its first round as FedAvg's bit for bit, one
regularized local step by hand, and its server rule (the global mean, fixed once)."""

import numpy as np
import torch
import torch.nn.functional as F
from conftest import needs_fashion_mnist
from harness import build, evaluate, global_state, server, train

from pflalign.methods.feddbe import (
    FEATURE_MEAN,
    GLOBAL_MEAN,
    MEAN,
    BiasedModel,
    FedDBEClientState,
    mean_regularization,
    running_mean,
)
from pflalign.models.registry import head_of, without_head
from pflalign.run.config import build_settings
from pflalign.wire.messages import Update
from pflalign.wire.protocol import MODEL

SMALL = {"num-clients": 2, "max-samples": 400, "local-steps": 3, "batch-size": 16, "seed": 1}


def test_running_mean_and_mean_regularization_by_hand():
    previous = torch.tensor([1.0, -2.0], requires_grad=True)
    batch_mean = torch.tensor([3.0, 0.0], requires_grad=True)
    mean = running_mean(previous, batch_mean, 0.25)
    torch.testing.assert_close(mean, torch.tensor([0.75 * 1 + 0.25 * 3, 0.75 * -2 + 0.0]))
    mr = mean_regularization(mean, torch.tensor([1.0, -1.0]))
    # (1/K) sum 1/2 (zbar - zbar^g)^2 = ((1.5 - 1)^2 + (-1.5 + 1)^2) / 4
    assert float(mr.detach()) == 0.125
    mr.backward()
    assert previous.grad is None  # the history is detached
    torch.testing.assert_close(batch_mean.grad, 0.25 * torch.tensor([0.5, -0.5]) / 2)


def test_the_biased_model_adds_the_bias_before_the_head():
    _, client = build("feddbe", SMALL)
    model = client.new_model()
    bias = torch.linspace(-1, 1, head_of(model)[1].in_features)
    x = torch.randn(3, 1, 28, 28)
    with without_head(model):
        features = model(x)
    torch.testing.assert_close(BiasedModel(model, bias)(x), head_of(model)[1](features + bias))


@needs_fashion_mnist
def test_the_first_round_is_fedavgs_bit_for_bit_and_uploads_the_last_batch_mean():
    _, reference = build("fedavg", SMALL)
    theta = global_state(reference)
    plain, _ = train(build("fedavg", SMALL)[0], reference, 1, {MODEL: theta})
    method, client = build("feddbe", SMALL)
    upload, state = train(method, client, 1, {MODEL: theta})
    assert all(torch.equal(upload.model[k], plain.model[k]) for k in plain.model)
    assert upload.metrics["train-loss"] == plain.metrics["train-loss"]
    assert state.bias is None and "mr" not in upload.metrics
    # momentum 1: the running mean is the last mini-batch's mean feature, before its step
    batches = list(client.batches(1))
    model = client.new_model(theta)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches[:-1]:
        sgd.zero_grad()
        F.cross_entropy(model(x), y).backward()
        sgd.step()
    with torch.no_grad(), without_head(model):
        expected = model(batches[-1][0]).mean(dim=0)
    torch.testing.assert_close(upload.arrays[FEATURE_MEAN][MEAN], expected, rtol=1e-5,
                               atol=1e-6)


@needs_fashion_mnist
def test_one_regularized_step_by_hand():
    method, client = build("feddbe", SMALL, **{"local-steps": 1, "feddbe-kappa": 5.0,
                                               "feddbe-momentum": 0.5})
    theta = global_state(client)
    target = torch.full((512,), 0.3)
    own = torch.linspace(-0.1, 0.1, 512)
    upload, state = train(method, client, 2, {MODEL: theta, GLOBAL_MEAN: {MEAN: target}},
                          FedDBEClientState(own.clone()))
    # by hand: zbar = 0.5 * 0 + 0.5 * mean(f); loss = CE(head(f + z^p)) + 5 * MR; SGD at 0.05
    (x, y), = list(client.batches(2))
    model = client.new_model(theta)
    bias = own.clone().requires_grad_(True)
    with without_head(model):
        features = model(x)
    mean = 0.5 * features.mean(dim=0)
    ce = F.cross_entropy(head_of(model)[1](features + bias), y)
    loss = ce + 5.0 * 0.5 * (mean - target).pow(2).mean()
    params = list(model.parameters())
    grads = torch.autograd.grad(loss, [*params, bias], retain_graph=True)
    for (name, p), g in zip(model.named_parameters(), grads, strict=False):
        torch.testing.assert_close(upload.model[name], p.detach() - 0.05 * g, rtol=1e-5,
                                   atol=1e-6)
    torch.testing.assert_close(state.bias, own - 0.05 * grads[-1], rtol=1e-5, atol=1e-7)
    # the bias's gradient is the cross-entropy's alone: MR reaches the extractor only
    torch.testing.assert_close(grads[-1], torch.autograd.grad(ce, bias)[0])
    torch.testing.assert_close(upload.arrays[FEATURE_MEAN][MEAN], mean.detach())
    assert upload.metrics["train-loss"] == float(ce.detach())
    assert upload.metrics["mr"] > 0


@needs_fashion_mnist
def test_evaluation_adds_the_clients_bias_and_a_new_client_gets_the_global_model():
    method, client = build("feddbe", SMALL)
    theta = global_state(client, shift=0.01)
    fresh = evaluate(method, client, 2, {MODEL: theta})
    assert fresh["personal-correct"] == fresh["global-correct"]
    assert fresh["personal-loss"] == fresh["global-loss"]
    biased = evaluate(method, client, 2, {MODEL: theta},
                      FedDBEClientState(torch.full((512,), 3.0)))
    by_hand = client.test(BiasedModel(client.new_model(theta), torch.full((512,), 3.0)))
    assert biased["personal-correct"] == by_hand.correct
    assert biased["global-correct"] == fresh["global-correct"]
    assert biased["personal-loss"] != fresh["personal-loss"]


def test_the_server_fixes_the_global_mean_once_and_sends_it_with_the_model():
    settings = build_settings({"num-clients": 2, "methods": "feddbe", "max-samples": 400})
    method, runtime, model = server("feddbe", settings, 2)
    state = method.init_server(runtime, model)
    assert set(method.train_payload(runtime, state, 0, 1).arrays) == {MODEL}
    assert method.reply_arrays(runtime)[FEATURE_MEAN].keys == (MEAN,)

    def update(cid, n, value):
        return Update(cid, n, {}, {k: np.full_like(v, value) for k, v in model.items()},
                      {FEATURE_MEAN: {MEAN: np.full(512, value, dtype=np.float32)}})

    first, _ = method.aggregate(runtime, state, 1, [update(0, 30, 1.0), update(1, 10, 5.0)])
    assert np.allclose(first.global_mean, 2.0)  # (30 * 1 + 10 * 5) / 40
    assert all(np.allclose(v, 2.0) for v in first.model.values())
    payload = method.train_payload(runtime, first, 0, 2)
    assert np.array_equal(payload.arrays[GLOBAL_MEAN][MEAN], first.global_mean)
    second, _ = method.aggregate(runtime, first, 2, [update(0, 30, 7.0), update(1, 10, 7.0)])
    assert np.array_equal(second.global_mean, first.global_mean)  # fixed after the first round
    assert all(np.allclose(v, 7.0) for v in second.model.values())
    restored = method.ServerState.from_arrays(second.to_arrays())
    assert np.array_equal(restored.global_mean, second.global_mean)
