"""Seeded local training and evaluation loops, shared by every method."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pflalign.data.datasets import IGNORE_INDEX, Normalizer

T = TypeVar("T")

# Independent random streams derived from (seed, round, client, stream).
STREAM_TRAIN = 1
STREAM_FINETUNE = 2
STREAM_PERSONAL = 3  # a second local model (Ditto's personal model, APFL's mixture)
STREAM_ADAPT = 4  # a method's own adaptation data (FedALA's random subset)
STREAM_OPTIMIZER = 5  # an optimizer's own randomness (GENIE's mask and noise), per training stream
STREAM_GGA = 6  # the batch a client scores the annealing candidates on
STREAM_DROPOUT = 7  # a model's dropout masks (torch's global generator, seeded per local run)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integer parts (e.g. seed, round, client id, stream), order-sensitive."""
    state = np.random.SeedSequence([int(p) for p in parts]).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def make_generator(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(*parts))


def configure_threads(num_cpus: float) -> int:
    """Give torch as many intra-op threads as the client has CPU cores (at least one)."""
    threads = max(1, int(num_cpus))
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


def pick_device(num_gpus: float) -> torch.device:
    """``cuda`` when the client was given a GPU share and one exists, else ``cpu``."""
    return torch.device("cuda" if num_gpus > 0 and torch.cuda.is_available() else "cpu")


def num_local_steps(num_samples: int, batch_size: int, epochs: int, max_steps: int = 0) -> int:
    """Optimizer steps in one local round: ``ceil(n / B) * E``, capped by ``max_steps`` if > 0."""
    steps = math.ceil(num_samples / batch_size) * epochs
    return min(steps, max_steps) if max_steps > 0 else steps


@dataclass(frozen=True)
class TrainStats:
    """Mean training loss over the samples seen, and how many steps and samples that was;
    ``metrics``: a run objective's diagnostics, each its mean over the samples seen."""

    loss: float
    steps: int
    samples: int
    metrics: Mapping[str, float] = field(default_factory=dict)


#: a batch's (objective to differentiate, reported loss, diagnostics), from (inputs, targets)
StepLoss = Callable[[torch.Tensor, torch.Tensor],
                    tuple[torch.Tensor, torch.Tensor, Mapping[str, torch.Tensor]]]


@dataclass(frozen=True)
class EvalStats:
    correct: int
    loss_sum: float
    count: int
    #: what was scored (a module, or a model's state dict), for ``save-models``; never compared
    scored: object = field(default=None, compare=False, repr=False)
    #: the scores beyond accuracy that ``eval-metrics`` asks for (:mod:`~pflalign.training.scores`)
    scores: dict = field(default_factory=dict, compare=False)
    #: attack = backdoor: (hits, tried) of the trigger on the test split
    #: (:func:`~pflalign.training.backdoor.success_counts`)
    backdoor: tuple[int, int] | None = field(default=None, compare=False)


def batch_indices(num_samples: int, batch_size: int, epochs: int, max_steps: int,
                  generator: torch.Generator, device: torch.device | str = "cpu",
                  ) -> Iterator[torch.Tensor]:
    """Index batches of shuffled epochs: exactly :func:`num_local_steps` of them (the last batch
    of an epoch may be smaller). Shuffling uses ``generator`` only, so the same generator seed
    gives the same batches."""
    total = num_local_steps(num_samples, batch_size, epochs, max_steps)
    steps = 0
    while steps < total:
        order = torch.randperm(num_samples, generator=generator).to(device)
        for start in range(0, num_samples, batch_size):
            if steps == total:
                return
            yield order[start:start + batch_size]
            steps += 1


def grouped(order: Iterable[torch.Tensor], size: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """The batches of ``order`` in consecutive groups of ``size`` (a step that takes several
    batches: Per-FedAvg's pair ``D``, ``D'``); a shorter tail is dropped, and an order of fewer
    than ``size`` batches gives one group of its first batch repeated."""
    batches = list(order)
    groups = [tuple(batches[i:i + size]) for i in range(0, len(batches) - size + 1, size)]
    if not groups and batches:
        groups = [(batches[0],) * size]
    return iter(groups)


def stopping(order: Iterable[T], per_epoch: int, until: Callable[[list[float]], bool],
             losses: list[torch.Tensor]) -> Iterator[T]:
    """``order``, cut at the end of the first epoch (``per_epoch`` batches) after which
    ``until`` says to stop, given the losses recorded so far in ``losses`` (one transfer from
    the device per epoch)."""
    for step, batch in enumerate(order):
        if step and step % per_epoch == 0 and until(torch.stack(losses).tolist()):
            return
        yield batch


def task_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The batch's mean loss: cross-entropy of class logits, or for float targets (``task =
    regression``) the mean squared error of the model's single output."""
    if targets.is_floating_point():
        return F.mse_loss(outputs.squeeze(-1), targets)
    return F.cross_entropy(outputs, targets)


def train_batches(model: nn.Module, x: torch.Tensor, y: torch.Tensor, normalize: Normalizer, *,
                  optimizer: torch.optim.Optimizer, batch_size: int, epochs: int = 1,
                  max_steps: int = 0, generator: torch.Generator,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = task_loss,
                  before_step: Callable[[], None] | None = None, steps_per_batch: int = 1,
                  after_batch: Callable[[], None] | None = None,
                  step_loss: StepLoss | None = None, batches_per_step: int = 1,
                  until: Callable[[list[float]], bool] | None = None) -> TrainStats:
    """Mini-batch training over :func:`batch_indices`: each batch is stepped on
    ``steps_per_batch`` times (pFedMe's inner steps), then ``after_batch`` runs; the loss counted
    for a batch is its last step's, and a batch counts as one step.

    The loss is ``loss_fn(model(inputs), targets)``, or a run objective's (``step_loss``: what
    to differentiate, the loss to report and diagnostics, whose means over the samples come back
    in :attr:`TrainStats.metrics`). ``before_step`` runs between ``backward()`` and
    ``optimizer.step()``: the place where a method adds its gradient correction (FedProx's
    proximal term, SCAFFOLD's control variates). The losses stay on the device until the end.

    With ``batches_per_step`` > 1 a step takes that many consecutive batches (:func:`grouped`):
    ``step_loss`` receives tuples of inputs and targets, and the step counts its first batch's
    samples. ``until``, given the losses of the steps so far, is asked at the end of each epoch
    whether to stop there (the run's :attr:`~pflalign.training.runs.LocalRun.until`).
    """
    model.train()
    loss_sum = torch.zeros((), device=x.device)
    sums: dict[str, torch.Tensor] = {}
    metrics: Mapping[str, torch.Tensor] = {}
    seen = 0
    steps = 0
    order = batch_indices(len(y), batch_size, epochs, max_steps, generator, x.device)
    losses: list[torch.Tensor] = []
    if until is not None:
        order = stopping(order, math.ceil(len(y) / batch_size), until, losses)
    for idx in (order if batches_per_step == 1 else grouped(order, batches_per_step)):
        if batches_per_step == 1:
            inputs, targets = normalize(x[idx]), y[idx]
        else:
            inputs, targets = tuple(normalize(x[i]) for i in idx), tuple(y[i] for i in idx)
            idx = idx[0]
        for _ in range(steps_per_batch):
            if step_loss is None:
                objective = loss = loss_fn(model(inputs), targets)
            else:
                objective, loss, metrics = step_loss(inputs, targets)
            optimizer.zero_grad(set_to_none=True)
            objective.backward()
            if before_step is not None:
                before_step()
            optimizer.step()
        if after_batch is not None:
            after_batch()
        loss_sum += loss.detach() * len(idx)
        if until is not None:
            losses.append(loss.detach())
        for name, value in metrics.items():
            sums[name] = sums.get(name, 0) + value.detach() * len(idx)
        seen += len(idx)
        steps += 1
    return TrainStats(loss=float(loss_sum) / max(seen, 1), steps=steps, samples=seen,
                      metrics={k: float(v) / max(seen, 1) for k, v in sums.items()})


@torch.no_grad()
def head_inputs(model: nn.Module, head: nn.Module, batches: Iterable[torch.Tensor],
                ) -> torch.Tensor:
    """What ``head`` (a layer of ``model``) receives when ``model`` runs on each of ``batches``
    in eval mode, concatenated (the model's mode is restored)."""
    captured: list[torch.Tensor] = []
    hook = head.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    was_training = model.training
    try:
        model.eval()
        for batch in batches:
            model(batch)
    finally:
        hook.remove()
        model.train(was_training)
    return torch.cat(captured)


@torch.inference_mode()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, normalize: Normalizer,
             batch_size: int = 256, scores: Sequence[str] = ()) -> EvalStats:
    """Accuracy counts and summed cross-entropy of ``model`` on (x, y), in eval mode (per
    target: a sample's label, or each token of a language model's window; a target that is
    :data:`~pflalign.data.datasets.IGNORE_INDEX`, an instruction's prompt or padding, is
    neither scored nor counted); with ``scores``, those of
    :func:`~pflalign.training.scores.classification_scores` too, from the same outputs."""
    model.eval()
    correct = 0
    loss_sum = 0.0
    outputs = []
    regression = y.is_floating_point()  # task = regression: squared errors, no classes
    for start in range(0, len(y), batch_size):
        logits = model(normalize(x[start:start + batch_size]))
        targets = y[start:start + batch_size]
        if regression:
            loss_sum += float(((logits.squeeze(-1) - targets) ** 2).sum())
            outputs.append(logits.squeeze(-1))
            continue
        correct += int((logits.argmax(dim=1) == targets).sum())
        loss_sum += float(F.cross_entropy(logits, targets, reduction="sum"))
        if scores:
            outputs.append(logits)
    count = y.numel() if y.dim() == 1 else int((y != IGNORE_INDEX).sum())
    found = {}
    if regression and outputs:
        from pflalign.training.scores import regression_scores

        found = regression_scores(y, torch.cat(outputs))
    elif scores and outputs:
        from pflalign.training.scores import classification_scores

        found = classification_scores(y, torch.cat(outputs), scores)
    return EvalStats(correct=correct, loss_sum=loss_sum, count=count, scores=found)
