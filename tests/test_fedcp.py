"""FedCP's rules against hand-computed values, one local step by hand, and its server rule."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import needs_fashion_mnist
from harness import build, evaluate, global_state, server, train
from torch import nn

from pflalign.methods.fedcp import (
    CPN,
    ConditionalPolicy,
    client_vector,
    fedcp_logits,
    mmd2,
    new_policy,
)
from pflalign.models.registry import head_of, without_head
from pflalign.run.config import build_settings
from pflalign.wire.messages import Update
from pflalign.wire.protocol import MODEL

SMALL = {"num-clients": 2, "max-samples": 400, "local-steps": 3, "batch-size": 16, "seed": 1}


def _policy() -> ConditionalPolicy:
    policy = ConditionalPolicy(2)
    with torch.no_grad():
        policy.linear.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0],
                                                 [-1.0, 0.5]]))
        policy.linear.bias.copy_(torch.tensor([0.0, 0.1, -0.2, 0.3]))
    return policy


def test_policy_by_hand():
    c = np.array([0.5, -1.0])
    z = np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0], [-1.0, 0.5]]) @ c + [0.0, 0.1, -0.2, 0.3]
    z = np.maximum((z - z.mean()) / np.sqrt(z.var() + 1e-5), 0.0)  # LayerNorm, then ReLU
    r = np.exp(z[:2]) / (np.exp(z[:2]) + np.exp(z[2:]))  # softmax over the two slots per feature
    got_r, got_s = _policy()(torch.from_numpy(c[None]).float())
    np.testing.assert_allclose(got_r[0].detach().numpy(), r, rtol=1e-5)
    np.testing.assert_allclose(got_s[0].detach().numpy(), 1 - r, rtol=1e-5)


def test_client_vector_is_the_normalised_column_sum_of_the_head_weight():
    v = client_vector(torch.tensor([[1.0, 2.0], [3.0, -4.0]], requires_grad=True))
    torch.testing.assert_close(v, torch.tensor([4.0, -2.0]) / math.sqrt(20.0))
    assert not v.requires_grad


def test_logits_route_features_to_the_two_heads_by_hand():
    policy = _policy()
    global_head, personal_head = nn.Linear(2, 2), nn.Linear(2, 2)
    with torch.no_grad():
        global_head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
        global_head.bias.copy_(torch.tensor([0.5, 0.0]))
        personal_head.weight.copy_(torch.tensor([[2.0, 1.0], [0.0, -1.0]]))
        personal_head.bias.zero_()
    h = torch.tensor([[1.0, 2.0]])
    v = torch.tensor([0.6, 0.8])
    r, s = policy(v * h)
    expected = global_head(r * h) + personal_head(s * h)
    torch.testing.assert_close(fedcp_logits(h, v, policy, global_head, personal_head), expected)
    rh, sh = (r * h)[0].tolist(), (s * h)[0].tolist()
    by_hand = [rh[0] + 0.5 + 2 * sh[0] + sh[1], rh[1] - sh[1]]
    np.testing.assert_allclose(expected[0].detach().numpy(), by_hand, rtol=1e-6)


def test_mmd_by_hand():
    x, y = torch.tensor([[0.0], [1.0]]), torch.tensor([[0.0], [2.0]])
    # k(a, b) = exp(-(a - b)^2 / 2): mean Kxx + mean Kyy - 2 mean Kxy = (2 - 2 e^-0.5) / 4
    assert float(mmd2(x, y, bandwidths=(1.0,))) == pytest.approx((2 - 2 * math.exp(-0.5)) / 4)
    assert float(mmd2(x, x)) == 0.0
    z = x.clone().requires_grad_(True)
    mmd2(z, x).backward()  # the minimum: a zero gradient, no NaN at distance 0
    assert torch.equal(z.grad, torch.zeros_like(z))


@needs_fashion_mnist
def test_features_without_the_head():
    _, client = build("fedcp", SMALL)
    model = client.new_model()
    x = client.data.normalize(client.data.train_x[:4])
    with without_head(model):
        features = model(x)
    assert features.shape == (4, 512)
    torch.testing.assert_close(head_of(model)[1](features), model(x))


def _received(client):
    """The run's initial model and CPN, as the server sends them in round 1."""
    return {MODEL: global_state(client), CPN: new_policy(512, client.seed).state_dict()}


@needs_fashion_mnist
def test_one_local_step_by_hand_uploads_the_heads_mean_and_keeps_the_personal_head():
    method, client = build("fedcp", SMALL, **{"local-steps": 1, "fedcp-lambda": 5.0})
    arrays = _received(client)
    own = {k: v + 0.01 for k, v in head_of(client.new_model())[1].state_dict().items()}
    upload, state = train(method, client, 1, arrays, method.ClientState(head=own))
    # by hand: the same forward, the loss's gradients, one SGD step at lr 0.05
    (x, y), = list(client.batches(1))
    model = client.new_model(arrays[MODEL])
    global_head = head_of(model)[1]
    personal = nn.Linear(512, 10)
    personal.load_state_dict(own)
    policy = new_policy(512, client.seed)
    policy.load_state_dict(arrays[CPN])
    with without_head(model):
        h = model(x)
    loss = F.cross_entropy(fedcp_logits(h, client_vector(personal.weight), policy, global_head,
                                        personal), y)  # MMD = 0 and flat at the first step
    body = [(n, p) for n, p in model.named_parameters() if not n.startswith("fc.")]
    trained = [*[p for _, p in body], *personal.parameters(), *policy.parameters()]
    grads = torch.autograd.grad(loss, trained)
    step = {id(p): p.detach() - 0.05 * g for p, g in zip(trained, grads, strict=True)}
    for name, p in body:
        torch.testing.assert_close(upload.model[name], step[id(p)], rtol=1e-5, atol=1e-6)
    for key, p in personal.named_parameters():
        torch.testing.assert_close(state.head[key], step[id(p)], rtol=1e-5, atol=1e-6)
        # the uploaded head is (W^hd + W_i^hd) / 2, and the global head itself stayed frozen
        torch.testing.assert_close(upload.model[f"fc.{key}"],
                                   (arrays[MODEL][f"fc.{key}"] + state.head[key]) / 2)
    for key, p in policy.named_parameters():
        torch.testing.assert_close(upload.arrays[CPN][key], step[id(p)], rtol=1e-5, atol=1e-6)
    assert upload.metrics["mmd"] == 0.0 and upload.metrics["local-steps"] == 1


@needs_fashion_mnist
def test_the_mmd_term_keeps_the_features_near_the_global_extractors():
    mmd = {}
    for lam in (0.0, 0.5):
        method, client = build("fedcp", SMALL, **{"local-steps": 6, "fedcp-lambda": lam})
        upload, _ = train(method, client, 1, _received(client))
        mmd[lam] = upload.metrics["mmd"]  # the round's mean MMD^2 to the frozen extractor
    assert 0 < mmd[0.5] < 0.5 * mmd[0.0]


@needs_fashion_mnist
def test_a_client_without_a_personal_head_uses_the_runs_initial_head():
    method, client = build("fedcp", SMALL)
    arrays = _received(client)
    arrays[MODEL] = global_state(client, shift=0.01)  # a global head unlike the initial one
    initial = head_of(client.new_model())[1].state_dict()
    fresh = evaluate(method, client, 2, arrays)
    explicit = evaluate(method, client, 2, arrays, method.ClientState(head=dict(initial)))
    assert fresh == explicit
    assert fresh["num-test"] == client.data.num_test and "global-correct" in fresh


def test_server_sends_model_and_policy_and_averages_both_by_sample_count():
    settings = build_settings({"num-clients": 2, "methods": "fedcp", "max-samples": 400})
    method, runtime, model = server("fedcp", settings, 2)
    state = method.init_server(runtime, model)
    again = method.init_server(runtime, model)
    assert all(np.array_equal(state.cpn[k], again.cpn[k]) for k in state.cpn)  # seeded
    payload = method.train_payload(runtime, state, 0, 1)
    assert set(payload.arrays) == {MODEL, CPN} and "fc.weight" in payload.arrays[MODEL]
    assert set(method.reply_arrays(runtime)[CPN].keys) == set(state.cpn)
    ones = {k: np.ones_like(v) for k, v in model.items()}
    fives = {k: np.full_like(v, 5.0) for k, v in model.items()}
    cpn1 = {k: np.ones_like(v) for k, v in state.cpn.items()}
    cpn5 = {k: np.full_like(v, 5.0) for k, v in state.cpn.items()}
    new, _ = method.aggregate(runtime, state, 1, [Update(0, 30, {}, ones, {CPN: cpn1}),
                                                  Update(1, 10, {}, fives, {CPN: cpn5})])
    for values in (new.model, new.cpn):  # (30 * 1 + 10 * 5) / 40 = 2
        assert all(np.allclose(v, 2.0) for v in values.values())
