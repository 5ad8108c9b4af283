"""The optimizers' functional cores: the stacked form (a cohort, one client per row) equals the
per-client form that the optimizer classes run.

Element-wise kernels give every row the bits its own call gives it, so most comparisons are exact.
Two places may round differently, and the tests bound them: ``erf`` (pFLAlign's adaptive gamma) and
``tanh`` (GENIE's gate) are computed by vectorised kernels whose last bit depends on where an
element falls in a SIMD register, which stacking moves; and a per-client step count T scales a
stacked correction by a tensor rather than by a number.
"""

from __future__ import annotations

import pytest
import torch

from pflalign.training.optim import (
    GAMMA_MODES,
    GENIE,
    GenieBuffers,
    PFLAlign,
    genie_update,
    pflalign_update,
)
from pflalign.training.optim.pflalign import hyperparameters

SHAPES = [(6, 5), (7,), (3, 2, 4)]
CLIENTS = 3
#: erf's vectorised kernels: at most a few units in the last place of a step
ERF_RTOL, ERF_ATOL = 1e-6, 1e-7


def _tensors(seed: int, scale: float = 1.0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[scale * torch.randn(s, generator=g) for s in SHAPES] for _ in range(CLIENTS)]


def _stack(per_client: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [torch.stack([client[j] for client in per_client]) for j in range(len(SHAPES))]


def _pflalign_alone(gamma: str, steps: list[int], offsets, grads) -> tuple[list, list]:
    """Each client's parameters and mean gamma after its own PFLAlign steps."""
    params, gammas = [], []
    for i in range(CLIENTS):
        ps = [t.clone().requires_grad_(True) for t in _tensors(1)[i]]
        opt = PFLAlign(ps, lr=2.0, gamma=gamma)
        opt.begin_round([o.clone() for o in offsets[i]], steps[i])
        for step in grads:
            for p, g in zip(ps, step[i], strict=True):
                p.grad = g.clone()
            opt.step()
        params.append([p.detach() for p in ps])
        gammas.append(opt.mean_gamma())
    return params, gammas


def _pflalign_stacked(gamma: str, steps: list[int], offsets, grads) -> tuple[list, list]:
    params = _stack(_tensors(1))
    m, v, P = ([torch.zeros_like(p) for p in params] for _ in range(3))
    deltas = _stack(offsets)
    signs = [torch.sign(d) for d in deltas]
    num_steps = steps[0] if len(set(steps)) == 1 else torch.tensor(steps)
    total = torch.zeros(CLIENTS, dtype=torch.float64)
    count = 0
    for step in grads:
        gamma_sum, count = pflalign_update(
            params, _stack(step), m, v, P, deltas, signs, num_steps=num_steps, stacked=True,
            **hyperparameters(dict(lr=2.0, beta=0.9, eps=1e-12, precondition=True, gamma=gamma)))
        total += torch.as_tensor(gamma_sum, dtype=torch.float64)
    return params, (total / (count * len(grads))).tolist()


@pytest.mark.parametrize("gamma", GAMMA_MODES)
@pytest.mark.parametrize("steps", [[4, 4, 4], [3, 4, 6]])
def test_stacked_pflalign_update_equals_each_clients_optimizer(gamma, steps):
    offsets, grads = _tensors(2, 0.1), [_tensors(10 + k) for k in range(4)]
    alone, alone_gamma = _pflalign_alone(gamma, steps, offsets, grads)
    stacked, stacked_gamma = _pflalign_stacked(gamma, steps, offsets, grads)
    exact = gamma != "adaptive" and len(set(steps)) == 1
    for i in range(CLIENTS):
        for a, b in zip(alone[i], stacked, strict=True):
            if exact:
                assert torch.equal(b[i], a)
            else:
                torch.testing.assert_close(b[i], a, rtol=ERF_RTOL, atol=ERF_ATOL)
        assert stacked_gamma[i] == pytest.approx(alone_gamma[i], rel=1e-6)


def test_stacked_pflalign_update_without_offsets_is_exact():
    grads = [_tensors(20 + k) for k in range(3)]
    params = _stack(_tensors(1))
    m, v, P = ([torch.zeros_like(p) for p in params] for _ in range(3))
    none = [None] * len(SHAPES)
    for step in grads:
        gamma_sum, _ = pflalign_update(params, _stack(step), m, v, P, none, none, lr=2.0,
                                       beta=0.9, eps=1e-12, precondition=True,
                                       gamma="adaptive", num_steps=3, stacked=True)
    assert gamma_sum == 0.5 * sum(torch.Size(s).numel() for s in SHAPES)
    for i in range(CLIENTS):
        ps = [t.clone().requires_grad_(True) for t in _tensors(1)[i]]
        opt = PFLAlign(ps, lr=2.0)
        opt.begin_round(None, 3)
        for step in grads:
            for p, g in zip(ps, step[i], strict=True):
                p.grad = g.clone()
            opt.step()
        assert all(torch.equal(b[i], p.detach()) for b, p in zip(params, ps, strict=True))


@pytest.mark.parametrize("options", [
    dict(precondition=True, noise=True, mask=True, weight_decay=0.01),
    dict(precondition=False, noise=True, mask=False, weight_decay=0.0),
])
def test_stacked_genie_update_equals_each_clients_optimizer(options):
    """Gradients of two scales, so that some tensors open GENIE's gate (noise) and others keep
    it shut; each client draws its mask and noise from its own generator."""
    options = dict(lr=0.3, moving_avg=0.95, p=0.4, **options)
    grads = [[[g * (0.05 if k % 2 else 4.0) for g in client] for client in _tensors(30 + k)]
             for k in range(6)]
    alone = []
    for i in range(CLIENTS):
        ps = [t.clone().requires_grad_(True) for t in _tensors(1)[i]]
        opt = GENIE(ps, generator=torch.Generator().manual_seed(100 + i), **options)
        for step in grads:
            for p, g in zip(ps, step[i], strict=True):
                p.grad = g.clone()
            opt.step()
        alone.append([p.detach() for p in ps])
    params = _stack(_tensors(1))
    zeros = [torch.zeros_like(p) for p in params]
    buffers = GenieBuffers(params, zeros, zeros, torch.device("cpu"), stacked=True)
    generators = [torch.Generator().manual_seed(100 + i) for i in range(CLIENTS)]
    for k, step in enumerate(grads):
        genie_update(buffers, params, _stack(step), step=k + 1, generators=generators, **options)
    for i in range(CLIENTS):
        for a, b in zip(alone[i], params, strict=True):
            # tanh and the per-client reductions of the noise scale round per kernel
            torch.testing.assert_close(b[i], a, rtol=1e-6, atol=1e-7)


def _steps(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], grads) -> None:
    for step in grads:
        for p, g in zip(params, step[0], strict=True):
            p.grad = g.clone()
        optimizer.step()


@pytest.mark.parametrize(("gamma", "with_offsets"),
                         [("adaptive", True), ("hard", True), ("adaptive", False)])
def test_a_clients_pflalign_rule_is_its_stacked_form_for_one_and_equals_the_class(gamma,
                                                                                  with_offsets):
    """The per-client executor steps a stateful rule as a cohort of one (one implementation per
    optimizer, :class:`~pflalign.training.optimizers.CohortOfOne`): bit for bit the torch.optim
    class on one client, and the outcome carries the class's v, P and mean P."""
    from pflalign.methods.pflalign import PFLAlignRule

    grads = [_tensors(70 + k) for k in range(4)]
    offsets = _tensors(9, scale=0.1)[0]
    names = [f"w{j}" for j in range(len(SHAPES))]
    alone = [t.clone().requires_grad_(True) for t in _tensors(1)[0]]
    reference = PFLAlign(alone, lr=2.0, beta=0.9, eps=1e-12, precondition=True, gamma=gamma)
    reference.begin_round([o.clone() for o in offsets] if with_offsets else None, 4)
    _steps(reference, alone, grads)
    ours = [t.clone().requires_grad_(True) for t in _tensors(1)[0]]
    rule = PFLAlignRule(lr=2.0, beta=0.9, eps=1e-12, precondition=True, gamma=gamma,
                        num_steps=4, offsets=dict(zip(names, offsets, strict=True))
                        if with_offsets else None)
    optimizer = rule.build(ours, names, torch.Generator())
    _steps(optimizer, ours, grads)
    assert all(torch.equal(a, b) for a, b in zip(alone, ours, strict=True))
    outcome = rule.outcome(optimizer, names)
    for name, p in zip(names, alone, strict=True):
        assert torch.equal(outcome.state[f"{name}.v"], reference.state[p]["v"])
        assert torch.equal(outcome.state[f"{name}.P"], reference.state[p]["P"])
    assert outcome.mean_p == reference.mean_preconditioner()
    assert outcome.mean_gamma == reference.mean_gamma()


def test_a_clients_genie_rules_are_their_stacked_form_for_one_and_equal_the_class():
    from pflalign.run.config import build_settings
    from pflalign.training.optimizers import LocalOptimizer, PersistentGenie

    training = build_settings({"methods": "fedavg", "local-optimizer": "genie"}).training
    grads = [[[g * (0.05 if k % 2 else 4.0) for g in client] for client in _tensors(40 + k)]
             for k in range(5)]
    names = [f"w{j}" for j in range(len(SHAPES))]
    alone = [t.clone().requires_grad_(True) for t in _tensors(1)[0]]
    reference = GENIE(alone, generator=torch.Generator().manual_seed(5),
                      **training.genie_options())
    _steps(reference, alone, grads)
    for rule in (LocalOptimizer(training), PersistentGenie(training)):
        ours = [t.clone().requires_grad_(True) for t in _tensors(1)[0]]
        optimizer = rule.build(ours, names, torch.Generator().manual_seed(5))
        _steps(optimizer, ours, grads)
        assert all(torch.equal(a, b) for a, b in zip(alone, ours, strict=True)), rule
    state = rule.outcome(optimizer, names)  # the persistent rule's: GENIE's m, s and steps
    for name, p in zip(names, alone, strict=True):
        assert torch.equal(state[f"{name}.m"], reference.state[p]["m"])
        assert torch.equal(state[f"{name}.s"], reference.state[p]["s"])
        assert int(state[f"{name}.step"]) == reference.state[p]["step"] == 5
