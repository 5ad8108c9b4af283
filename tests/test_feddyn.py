"""FedDyn's rules against hand-computed values, its client invariant, and its server step."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import needs_fashion_mnist
from harness import build, global_state, server, train

from pflalign.methods.feddyn import DynamicRegularizer, feddyn_server_update, linear_term_update
from pflalign.run.config import build_settings
from pflalign.wire.messages import Update

SMALL = {"num-clients": 2, "max-samples": 400, "local-steps": 4, "batch-size": 16, "seed": 1}


def test_dynamic_regularizer_gradient_by_hand():
    grad = torch.tensor([0.3, 0.4])
    correction = DynamicRegularizer({"w": torch.tensor([0.5, 1.0])},
                                    {"w": torch.tensor([0.1, -0.2])}, 0.5)
    correction.apply_([grad], [torch.tensor([1.0, 2.0])], ["w"])
    # g + alpha (theta - theta_server) - g_k = [0.3 + 0.25 - 0.1, 0.4 + 0.5 + 0.2]
    torch.testing.assert_close(grad, torch.tensor([0.45, 1.1]))


def test_linear_term_update_by_hand():
    linear = [torch.tensor([0.1, -0.2])]
    new = linear_term_update(linear, [torch.tensor([1.0, 2.0])], [torch.tensor([0.5, 1.0])], 0.5)
    # g_k - alpha (theta_end - theta_server) = [0.1 - 0.25, -0.2 - 0.5]
    torch.testing.assert_close(new[0], torch.tensor([-0.15, -0.7]))
    torch.testing.assert_close(linear[0], torch.tensor([0.1, -0.2]))  # not modified


def test_server_update_by_hand():
    model, h = feddyn_server_update(np.zeros(2), np.array([0.2, 0.0]),
                                    [np.array([1.0, 2.0]), np.array([3.0, 4.0])],
                                    num_clients=4, alpha=0.5)
    # h = h - alpha (1/m) sum (theta_k - theta) = [0.2 - 0.5, 0 - 0.75]
    np.testing.assert_allclose(h, [-0.3, -0.75])
    # theta = mean(theta_k) - h / alpha = [2, 3] - [-0.6, -1.5]
    np.testing.assert_allclose(model, [2.6, 4.5])


@needs_fashion_mnist
def test_first_round_is_fedprox_with_mu_alpha_exactly_and_stores_the_linear_term():
    feddyn, client = build("feddyn", SMALL, **{"feddyn-alpha": 0.3})
    fedprox, prox_client = build("fedprox", SMALL, **{"fedprox-mu": 0.3})
    theta = global_state(client)
    upload, state = train(feddyn, client, 1, {"arrays": theta})
    reference, _ = train(fedprox, prox_client, 1, {"arrays": theta})
    for key, value in reference.model.items():
        assert torch.equal(upload.model[key], value)
    for name, value in state.linear.items():  # g_k = 0 - alpha (theta_end - theta_server)
        torch.testing.assert_close(value, -0.3 * (upload.model[name] - theta[name]))
    assert set(state.linear) == {n for n, _ in client.new_model().named_parameters()}


@needs_fashion_mnist
def test_one_step_with_a_linear_term_by_hand():
    method, client = build("feddyn", SMALL, **{"local-steps": 1, "feddyn-alpha": 0.3})
    theta = global_state(client)
    names = [n for n, _ in client.new_model().named_parameters()]
    linear = {n: torch.full_like(theta[n], 0.02) for n in names}
    upload, state = train(method, client, 2, {"arrays": theta},
                          method.ClientState(linear=linear))
    (x, y), = list(client.batches(2))
    model = client.new_model(theta)
    grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
    for name, g in zip(names, grads, strict=True):
        # at theta = theta_server the proximal term vanishes: theta_1 = theta - lr (g - g_k)
        expected = theta[name] - 0.05 * (g - linear[name])
        torch.testing.assert_close(upload.model[name], expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state.linear[name],
                                   linear[name] - 0.3 * (upload.model[name] - theta[name]))


def test_server_rule_keeps_h_and_corrects_the_uniform_mean():
    initial = {"w": np.array([1.0, -1.0], np.float32), "count": np.array(3, np.int64)}
    settings = build_settings({"num-clients": 4, "methods": "feddyn", "feddyn-alpha": 0.5})
    method, runtime, model = server("feddyn", settings, 4, initial, trainable=("w",))
    state = method.init_server(runtime, model)
    np.testing.assert_array_equal(state.h, [0.0, 0.0])
    updates = [Update(0, 10, {}, {"w": np.array([2.0, 1.0], np.float32),
                                  "count": np.array(5, np.int64)}),
               Update(1, 30, {}, {"w": np.array([4.0, -3.0], np.float32),
                                  "count": np.array(9, np.int64)})]
    new, diagnostics = method.aggregate(runtime, state, 1, updates)
    # h = -0.5 ((2-1)+(4-1), (1+1)+(-3+1)) / 4 = [-0.5, 0]; w = [3, -1] - h / 0.5 = [4, -1]
    np.testing.assert_allclose(new.h, [-0.5, 0.0])
    np.testing.assert_allclose(new.model["w"], [4.0, -1.0])
    assert new.model["w"].dtype == np.float32
    assert int(new.model["count"]) == 8  # buffers: sample-weighted (10*5 + 30*9) / 40
    assert diagnostics["h-norm"] == pytest.approx(0.5)
    np.testing.assert_array_equal(state.h, [0.0, 0.0])  # the old state is left as it was
