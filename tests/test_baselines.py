"""The baselines' defining rules on small tensors, against values computed by hand."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pflalign.methods.apfl import ALPHA, PERSONAL, MixtureObjective
from pflalign.methods.fedala import WEIGHTS, ala_converged, ala_merge, ala_weight_rule
from pflalign.methods.pfedme import MoreauEnvelope, pfedme_outer_step_, pfedme_server_update
from pflalign.methods.scaffold import (
    ControlVariates,
    scaffold_client_control,
    scaffold_server_update,
)
from pflalign.server.aggregation import fedavg
from pflalign.training.corrections import Proximal
from pflalign.training.objectives import ModelCall, with_prefix
from pflalign.training.optimizers import EntryGroup, SGDGroups


def _param(values, grad=None) -> torch.Tensor:
    p = torch.tensor(values, dtype=torch.float32, requires_grad=True)
    if grad is not None:
        p.grad = torch.tensor(grad, dtype=torch.float32)
    return p


def test_proximal_term_adds_mu_times_the_distance_to_the_anchor():
    grad = torch.tensor([0.1, 0.2])
    Proximal({"w": torch.tensor([0.5, 0.5])}, mu=0.5).apply_([grad], [torch.tensor([1.0, 2.0])],
                                                            ["w"])
    torch.testing.assert_close(grad, torch.tensor([0.35, 0.95]))


def test_proximal_term_with_mu_zero_leaves_the_gradient_bit_for_bit():
    g = torch.randn(5, generator=torch.Generator().manual_seed(0))
    grad = g.clone()
    Proximal({"w": torch.randn(5)}, mu=0.0).apply_([grad], [torch.randn(5)], ["w"])
    assert torch.equal(grad, g)


def test_a_correction_reads_its_tensors_by_entry_name():
    grads = [torch.zeros(2), torch.zeros(1)]
    anchor = {"b": torch.tensor([1.0]), "a": torch.tensor([1.0, 2.0])}
    Proximal(anchor, mu=1.0).apply_(grads, [torch.zeros(2), torch.zeros(1)], ["a", "b"])
    torch.testing.assert_close(grads[0], torch.tensor([-1.0, -2.0]))
    torch.testing.assert_close(grads[1], torch.tensor([-1.0]))


def test_scaffold_corrected_gradient_is_g_minus_ci_plus_c():
    grad = torch.tensor([1.0, -1.0])
    ControlVariates({"w": torch.tensor([0.5, 0.25])}, {"w": torch.tensor([0.25, 1.0])}).apply_(
        [grad], [torch.zeros(2)], ["w"])
    torch.testing.assert_close(grad, torch.tensor([1.25, -1.75]))


def test_scaffold_option_two_control_variate():
    # c_i+ = c_i - c + (x - y) / (K lr) = 1 - 0.5 + 0.5 / (5 * 0.1) = 1.5
    new = scaffold_client_control([torch.tensor([1.0])], [torch.tensor([0.5])],
                                  [torch.tensor([2.0])], [torch.tensor([1.5])], steps=5, lr=0.1)
    torch.testing.assert_close(new[0], torch.tensor([1.5]))
    with pytest.raises(ValueError):
        scaffold_client_control([torch.zeros(1)], [torch.zeros(1)], [torch.zeros(1)],
                                [torch.zeros(1)], steps=0, lr=0.1)


def test_scaffold_server_step_by_hand():
    x, c = np.array([0.0, 0.0]), np.array([1.0, 0.0])
    dys = [np.array([1.0, 0.0]), np.array([0.0, 2.0])]
    dcs = [np.array([0.4, 0.0]), np.array([0.0, 0.8])]
    model, control = scaffold_server_update(x, c, dys, dcs, [1.0, 3.0], num_clients=4,
                                            server_lr=1.0)
    np.testing.assert_allclose(model, [0.25, 1.5])
    np.testing.assert_allclose(control, [1.1, 0.2])  # c + (dc_1 + dc_2) / N
    half, _ = scaffold_server_update(x, c, dys, dcs, [1.0, 3.0], num_clients=4, server_lr=0.5)
    np.testing.assert_allclose(half, [0.125, 0.75])


def test_scaffold_server_step_with_unit_rate_is_fedavg():
    rng = np.random.default_rng(0)
    x = rng.normal(size=7)
    ys = [rng.normal(size=7) for _ in range(3)]
    sizes = [5.0, 1.0, 9.0]
    model, _ = scaffold_server_update(x, np.zeros(7), [y - x for y in ys], [np.zeros(7)] * 3,
                                      sizes, num_clients=3, server_lr=1.0)
    expected = fedavg([{"w": y} for y in ys], sizes)["w"]
    np.testing.assert_allclose(model, expected, rtol=1e-6, atol=1e-7)  # fedavg packs float32


def _step(objective, model: torch.nn.Module, rule, extras: dict, x, y) -> dict:
    """One step of a local run with ``objective`` on ``model``'s parameters and ``extras``,
    stepped by ``rule``: the new values, by name."""
    named = dict(model.named_parameters())
    extras = {k: v.clone().requires_grad_(True) for k, v in extras.items()}
    trained = {**named, **extras}
    optimizer = rule.build(list(trained.values()), list(trained), None)
    objective.loss(ModelCall(model), named, extras, {}, x, y, None).objective.backward()
    optimizer.step()
    return {k: v.detach().clone() for k, v in trained.items()}


def test_apfl_step_by_hand():
    """One APFL step (Algorithm 1) from the mixture objective and its grouped SGD, against the
    three updates written out with separate gradients: w by grad f(w), v by alpha grad f(v_bar),
    alpha by <v - w, grad f(v_bar)>, projected onto [0, 1]."""
    gen = torch.Generator().manual_seed(1)
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():  # seeded here: the global generator's state depends on what ran first
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x, y = torch.randn(5, 3, generator=gen), torch.tensor([0, 1, 1, 0, 1])
    w = {k: p.detach().clone() for k, p in model.named_parameters()}
    v = {k: t + 0.5 * torch.randn(t.shape, generator=gen) for k, t in w.items()}
    alpha, lr, alpha_lr = 0.3, 0.1, 0.05

    def f(entries: dict) -> torch.Tensor:
        return F.cross_entropy(x @ entries["weight"].T + entries["bias"], y)

    w_req = {k: t.clone().requires_grad_(True) for k, t in w.items()}
    g_w = torch.autograd.grad(f(w_req), list(w_req.values()))
    bar = {k: (alpha * v[k] + (1 - alpha) * w[k]).requires_grad_(True) for k in w}
    g_bar = dict(zip(bar, torch.autograd.grad(f(bar), list(bar.values())), strict=True))
    alpha_grad = sum(float(((v[k] - w[k]) * g_bar[k]).sum()) for k in w)
    rule = SGDGroups(lr, groups=(EntryGroup(f"{PERSONAL}.", weight_decay=0.0),
                                 EntryGroup(ALPHA, lr=alpha_lr, bounds=(0.0, 1.0))))
    after = _step(MixtureObjective({}, {}), model, rule,
                  {**with_prefix(v, PERSONAL), ALPHA: torch.tensor(alpha)}, x, y)
    for (k, t), g in zip(w.items(), g_w, strict=True):
        torch.testing.assert_close(after[k], t - lr * g)
        torch.testing.assert_close(after[f"{PERSONAL}.{k}"], v[k] - lr * alpha * g_bar[k])
    assert float(after[ALPHA]) == pytest.approx(alpha - alpha_lr * alpha_grad, rel=1e-5)
    # the projection: a step past either end stops there (from the same point: _step moved the
    # model's parameters)
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(w[k])
    far = SGDGroups(lr, groups=(EntryGroup(f"{PERSONAL}.", weight_decay=0.0),
                                EntryGroup(ALPHA, lr=1e4, bounds=(0.0, 1.0))))
    end = float(_step(MixtureObjective({}, {}), model, far,
                      {**with_prefix(v, PERSONAL), ALPHA: torch.tensor(alpha)}, x, y)[ALPHA])
    assert end == (0.0 if alpha_grad > 0 else 1.0)


def _inner_step_(envelope: MoreauEnvelope, theta: torch.Tensor, lr: float) -> None:
    """One of pFedMe's inner steps as a local run takes it: the envelope's correction on the
    gradient, then plain SGD."""
    with torch.no_grad():
        envelope.apply_([theta.grad], [theta], ["t"])
        theta.add_(theta.grad, alpha=-lr)


def test_pfedme_inner_and_outer_steps_by_hand():
    theta = _param([1.0], grad=[0.5])
    envelope = MoreauEnvelope({"t": torch.tensor([0.0])}, mu=2.0, lr=0.1)
    _inner_step_(envelope, theta, lr=0.1)
    torch.testing.assert_close(theta.detach(), torch.tensor([0.75]))  # 1 - 0.1 (0.5 + 2 * 1)
    w = torch.tensor([1.0])
    pfedme_outer_step_([w], [torch.tensor([0.5])], lam=2.0, lr=0.1)
    torch.testing.assert_close(w, torch.tensor([0.9]))  # 1 - 0.1 * 2 * (1 - 0.5)
    # the envelope moves its own anchor so after a batch: w <- w - lr lam (w - theta)
    envelope = MoreauEnvelope({"t": torch.tensor([1.0])}, mu=2.0, lr=0.1)
    envelope.end_batch_([torch.tensor([0.5])], ["t"])
    torch.testing.assert_close(envelope.anchor["t"], torch.tensor([0.9]))
    assert envelope.moves and not Proximal({}, 1.0).moves


def test_pfedme_inner_steps_converge_to_the_moreau_proximal_point():
    # f(theta) = 1/2 ||theta - a||^2: argmin f + lam/2 ||theta - w||^2 = (a + lam w) / (1 + lam)
    a, w, lam = torch.tensor([3.0, -1.0]), torch.tensor([0.0, 1.0]), 4.0
    theta = w.clone().requires_grad_(True)
    envelope = MoreauEnvelope({"t": w}, mu=lam, lr=0.0)
    for _ in range(200):
        theta.grad = theta.detach() - a
        _inner_step_(envelope, theta, lr=0.1)
    torch.testing.assert_close(theta.detach(), (a + lam * w) / (1 + lam))


def test_pfedme_server_mixing():
    np.testing.assert_allclose(pfedme_server_update(np.array([0.0, 4.0]), np.array([2.0, 0.0]),
                                                    beta=1.0), [2.0, 0.0])
    np.testing.assert_allclose(pfedme_server_update(np.array([0.0, 4.0]), np.array([2.0, 0.0]),
                                                    beta=0.5), [1.0, 2.0])


def test_ala_merge_and_weight_step_by_hand():
    local, global_ = [torch.tensor([0.0, 2.0])], [torch.tensor([1.0, 0.0])]
    weights = torch.tensor([1.0, 0.5], requires_grad=True)
    torch.testing.assert_close(ala_merge(local, global_, [weights])[0], torch.tensor([1.0, 1.0]))
    optimizer = ala_weight_rule(0.1).build([weights], [f"{WEIGHTS}.t"])

    def step(grad: list[float]) -> None:
        weights.grad = torch.tensor(grad)
        optimizer.step()

    step([2.0, -0.5])  # W - eta dL/dW = [1 - 0.1 * 2, 0.5 - 0.1 * (-0.5)]
    torch.testing.assert_close(weights.detach(), torch.tensor([0.8, 0.55]))
    step([-100.0, -100.0])
    torch.testing.assert_close(weights.detach(), torch.tensor([1.0, 1.0]))  # clipped into [0, 1]
    step([100.0, 100.0])
    torch.testing.assert_close(weights.detach(), torch.tensor([0.0, 0.0]))


def test_ala_weight_gradient_is_the_chain_rule_through_the_merge():
    """eq. 5: dL/dW = grad_theta_hat * (Theta - theta_i)."""
    gen = torch.Generator().manual_seed(2)
    local, global_, target = (torch.randn(4, generator=gen) for _ in range(3))
    w = torch.rand(4, generator=gen).requires_grad_(True)
    merged = ala_merge([local], [global_], [w])[0]
    ((merged - target) ** 2).sum().backward()
    torch.testing.assert_close(w.grad, 2 * (merged.detach() - target) * (global_ - local))


def test_ala_stopping_rule():
    assert not ala_converged([1.0, 1.0], window=3, threshold=0.1)
    assert ala_converged([5.0, 1.0, 1.01, 0.99], window=3, threshold=0.1)
    assert not ala_converged([1.0, 2.0, 1.0], window=3, threshold=0.1)
