"""A local run's own objective: the loss a method trains on when it is not the model's
cross-entropy.

Most methods train the model on its cross-entropy, which is a :class:`~pflalign.training.runs.
LocalRun`'s default. A method whose local objective has more to it (a regularizer on the
features, a second model, modules of its own between the extractor and the head) gives its run an
:class:`Objective`: a frozen dataclass, in the style of the corrections, whose :data:`Entries`
fields are per-client tensors held fixed through the run (a received reference, a conditional
input) and whose other fields are hyperparameters or the structure of the method's own modules.
Its :meth:`Objective.loss` computes one batch's value from

- ``model``, a :class:`ModelCall`: the run's model called functionally on given entries (whole,
  its features only, or its head only);
- ``params``, the model's entries as they are at this step (the trained ones and the fixed);
- ``extras``, the run's extra trained tensors (:attr:`LocalRun.extras`: a personal bias, a
  policy network's parameters), stepped by the run's optimizer together with the model's;
- ``state``, per-run tensors the loss carries from one batch to the next (a running mean), as the
  previous batch left them (:meth:`Objective.initial_state` at first);
- the batch ``x``, ``y`` and ``mask``: None when one client runs alone; under the vectorised
  executor a client's batch is padded to the cohort's longest, and ``mask`` (1 for a sample, 0
  for padding) must weight every mean over the batch (:func:`batch_mean`). For data whose
  targets are masked (instructions: only the response tokens are scored), ``mask`` has the
  targets' shape instead, 1 for a scored target, and :func:`cross_entropy` takes it so.

It returns a :class:`Step`. Both executors run every objective (one client at a time, and a
cohort together under ``torch.func.vmap``), and the losses stay on the device through the run.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from pflalign.models.registry import head_of, without_head
from pflalign.training.corrections import Entries, PerClient


@dataclass(frozen=True)
class Step:
    """One batch's outcome under an objective: ``objective``, what is differentiated; ``loss``,
    the batch's training loss as the run reports it (its mean over the samples seen); ``metrics``,
    diagnostics averaged the same way; ``state``, the per-run tensors for the next batch
    (detached)."""

    objective: torch.Tensor
    loss: torch.Tensor
    metrics: Mapping[str, torch.Tensor] = field(default_factory=dict)
    state: Mapping[str, torch.Tensor] = field(default_factory=dict)


def batch_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean of ``values`` over the batch (dim 0), padding left out by ``mask``."""
    if mask is None:
        return values.mean(dim=0)
    weights = mask.reshape(-1, *([1] * (values.dim() - 1)))
    return (values * weights).sum(dim=0) / mask.sum().clamp_min(1)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor:
    """The batch's mean cross-entropy (a language model's window: its tokens' mean per sample),
    padding left out by ``mask``. A ``mask`` of the targets' shape (masked targets: an
    instruction's response tokens) weights each target: the mean over the scored tokens of the
    batch, as ``F.cross_entropy`` gives it without a mask, skipping the ignored targets.

    Float targets are a regression's (``task = regression``): the loss is then the mean squared
    error of the model's single output, every method's objective unchanged otherwise."""
    if targets.is_floating_point():
        errors = (logits.squeeze(-1) - targets) ** 2
        return errors.mean() if mask is None else batch_mean(errors, mask)
    if mask is None:
        return F.cross_entropy(logits, targets)
    losses = F.cross_entropy(logits, targets, reduction="none")
    if mask.dim() > 1:
        return (losses * mask).sum() / mask.sum().clamp_min(1)
    if losses.dim() > 1:
        losses = losses.flatten(1).mean(dim=1)
    return batch_mean(losses, mask)


def prefixed(entries: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries named ``<prefix>.<name>``, by ``<name>``."""
    start = f"{prefix}."
    return {k[len(start):]: v for k, v in entries.items() if k.startswith(start)}


def with_prefix(entries: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """``entries`` renamed ``<prefix>.<name>`` (a module's state as extra trained tensors)."""
    return {f"{prefix}.{k}": v for k, v in entries.items()}


class ModelCall:
    """The run's model, called functionally on the entries it is given (the others are the
    module's own: buffers the caller does not pass). ``on_features``: the inputs are the head's
    (the per-client executor computed the rest of the model once, for an objective whose
    :meth:`~Objective.changes` are the head's entries only)."""

    def __init__(self, module: nn.Module, on_features: bool = False):
        self.module, self.on_features = module, on_features

    @functools.cached_property
    def _head(self) -> tuple[str, nn.Module]:
        return head_of(self.module)  # only a method that calls the head needs one

    @property
    def head_name(self) -> str:
        return self._head[0]

    @property
    def head_module(self) -> nn.Module:
        return self._head[1]

    def __call__(self, entries: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if self.on_features:
            return self.head(entries, x)
        return functional_call(self.module, dict(entries), (x,))

    def features(self, entries: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """What the head receives: the model with its head replaced by the identity."""
        if self.on_features:
            return x
        with without_head(self.module):
            return functional_call(self.module, dict(entries), (x,))

    def head(self, entries: Mapping[str, torch.Tensor], features: torch.Tensor) -> torch.Tensor:
        """The head on ``features``, with its entries from ``entries`` (by the model's names)."""
        return self.head_with(prefixed(entries, self.head_name), features)

    def head_with(self, own: Mapping[str, torch.Tensor], features: torch.Tensor) -> torch.Tensor:
        """The head on ``features`` with the head's own entries ``own`` (``weight``, ``bias``):
        a second head of the same shape."""
        return functional_call(self.head_module, dict(own), (features,))


class Objective(PerClient):
    """A local run's loss (see the module docstring). Subclasses are frozen dataclasses."""

    def initial_state(self) -> dict[str, torch.Tensor]:
        """The per-run tensors the first batch sees (none by default)."""
        return {}

    def changes(self) -> tuple[str, ...] | None:
        """The model entries the loss computes afresh from the extras at each step, beside the
        run's trained ones (FedALA's merged layers): when those are the head's only, the model's
        body is run once. None (the default): any may change."""
        return None

    def loss(self, model: ModelCall, params: Mapping[str, torch.Tensor], extras: Entries,
             state: Entries, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None,
             ) -> Step:
        raise NotImplementedError


@dataclass(frozen=True)
class CrossEntropy(Objective):
    """The model's cross-entropy: every run's objective when it names none."""

    def loss(self, model: ModelCall, params: Mapping[str, torch.Tensor], extras: Entries,
             state: Entries, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None,
             ) -> Step:
        value = cross_entropy(model(params, x), y, mask)
        return Step(value, value)
