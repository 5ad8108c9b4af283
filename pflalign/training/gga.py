"""GGA: gradient-guided annealing (docs/algorithms.md 3), usable in any PyTorch loop.

Early in training, GGA searches around the current parameters for a point where the gradients of
different domains agree (the minimum pairwise cosine of the per-domain gradients rises) while the
loss stays within a tolerance, then continues training from there.

* :func:`gga_anneal` is one annealing step (3.2 steps 1-5) over a list of per-domain batches;
  :class:`GGA` applies it on the steps of a window ``[start_step, end_step]`` (3.3).
* :func:`gga_l_gradients_` is GGA-L (3.5): gradient noise scaled by the domains' disagreement.
* :func:`min_pairwise_cosine` and :func:`domain_gradients` are the shared pieces, also used by the
  federated warm start (4.3 item 1), where the domains are clients.

The loss over all domains is the sample-weighted mean of the per-domain losses, which equals the
loss on the concatenated batch for models whose forward pass treats samples independently (no
batch norm in train mode); this saves a forward pass per candidate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pflalign.settings.schema import GGA_OBJECTIVES
from pflalign.training.loops import task_loss

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
PROPOSALS = ("walk", "anchor")
GGA_L_NOISE = ("normal", "uniform")


def _params(model: nn.Module, params: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
    return list(params) if params is not None else [p for p in model.parameters()
                                                    if p.requires_grad]


def domain_gradients(model: nn.Module, batches: Sequence[Batch],
                     params: Sequence[torch.Tensor] | None = None,
                     loss_fn: LossFn = task_loss) -> tuple[list[torch.Tensor], float]:
    """Each domain's flattened loss gradient over ``params`` (default: every trainable
    parameter), and the sample-weighted mean loss over all domains (3.2 step 2)."""
    params = _params(model, params)
    grads, total, count = [], 0.0, 0
    for x, y in batches:
        loss = loss_fn(model(x), y)
        parts = torch.autograd.grad(loss, params, allow_unused=True)
        grads.append(torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                                for g, p in zip(parts, params, strict=True)]))
        total += float(loss.detach()) * len(y)
        count += len(y)
    return grads, total / max(count, 1)


def pairwise_cosines(vectors: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """The cosines of every pair ``d < d'`` of vectors (float64); a zero vector has cosine 0
    with any other. Needs at least two vectors."""
    stacked = torch.stack(list(vectors)) if not isinstance(vectors, torch.Tensor) else vectors
    if len(stacked) < 2:
        raise ValueError("Pairwise cosines need at least two domains' gradients.")
    stacked = stacked.double()
    norms = stacked.norm(dim=1, keepdim=True)
    unit = stacked / torch.where(norms > 0, norms, torch.ones_like(norms))
    upper = torch.triu_indices(len(stacked), len(stacked), offset=1)
    return (unit @ unit.T)[upper[0], upper[1]]


def min_pairwise_cosine(vectors: Sequence[torch.Tensor] | torch.Tensor) -> float:
    """``min_{d < d'} cos(G_d, G_d')`` (3.2 step 3)."""
    return float(pairwise_cosines(vectors).min())


def mean_pairwise_cosine(vectors: Sequence[torch.Tensor] | torch.Tensor) -> float:
    """The mean of the pairwise cosines (GGA-L's agreement, 3.5)."""
    return float(pairwise_cosines(vectors).mean())


@dataclass(frozen=True)
class AnnealResult:
    """What one annealing step did: candidates tried and accepted, alignment and loss before
    (at the anchor) and after (at the chosen point)."""

    candidates: int
    accepted: int
    cosine_before: float
    cosine_after: float
    loss_before: float
    loss_after: float


def gga_anneal(model: nn.Module, batches: Sequence[Batch], *, rho: float = 1e-5,
               candidates: int = 250, loss_tolerance: float = 0.1, proposal: str = "walk",
               perturb: Sequence[torch.Tensor] | None = None,
               generator: torch.Generator | None = None,
               loss_fn: LossFn = task_loss) -> AnnealResult:
    """One GGA annealing step in place on ``model`` (docs/algorithms.md 3.2 steps 1-5).

    From the anchor ``theta_0``: ``candidates`` times, perturb the ``perturb`` parameters (default:
    all trainable; the reference perturbs the featurizer only, i.e. all but the classifier) by
    ``U(-rho, rho)`` noise, recompute the per-domain gradients (over all trainable parameters),
    their minimum pairwise cosine ``s`` and the loss ``L``, and accept when ``L - L* <
    loss_tolerance`` and ``s > s*`` (strict), ``L*`` and ``s*`` being the best accepted so far
    (the anchor's at first). ``proposal="walk"`` is the reference behaviour: perturbations
    accumulate until an acceptance, then restart from the anchor. ``proposal="anchor"`` is the
    cleaner variant 3.3 marks as an interpretation: every candidate is ``theta_0 + eps``. The model
    ends at the best accepted point (the anchor when none was accepted). ``batches`` holds one
    ``(x, y)`` batch per domain (at least two). Forward passes run in the model's current mode.
    """
    if len(batches) < 2:
        raise ValueError("gga_anneal needs batches from at least two domains.")
    if proposal not in PROPOSALS:
        raise ValueError(f"gga_anneal: proposal must be one of {PROPOSALS}, got {proposal!r}.")
    if not rho > 0 or candidates < 1:
        raise ValueError(f"gga_anneal: need rho > 0 and candidates >= 1, got {rho}, "
                         f"{candidates}.")
    moved = _params(model, perturb)
    grads, loss = domain_gradients(model, batches, loss_fn=loss_fn)
    best_cos = first_cos = min_pairwise_cosine(grads)
    best_loss = first_loss = loss
    with torch.no_grad():
        anchor = [p.detach().clone() for p in moved]
        best = anchor
    accepted = 0
    for _ in range(candidates):
        with torch.no_grad():
            if proposal == "anchor":
                torch._foreach_copy_(moved, anchor)
            noise = [(torch.rand(p.shape, generator=generator, dtype=p.dtype,
                                 device=generator.device if generator is not None else p.device)
                      .to(p.device) * 2 - 1) * rho for p in moved]
            torch._foreach_add_(moved, noise)
        grads, loss = domain_gradients(model, batches, loss_fn=loss_fn)
        cos = min_pairwise_cosine(grads)
        if loss - best_loss < loss_tolerance and cos > best_cos:
            accepted += 1
            best_cos, best_loss = cos, loss
            with torch.no_grad():
                best = [p.detach().clone() for p in moved]
                torch._foreach_copy_(moved, anchor)
    with torch.no_grad():
        torch._foreach_copy_(moved, best)
    return AnnealResult(candidates=candidates, accepted=accepted, cosine_before=first_cos,
                        cosine_after=best_cos, loss_before=first_loss, loss_after=best_loss)


class GGA:
    """GGA's schedule (3.3): :meth:`step` anneals on steps ``start_step..end_step`` (inclusive)
    and does nothing outside; the caller then takes its usual optimizer step.

    Defaults are the reference's (3.4): window 100-200, 250 candidates, rho 1e-5, tolerance 0.1.
    """

    def __init__(self, model: nn.Module, *, start_step: int = 100, end_step: int = 200,
                 candidates: int = 250, rho: float = 1e-5, loss_tolerance: float = 0.1,
                 proposal: str = "walk", perturb: Sequence[torch.Tensor] | None = None,
                 generator: torch.Generator | None = None, loss_fn: LossFn = task_loss):
        if end_step < start_step:
            raise ValueError(f"GGA: end_step {end_step} is before start_step {start_step}.")
        self.model = model
        self.window = (start_step, end_step)
        self.options = dict(rho=rho, candidates=candidates, loss_tolerance=loss_tolerance,
                            proposal=proposal, perturb=perturb, generator=generator,
                            loss_fn=loss_fn)
        self.history: list[AnnealResult] = []

    def step(self, step: int, batches: Sequence[Batch]) -> AnnealResult | None:
        if not self.window[0] <= step <= self.window[1]:
            return None
        result = gga_anneal(self.model, batches, **self.options)
        self.history.append(result)
        return result


def gga_l_gradients_(model: nn.Module, batches: Sequence[Batch], *, gamma: float = 1e-3,
                     noise: str = "normal", generator: torch.Generator | None = None,
                     loss_fn: LossFn = task_loss) -> tuple[float, float]:
    """GGA-L (3.5): set each trainable parameter's ``.grad`` to ``grad L_all + alpha xi`` with
    ``alpha = gamma (1 - mean pairwise cosine of the domain gradients)``; the caller's optimizer
    step then applies it. ``noise="normal"`` is the reference code's ``xi ~ N(0, 1)``;
    ``"uniform"`` is the README's ``U(0, 1)``. Returns ``(alpha, mean cosine)``."""
    if noise not in GGA_L_NOISE:
        raise ValueError(f"gga_l_gradients_: noise must be one of {GGA_L_NOISE}, got {noise!r}.")
    params = _params(model, None)
    grads, _ = domain_gradients(model, batches, params, loss_fn)
    sim = mean_pairwise_cosine(grads)
    alpha = gamma * (1.0 - sim)
    sizes = torch.tensor([len(y) for _, y in batches], dtype=grads[0].dtype)
    total = (torch.stack(grads) * (sizes / sizes.sum())[:, None]).sum(0)  # grad of L_all
    draw = torch.randn if noise == "normal" else torch.rand
    xi = draw(total.numel(), generator=generator, dtype=total.dtype,
              device=generator.device if generator is not None else total.device)
    total = total + alpha * xi.to(total.device)
    offset = 0
    for p in params:
        p.grad = total[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    return alpha, sim


# --- federated annealed warm start (docs/algorithms.md 4.3 item 1; the domains are clients) ---



def candidate_noise(seed: int, server_round: int, candidate: int, numel: int, rho: float,
                    ) -> torch.Tensor:
    """Candidate ``k``'s perturbation ``eps_k ~ U(-rho, rho)^numel`` (float32), regenerated from
    (seed, round, k) alike by the server and every client: only the seed is broadcast."""
    from pflalign.training.loops import make_generator

    gen = make_generator(seed, server_round, candidate, 0x66A)
    return (torch.rand(numel, generator=gen) * 2 - 1) * rho


def count_sketch(vector: torch.Tensor, dim: int, seed: int) -> torch.Tensor:
    """A ``dim``-entry count sketch of ``vector`` (a sparse random projection: each coordinate is
    added with a random sign to one random bucket, both from ``seed``), which preserves inner
    products, hence cosines, in expectation. ``dim = 0`` returns the vector itself."""
    if dim <= 0 or dim >= vector.numel():
        return vector.detach().clone()
    gen = torch.Generator().manual_seed(seed)
    buckets = torch.randint(0, dim, (vector.numel(),), generator=gen)
    signs = torch.randint(0, 2, (vector.numel(),), generator=gen).to(vector.dtype) * 2 - 1
    return torch.zeros(dim, dtype=vector.dtype).index_add_(0, buckets, vector.detach() * signs)


def candidate_statistics(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                         perturb: Sequence[str], *, seed: int, server_round: int,
                         candidates: int, rho: float, sketch_dim: int,
                         loss_fn: LossFn = task_loss,
                         ) -> tuple[list[float], torch.Tensor]:
    """A client's answer to an annealing round: for the anchor (k = 0) and each candidate
    ``theta + eps_k`` (k = 1..K; ``eps_k`` on the named ``perturb`` parameters), its loss on
    the batch ``(x, y)`` and a sketch of its gradient over all trainable parameters. The model is
    left at the anchor. Returns the K+1 losses and a (K+1) x sketch-dim tensor."""
    named = dict(model.named_parameters())
    moved = [named[n] for n in perturb]
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in moved)
    with torch.no_grad():
        anchor = [p.detach().clone() for p in moved]
    losses, sketches = [], []
    for k in range(candidates + 1):
        if k:
            noise = candidate_noise(seed, server_round, k, numel, rho).to(anchor[0].device)
            parts = [part.view_as(p) for part, p in
                     zip(noise.split([p.numel() for p in moved]), moved, strict=True)]
            with torch.no_grad():
                torch._foreach_copy_(moved, anchor)
                torch._foreach_add_(moved, parts)
        loss = loss_fn(model(x), y)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        flat = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).cpu()
                          for g, p in zip(grads, params, strict=True)])
        losses.append(float(loss.detach()))
        sketches.append(count_sketch(flat, sketch_dim, seed * 1_000_003 + server_round))
    with torch.no_grad():
        torch._foreach_copy_(moved, anchor)
    return losses, torch.stack(sketches)


def choose_candidate(losses: Sequence[Sequence[float]], sketches: Sequence[torch.Tensor],
                     weights: Sequence[float], loss_tolerance: float, objective: str = "min",
                     ) -> tuple[int, list[float], list[float]]:
    """The server's acceptance (4.3 item 1): per candidate k, the clients' alignment ``s_k``
    (min, or mean, pairwise cosine of their gradient sketches) and the sample-weighted mean loss
    ``L_k``; the chosen candidate maximises ``s_k`` among those with ``s_k > s_0`` and
    ``L_k - L_0 < loss_tolerance`` (0, the anchor, when none qualifies). ``losses[i][k]`` and
    ``sketches[i][k]`` are client i's. Returns (k*, s, L)."""
    if objective not in GGA_OBJECTIVES:
        raise ValueError(f"choose_candidate: objective must be one of {GGA_OBJECTIVES}.")
    if len(sketches) < 2:
        raise ValueError("choose_candidate needs at least two clients' sketches.")
    agree = min_pairwise_cosine if objective == "min" else mean_pairwise_cosine
    count = len(losses[0])
    w = torch.tensor(weights, dtype=torch.float64)
    w = w / w.sum()
    scores = [agree([s[k] for s in sketches]) for k in range(count)]
    mean_loss = [float((torch.tensor([row[k] for row in losses], dtype=torch.float64) * w).sum())
                 for k in range(count)]
    best = 0
    for k in range(1, count):
        if (scores[k] > scores[0] and mean_loss[k] - mean_loss[0] < loss_tolerance
                and scores[k] > scores[best]):
            best = k
    return best, scores, mean_loss


def apply_candidate(state: dict, perturb: Sequence[str], *, seed: int, server_round: int,
                    candidate: int, rho: float) -> dict:
    """``state`` (NumPy arrays) with candidate ``k``'s perturbation added to the ``perturb``
    entries: the same float32 sums the clients computed (k = 0 returns ``state``)."""
    if candidate == 0:
        return state
    sizes = [int(np.prod(state[n].shape)) for n in perturb]
    noise = candidate_noise(seed, server_round, candidate, sum(sizes), rho).numpy()
    out = dict(state)
    start = 0
    for name, size in zip(perturb, sizes, strict=True):
        out[name] = (state[name] + noise[start:start + size].reshape(state[name].shape)).astype(
            state[name].dtype)
        start += size
    return out
