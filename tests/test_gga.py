"""GGA (docs/algorithms.md 3): the acceptance rule, the window, GGA-L, on small constructed
problems."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pflalign.training.gga import (
    GGA,
    domain_gradients,
    gga_anneal,
    gga_l_gradients_,
    mean_pairwise_cosine,
    min_pairwise_cosine,
)


def _conflicting_domains(seed: int = 0):
    """Two domains whose labels depend on the features in opposite ways: their gradients
    conflict at a random initialisation."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 4, generator=gen)
    y_a = (x[:, 0] > 0).long()
    y_b = (x[:, 0] + 2 * x[:, 1] < 0).long()
    return [(x[:32], y_a[:32]), (x[32:], y_b[32:])]


def _model(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def test_min_and_mean_pairwise_cosine_by_hand():
    vectors = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0])]
    assert min_pairwise_cosine(vectors) == pytest.approx(0.0)
    assert mean_pairwise_cosine(vectors) == pytest.approx((0 + 2 * 2 ** -0.5) / 3)
    assert min_pairwise_cosine([torch.tensor([1.0, 0.0]), torch.tensor([-2.0, 0.0])]) == -1.0
    with pytest.raises(ValueError):
        min_pairwise_cosine([torch.ones(3)])


def test_annealing_raises_the_alignment_of_conflicting_domains():
    batches = _conflicting_domains()
    model = _model()
    before, _ = domain_gradients(model, batches)
    result = gga_anneal(model, batches, rho=0.05, candidates=60,
                        generator=torch.Generator().manual_seed(3))
    after, loss = domain_gradients(model, batches)
    assert result.accepted >= 1
    assert result.cosine_before == pytest.approx(min_pairwise_cosine(before))
    assert result.cosine_after == pytest.approx(min_pairwise_cosine(after))  # model is there
    assert result.cosine_after > result.cosine_before
    assert result.loss_after == pytest.approx(loss)
    assert result.loss_after - result.loss_before < result.accepted * 0.1


@pytest.mark.parametrize("proposal", ["walk", "anchor"])
def test_nothing_is_accepted_beyond_the_loss_tolerance_and_the_model_returns_to_the_anchor(
        proposal):
    batches = _conflicting_domains()
    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    result = gga_anneal(model, batches, rho=0.05, candidates=20, loss_tolerance=-1.0,
                        proposal=proposal, generator=torch.Generator().manual_seed(3))
    assert result.accepted == 0 and result.cosine_after == result.cosine_before
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), start, strict=True))


def test_acceptance_needs_a_strictly_higher_minimum_cosine():
    batches = _conflicting_domains()
    model = _model()
    cosines = []
    original = min_pairwise_cosine

    def spy(vectors):
        value = original(vectors)
        cosines.append(value)
        return value

    import pflalign.training.gga as gga

    gga.min_pairwise_cosine = spy
    try:
        result = gga_anneal(model, batches, rho=0.05, candidates=30, loss_tolerance=100.0,
                            proposal="anchor", generator=torch.Generator().manual_seed(5))
    finally:
        gga.min_pairwise_cosine = original
    running, accepted = cosines[0], 0
    for value in cosines[1:]:  # with an unbounded tolerance, accepted iff s > s* so far
        if value > running:
            running, accepted = value, accepted + 1
    assert (result.accepted, result.cosine_after) == (accepted, running)


def test_perturbation_is_confined_to_the_given_parameters():
    batches = _conflicting_domains()
    model = _model()
    head = list(model[2].parameters())
    head_before = [p.detach().clone() for p in head]
    gga_anneal(model, batches, rho=0.05, candidates=40, perturb=list(model[0].parameters()),
               generator=torch.Generator().manual_seed(3))
    assert all(torch.equal(a, b) for a, b in zip(head, head_before, strict=True))


def test_schedule_anneals_only_inside_its_window_and_is_seeded():
    batches = _conflicting_domains()
    runs = []
    for _ in range(2):
        model = _model()
        gga = GGA(model, start_step=2, end_step=3, candidates=10, rho=0.05,
                  generator=torch.Generator().manual_seed(8))
        results = [gga.step(t, batches) for t in range(5)]
        assert [r is not None for r in results] == [False, False, True, True, False]
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_gga_l_noise_scales_with_disagreement():
    batches = _conflicting_domains()
    model = _model()
    grads, _ = domain_gradients(model, batches)
    alpha, sim = gga_l_gradients_(model, batches, gamma=0.5,
                                  generator=torch.Generator().manual_seed(0))
    assert sim == pytest.approx(mean_pairwise_cosine(grads))
    assert alpha == pytest.approx(0.5 * (1 - sim))
    xi = torch.randn(sum(p.numel() for p in model.parameters()),
                     generator=torch.Generator().manual_seed(0))
    full = sum(F.cross_entropy(model(x), y) * len(y) for x, y in batches) / 64
    clean = torch.cat([g.reshape(-1) for g in torch.autograd.grad(full, list(
        model.parameters()))])
    noisy = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(noisy, clean + alpha * xi, rtol=1e-5, atol=1e-6)
    # identical domains agree perfectly: no noise
    same = [batches[0], batches[0]]
    alpha_same, sim_same = gga_l_gradients_(model, same, gamma=0.5)
    assert sim_same == pytest.approx(1.0) and alpha_same == pytest.approx(0.0, abs=1e-7)


# --- federated warm start pieces ---------------------------------------------------------------
def test_count_sketch_preserves_cosines_roughly_and_is_seeded():
    from pflalign.training.gga import count_sketch

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(20_000, generator=gen)
    b = 0.6 * a + 0.8 * torch.randn(20_000, generator=gen)
    exact = float(F.cosine_similarity(a, b, dim=0))
    sa, sb = count_sketch(a, 1024, seed=3), count_sketch(b, 1024, seed=3)
    assert float(F.cosine_similarity(sa, sb, dim=0)) == pytest.approx(exact, abs=0.1)
    assert torch.equal(sa, count_sketch(a, 1024, seed=3))
    assert torch.equal(count_sketch(a, 0, seed=3), a)


def test_candidate_statistics_and_server_application_agree():
    import numpy as np

    from pflalign.training.gga import apply_candidate, candidate_statistics

    (x, y), _ = _conflicting_domains()
    model = _model()
    perturb = ["0.weight", "0.bias"]
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    losses, sketches = candidate_statistics(model, x, y, perturb, seed=1, server_round=2,
                                            candidates=3, rho=0.05, sketch_dim=0)
    assert len(losses) == 4 and sketches.shape == (4, sum(p.numel() for p in model.parameters()))
    assert all(torch.equal(v, start[k]) for k, v in model.state_dict().items())  # back at anchor
    assert losses[0] == pytest.approx(float(F.cross_entropy(model(x), y).detach()))
    moved = apply_candidate({k: v.numpy() for k, v in start.items()}, perturb, seed=1,
                            server_round=2, candidate=2, rho=0.05)
    assert np.array_equal(moved["2.weight"], start["2.weight"].numpy())  # classifier untouched
    assert 0 < np.abs(moved["0.weight"] - start["0.weight"].numpy()).max() <= 0.05
    model.load_state_dict({k: torch.from_numpy(v) for k, v in moved.items()})
    again, grads = candidate_statistics(model, x, y, perturb, seed=1, server_round=9,
                                        candidates=0, rho=0.05, sketch_dim=0)
    assert again[0] == pytest.approx(losses[2], rel=1e-6)  # the client scored this very point
    torch.testing.assert_close(grads[0], sketches[2], rtol=1e-5, atol=1e-7)


def test_choose_candidate_takes_the_best_aligned_within_tolerance():
    from pflalign.training.gga import choose_candidate

    e = torch.eye(3)
    # candidate 0: clients orthogonal; 1: aligned but loss +1; 2: fairly aligned; 3: aligned
    sketches = [torch.stack([e[0], e[0], e[0] + e[1], e[0]]),
                torch.stack([e[1], e[0], e[0], e[0] + 0.1 * e[2]])]
    losses = [[1.0, 2.0, 1.0, 1.05], [1.0, 2.0, 1.0, 1.05]]
    best, scores, mean_loss = choose_candidate(losses, sketches, [1, 1], loss_tolerance=0.1)
    assert best == 3 and scores[1] == pytest.approx(1.0) and mean_loss[1] == 2.0
    assert choose_candidate(losses, sketches, [1, 1], loss_tolerance=0.01)[0] == 2
    assert choose_candidate(losses, [sketches[0], sketches[0]], [1, 1], 0.1)[0] == 0  # no gain
