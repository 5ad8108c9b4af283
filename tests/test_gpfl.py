"""GPFL's rules against hand-computed values, one local step by hand, and its server rule."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import needs_fashion_mnist
from harness import build, evaluate, global_state, server, train

from pflalign.methods.gpfl import (
    COV,
    GCE,
    ConditionalValve,
    GPFLModel,
    conditional_inputs,
    guidance_losses,
    new_modules,
)
from pflalign.models.registry import head_keys, head_of, without_head
from pflalign.run.config import ConfigError, build_settings
from pflalign.training.loops import STREAM_FINETUNE
from pflalign.wire.messages import Update
from pflalign.wire.protocol import MODEL

SMALL = {"num-clients": 2, "max-samples": 400, "local-steps": 3, "batch-size": 16, "seed": 1}


WEIGHTS = {"gamma": [[1.0, 0.0], [0.5, 2.0]], "beta": [[2.0, 1.0], [-3.0, 1.0]]}
BIAS = [0.1, 0.9]


def _valve() -> ConditionalValve:
    valve = ConditionalValve(2)
    with torch.no_grad():
        for name in WEIGHTS:
            getattr(valve, name)[0].weight.copy_(torch.tensor(WEIGHTS[name]))
            getattr(valve, name)[0].bias.copy_(torch.tensor(BIAS))
    return valve


def test_conditional_valve_by_hand():
    c = np.array([1.0, 0.5])
    f = np.array([[2.0, -1.0], [0.5, 3.0]])

    def branch(name):  # Linear -> ReLU -> LayerNorm (unit affine at initialisation)
        z = np.maximum(np.array(WEIGHTS[name]) @ c + BIAS, 0.0)
        return (z - z.mean()) / np.sqrt(z.var() + 1e-5)

    expected = np.maximum(f * (branch("gamma") + 1) + branch("beta"), 0.0)
    got = _valve()(torch.tensor(f, dtype=torch.float32), torch.tensor(c, dtype=torch.float32))
    np.testing.assert_allclose(got.detach().numpy(), expected, rtol=1e-5, atol=1e-6)


def test_conditional_inputs_by_hand():
    embedding = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.0, 4.0]], requires_grad=True)
    labels = torch.tensor([0, 0, 2, 0])  # class shares 3/4, 0, 1/4
    g, p = conditional_inputs(embedding, labels)
    torch.testing.assert_close(g, torch.tensor([4.0, 5.0]) / 3)
    torch.testing.assert_close(p, (0.75 * torch.tensor([1.0, 2.0])
                                   + 0.25 * torch.tensor([0.0, 4.0])) / 3)
    assert not g.requires_grad and not p.requires_grad


def test_guidance_losses_by_hand():
    f = torch.tensor([[3.0, 4.0], [0.0, 2.0]])
    trained = torch.tensor([[1.0, 0.0], [0.0, 1.0]], requires_grad=True)
    received = torch.tensor([[3.0, 0.0], [1.0, 2.0]])
    labels = torch.tensor([0, 1])
    alg, mlg = guidance_losses(f, trained, received, labels)
    # cosines: sample 0 -> (0.6, 0.8), sample 1 -> (0, 1); CE of those logits at the labels
    cos = torch.tensor([[0.6, 0.8], [0.0, 1.0]])
    assert float(alg.detach()) == pytest.approx(
        float(-(cos.log_softmax(dim=1)[[0, 1], [0, 1]]).mean()), rel=1e-6)
    # ||(3, 4) - (3, 0)|| = 4 and ||(0, 2) - (1, 2)|| = 1, averaged
    assert float(mlg) == pytest.approx(2.5)
    alg.backward()
    assert (trained.grad != 0).any(dim=1).all()  # every class embedding gets a gradient


def _received(client, shift: float = 0.0) -> dict:
    valve, embedding = new_modules(10, 512, client.seed)
    full = global_state(client, shift)
    head = set(head_keys(client.layout))
    return {MODEL: {k: v for k, v in full.items() if k not in head},
            COV: valve.state_dict(), GCE: embedding.state_dict()}


@needs_fashion_mnist
def test_one_local_step_by_hand_keeps_the_head_and_uploads_the_rest():
    method, client = build("gpfl", SMALL, **{"local-steps": 1, "gpfl-lambda": 0.5,
                                             "gpfl-mu": 0.1, "momentum": 0.0})
    arrays = _received(client)
    upload, state = train(method, client, 1, arrays)
    # by hand: the losses, their gradients, SGD at lr 0.05, weight decay mu on CoV and GCE
    (x, y), = list(client.batches(1))
    model = client.new_model({**client.initial_state(), **arrays[MODEL]})
    valve, embedding = new_modules(10, 512, client.seed)
    valve.load_state_dict(arrays[COV])
    embedding.load_state_dict(arrays[GCE])
    g, p = conditional_inputs(embedding.weight, client.data.train_y)
    with without_head(model):
        f = model(x)
    ce = F.cross_entropy(head_of(model)[1](valve(f, p)), y)
    alg, mlg = guidance_losses(valve(f, g), embedding.weight, embedding.weight.detach(), y)
    shared = [*valve.parameters(), *embedding.parameters()]
    params = list(model.parameters())
    grads = torch.autograd.grad(ce + alg + 0.5 * mlg, [*params, *shared])
    step = [q.detach() - 0.05 * gr for q, gr in zip(params, grads, strict=False)]
    step += [q.detach() - 0.05 * (gr + 0.1 * q.detach())
             for q, gr in zip(shared, grads[len(params):], strict=True)]
    named = [n for n, _ in model.named_parameters()]
    head = set(head_keys(model))
    for name, expected in zip(named, step, strict=False):
        got = state.head[name] if name in head else upload.model[name]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert set(upload.model) == set(arrays[MODEL]) and set(state.head) == head
    sent = [*upload.arrays[COV].values(), *upload.arrays[GCE].values()]
    for got, expected in zip(sent, step[len(params):], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert upload.metrics["train-loss"] == pytest.approx(float(ce.detach()))
    assert upload.metrics["mlg"] == pytest.approx(float(mlg.detach()))


@needs_fashion_mnist
def test_evaluation_uses_the_personal_head_on_the_personalized_feature():
    method, client = build("gpfl", SMALL)
    arrays = _received(client, shift=0.01)
    own = {k: v + 0.05 for k, v in head_of(client.new_model())[1].state_dict().items()}
    state = method.ClientState(head={f"fc.{k}": v for k, v in own.items()})
    metrics = evaluate(method, client, 2, arrays, state)
    model = client.new_model({**client.initial_state(), **arrays[MODEL], **state.head})
    valve, embedding = new_modules(10, 512, client.seed)
    valve.load_state_dict(arrays[COV])
    embedding.load_state_dict(arrays[GCE])
    _, p = conditional_inputs(embedding.weight, client.data.train_y)
    by_hand = client.test(GPFLModel(model, valve, p))
    assert metrics["personal-correct"] == by_hand.correct and "global-correct" not in metrics
    # a new client first fits the run's initial head on the personalized route (by hand: SGD
    # at lr 0.05 on the head alone, the fine-tuning stream, finetune-epochs = 1)
    fresh = evaluate(method, client, 2, arrays)
    fitted = GPFLModel(client.new_model({**client.initial_state(), **arrays[MODEL]}),
                               valve, p)
    head = head_of(fitted.model)[1]
    sgd = torch.optim.SGD(head.parameters(), lr=0.05)
    for x, y in client.batches(2, STREAM_FINETUNE, 1):
        sgd.zero_grad()
        F.cross_entropy(fitted(x), y).backward()
        sgd.step()
    expected = client.test(fitted)
    assert fresh["personal-correct"] == expected.correct
    assert fresh["personal-loss"] == pytest.approx(expected.loss_sum / expected.count, rel=1e-5)
    assert not torch.equal(head.weight, head_of(client.new_model())[1].weight)


def test_the_server_averages_extractor_valve_and_embedding_by_sample_count():
    settings = build_settings({"num-clients": 2, "methods": "gpfl", "max-samples": 400})
    method, runtime, model = server("gpfl", settings, 2)
    state = method.init_server(runtime, model)
    again = method.init_server(runtime, model)
    assert all(np.array_equal(state.cov[k], again.cov[k]) for k in state.cov)  # seeded
    payload = method.train_payload(runtime, state, 0, 1)
    assert set(payload.arrays) == {MODEL, COV, GCE}
    assert "fc.weight" not in payload.arrays[MODEL]  # the head stays on the clients
    assert payload.arrays[GCE]["weight"].shape == (10, 512)

    def update(cid, n, value):
        return Update(cid, n, {}, {k: np.full_like(v, value) for k, v in
                                   runtime.shared_model(state).items()},
                      {COV: {k: np.full_like(v, value) for k, v in state.cov.items()},
                       GCE: {k: np.full_like(v, value) for k, v in state.gce.items()}})

    new, _ = method.aggregate(runtime, state, 1, [update(0, 30, 1.0), update(1, 10, 5.0)])
    for values in (runtime.shared_model(new), new.cov, new.gce):  # (30 + 50) / 40 = 2
        assert all(np.allclose(v, 2.0) for v in values.values())
    assert np.array_equal(new.model["fc.weight"], model["fc.weight"])


def test_gpfl_has_its_own_local_rule():
    with pytest.raises(ConfigError, match="does not apply to gpfl"):
        build_settings({"methods": "gpfl", "local-optimizer": "adam"})
