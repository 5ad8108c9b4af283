"""A method's local training, written once: runs of local training that an engine executes.

A client rule (:meth:`~pflalign.methods.base.Method.train`,
:meth:`~pflalign.methods.base.Method.evaluate`) is written once, as a generator. Each ``yield
LocalRun(...)`` hands one stretch of local training to whoever runs the rule and receives its
:class:`RunResult`; what comes before and after a ``yield`` (starting points, uploads, new state,
scoring) is the method's own code, run per client.

A :class:`LocalRun` names everything one run needs, and nothing about how it is executed: the
model it starts from, which parameters train, the data stream and epochs, the optimizer
(:mod:`pflalign.training.optimizers`), a per-step gradient correction
(:mod:`pflalign.training.corrections`), and the loss with any extra trained tensors
(:mod:`pflalign.training.objectives`). Two executors run it:

- one client at a time (:meth:`pflalign.training.client.ClientRuntime.execute`): a module, a
  ``torch.optim`` optimizer, ``backward``, the correction on ``.grad``, ``step`` (every engine;
  on the CPU the only one);
- a cohort together (:mod:`pflalign.training.vectorised`, ``engine = batched`` with the ``vmap``
  backend): the clients' models stacked along a leading client dimension and stepped in
  lockstep, each client on its own seeded batches.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import torch

from pflalign.training.corrections import Correction, Entries
from pflalign.training.loops import STREAM_TRAIN, TrainStats
from pflalign.training.objectives import Objective
from pflalign.training.optimizers import OptimizerRule

#: a client rule: a generator of local runs that returns the rule's result, or the result itself
Rule = Generator["LocalRun", "RunResult", Any] | Any


@dataclass(frozen=True)
class LocalRun:
    """One stretch of local training on one client (see the module docstring).

    - ``start``: the model's full state (parameters and buffers) the run starts from;
    - ``trainable``: the parameters trained (None: every trainable one). The others are held
      fixed, and so are the buffers (batch-norm statistics) of layers none of whose parameters
      train;
    - ``stream`` and ``epochs``: the seeded shuffle of the client's train split, and how long:
      ``None`` is the round's local training (``local-epochs`` capped at ``local-steps``), a
      number that many epochs in full;
    - ``max_steps``: at most this many steps (None: as ``epochs`` says; Per-FedAvg's
      personalization takes its first few batches);
    - ``steps_per_batch``: the steps taken on each batch (pFedMe's K inner steps); a batch
      counts as one step, with its last step's loss;
    - ``batches_per_step``: the consecutive batches one step takes (Per-FedAvg's ``D``, ``D'``:
      :func:`~pflalign.training.loops.grouped`); the objective receives them as tuples;
    - ``sample``: train on a random subset of this many of the client's train samples, drawn
      from the stream before its batches (FedALA's random share); None: on all of them;
    - ``until``: asked at the end of each epoch, with the run's per-step losses so far, whether
      to stop there (FedALA's first adaptation); a frozen dataclass, so that runs can be
      compared;
    - ``optimizer``: None is the run's ``local-optimizer``;
    - ``correction``: a per-step change to the gradients (None: none), which may also move its
      own tensors after each batch (:meth:`~pflalign.training.corrections.Correction.end_batch_`);
    - ``objective``: the loss trained on (:mod:`pflalign.training.objectives`; None: the model's
      cross-entropy);
    - ``extras``: tensors trained beside the model's entries, by the same optimizer (after them,
      in this order), which the objective reads; their trained values come back in
      :attr:`RunResult.extras`.
    """

    start: Entries
    trainable: tuple[str, ...] | None = None
    stream: int = STREAM_TRAIN
    epochs: int | None = None
    max_steps: int | None = None
    steps_per_batch: int = 1
    batches_per_step: int = 1
    sample: int | None = None
    until: Callable[[list[float]], bool] | None = None
    optimizer: OptimizerRule | None = None
    correction: Correction | None = None
    objective: Objective | None = None
    extras: Entries = field(default_factory=dict)


@dataclass
class RunResult:
    """What a run gives back: the model's full state after it, its training statistics, and
    what its optimizer rule reports (:meth:`OptimizerRule.outcome`; None for most), its
    correction as it ended (for one that moves its tensors; else None), its extra trained
    tensors and its objective's per-run state as they ended."""

    model: dict[str, torch.Tensor]
    stats: TrainStats
    optimizer: object = None
    correction: Correction | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    state: dict[str, torch.Tensor] = field(default_factory=dict)


def is_generator_rule(function: Callable) -> bool:
    """Whether a client rule yields its local runs (else it trains in a loop of its own)."""
    return inspect.isgeneratorfunction(function)


def complete(rule: Rule, execute: Callable[[LocalRun], RunResult]) -> Any:
    """Run a client rule to its end, each of its local runs by ``execute``: its result."""
    if not inspect.isgenerator(rule):
        return rule
    result = None
    try:
        while True:
            result = execute(rule.send(result))
    except StopIteration as done:
        return done.value
