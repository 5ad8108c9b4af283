"""A cohort's local runs executed together: stacked models stepped in lockstep, vectorised.

The batched engine's ``vmap`` backend (:mod:`pflalign.engines.batched`) hands this module the
:class:`~pflalign.training.runs.LocalRun` each client of a cohort yielded at the same point of its
rule. Runs that agree on everything but their tensors (:func:`cohort_key`) are executed together:

- **Models are stacked.** Every entry of the clients' start models becomes one tensor with a
  leading client dimension; the trained entries are stepped in place, the others held fixed.
- **Lockstep.** Each step, every client still running takes its own next mini-batch of its own
  seeded batch order (the one :meth:`~pflalign.training.client.ClientRuntime.batch_order` gives, the
  draws of the other engines); a client with fewer samples has fewer steps and sits out the
  steps after its last. Nothing in its data is padded; a step's batches are padded to the
  longest, with a mask.
- **Vectorised.** One :func:`torch.func.vmap` call computes every client's gradient of its
  masked mean cross-entropy (one kernel launch per layer for the cohort: the GPU path); the
  correction (:class:`~pflalign.training.corrections.Correction`) is applied to the stacked
  gradients, and the optimizer rule steps the stacked tensors through its functional core
  (:meth:`~pflalign.training.optimizers.OptimizerRule.stacked`).

The results agree with one client at a time within float32 rounding (vmap's grouped kernels,
masked means and per-client reductions round differently); a test bounds the difference. A run
this module cannot serve (a model with batch norm or dropout, whose statistics are per client,
or an optimizer rule without a stacked form) is executed one client at a time, and
:func:`unstackable` says why.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import TypeVar

import torch
from torch.func import grad_and_value, vmap

from pflalign.data.datasets import IGNORE_INDEX
from pflalign.models.registry import is_deterministic_in_training
from pflalign.training.client import ClientRuntime
from pflalign.training.corrections import Correction, PerClient
from pflalign.training.loops import STREAM_OPTIMIZER, TrainStats, grouped, stopping
from pflalign.training.objectives import CrossEntropy, ModelCall
from pflalign.training.optimizers import LocalOptimizer, put_rows, rows_of
from pflalign.training.runs import LocalRun, RunResult

P = TypeVar("P", bound=PerClient)
T = TypeVar("T")


def unstackable(client: ClientRuntime, run: LocalRun) -> str | None:
    """Why ``run`` cannot be executed stacked with other clients' (None when it can)."""
    if not is_deterministic_in_training(client.layout):
        return "the model has batch norm or dropout, whose state is per client"
    if run.optimizer is not None and not run.optimizer.stackable:
        return f"its optimizer rule {type(run.optimizer).__name__} has no stacked form"
    return None


def cohort_key(client: ClientRuntime, run: LocalRun) -> tuple:
    """What clients' runs must share to be executed together: everything but their tensors."""
    rule = run.optimizer or LocalOptimizer(client.training)
    correction, objective = run.correction, run.objective
    return (run.trainable, run.stream, run.epochs, run.max_steps, run.steps_per_batch,
            run.batches_per_step, run.sample is None, run.until, rule.cohort_key(),
            type(correction),
            None if correction is None else correction.scalars(), type(objective),
            None if objective is None else objective.scalars(), tuple(run.extras),
            client.device, client.training)


def _stacked(entries: Sequence[Mapping[str, torch.Tensor]], device: torch.device,
             ) -> dict[str, torch.Tensor]:
    """The clients' ``entries``, each name's tensors stacked along a leading client dimension."""
    return {n: torch.stack([e[n] for e in entries]).to(device) for n in entries[0]}


def _stack(parts: Sequence[P], device: torch.device) -> P:
    """One correction or objective whose tensor fields stack the clients' ``parts``."""
    return parts[0].replaced({field: _stacked([p.tensors()[field] for p in parts], device)
                              for field in parts[0].tensors()})


def _rows(entries: Mapping[str, torch.Tensor], rows: torch.Tensor | None,
          ) -> dict[str, torch.Tensor]:
    return dict(entries) if rows is None else {n: t.index_select(0, rows)
                                              for n, t in entries.items()}


def _select(part: P, rows: torch.Tensor | None) -> P:
    if rows is None:
        return part
    return part.replaced({field: _rows(entries, rows)
                          for field, entries in part.tensors().items()})


def _put_back(correction: Correction, part: Correction, rows: torch.Tensor | None) -> None:
    """Write the rows :func:`_select` took of ``correction`` back from ``part`` (nothing to do
    when they were every row: ``part`` is ``correction``)."""
    taken = part.tensors()
    for field, entries in correction.tensors().items():
        put_rows(list(entries.values()), [taken[field][n] for n in entries], rows)


def _row(correction: Correction, i: int) -> Correction:
    """Client ``i``'s correction from a stacked one."""
    return correction.replaced({field: {n: t[i].clone() for n, t in entries.items()}
                                for field, entries in correction.tensors().items()})


def lockstep(orders: Sequence[Iterator[T]]) -> Iterator[tuple[list[T | None], list[int]]]:
    """Step through every client's batch order together: per step, each client's next index
    batch (None once its order is done) and the clients that have one."""
    while True:
        batch = [next(order, None) for order in orders]
        active = [i for i, idx in enumerate(batch) if idx is not None]
        if not active:
            return
        yield batch, active


def padded(clients: Sequence[ClientRuntime], batch: Sequence[torch.Tensor | None],
           active: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The active clients' batches (positions in their train splits) as one padded tensor:
    normalised inputs ``(clients, longest, ...)``, labels (``(clients, longest, ...)``: a
    language model's are windows) and a float mask of the real samples; for data with masked
    targets (instructions), a mask of the labels' shape, 1 for each scored target of a real
    sample (the padding's labels are ignored ones)."""
    size = max(len(batch[i]) for i in active)
    first = clients[active[0]].data
    device = first.train_x.device
    x = torch.zeros((len(active), size, *first.train_x.shape[1:]), dtype=first.train_x.dtype,
                    device=device)
    y = torch.zeros((len(active), size, *first.train_y.shape[1:]), dtype=first.train_y.dtype,
                    device=device)
    mask = torch.zeros((len(active), size), dtype=torch.float32, device=device)
    if first.masked_targets:
        y.fill_(IGNORE_INDEX)
    for k, i in enumerate(active):
        data, idx = clients[i].data, batch[i]
        x[k, :len(idx)] = data.train_x[idx]
        y[k, :len(idx)] = data.train_y[idx]
        mask[k, :len(idx)] = 1.0
    if first.masked_targets:
        mask = (y != IGNORE_INDEX).float()
    return first.normalize(x.flatten(0, 1)).unflatten(0, (len(active), size)), y, mask


def execute_together(clients: Sequence[ClientRuntime], runs: Sequence[LocalRun],
                     server_round: int) -> list[RunResult]:
    """Execute ``runs[i]`` on ``clients[i]`` for every i, stacked and in lockstep (the runs share
    one :func:`cohort_key`); each client's result, as :meth:`ClientRuntime.execute` gives it
    within float32 rounding."""
    first, run = clients[0], runs[0]
    device = first.device
    module = first.new_model()
    keys = list(module.state_dict())
    trainable = set(first.template.trainable if run.trainable is None else run.trainable)
    names = [n for n, p in module.named_parameters() if n in trainable]
    trained = {n: torch.stack([r.start[n] for r in runs]).to(device) for n in names}
    fixed = {k: torch.stack([r.start[k] for r in runs]).to(device)
             for k in keys if k not in trained}
    extras = _stacked([r.extras for r in runs], device) if run.extras else {}
    objective = (CrossEntropy() if run.objective is None
                 else _stack([r.objective for r in runs], device))
    state = (_stacked([r.objective.initial_state() for r in runs], device)
             if run.objective is not None else {})
    call = ModelCall(module)

    def step_loss(params: dict, added: dict, others: dict, tensors: dict, carried: dict,
                  x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> tuple:
        step = objective.replaced(tensors).loss(call, {**others, **params}, added, carried, x,
                                                y, mask)
        return step.objective, (step.loss, dict(step.metrics), dict(step.state) or carried)

    gradient = vmap(grad_and_value(step_loss, argnums=(0, 1), has_aux=True))
    rule = run.optimizer or LocalOptimizer(first.training)
    rules = [r.optimizer or rule for r in runs]
    all_names = [*names, *extras]
    stacked = [trained[n] for n in names] + list(extras.values())
    optimizer = type(rule).stacked(rules, stacked, all_names, [
        c.generator(server_round, STREAM_OPTIMIZER, r.stream)
        for c, r in zip(clients, runs, strict=True)])
    correction = None if run.correction is None else _stack(
        [r.correction for r in runs], device)
    count = len(clients)
    loss_sums = torch.zeros(count, device=device)
    metric_sums: dict[str, torch.Tensor] = {}
    seen, steps = [0] * count, [0] * count
    module.train()
    per_step = run.batches_per_step
    orders = [c.batch_order(server_round, r.stream, r.epochs, r.max_steps, r.sample)
              for c, r in zip(clients, runs, strict=True)]
    records: list[list[torch.Tensor]] = [[] for _ in clients]
    if run.until is not None:
        orders = [stopping(order, math.ceil((r.sample or c.data.num_train)
                                            / c.training.batch_size), run.until, record)
                  for order, c, r, record in zip(orders, clients, runs, records, strict=True)]
    if per_step > 1:
        orders = [grouped(order, per_step) for order in orders]
    for batch, active in lockstep(orders):
        rows = None if len(active) == count else torch.tensor(active, device=device)
        if per_step == 1:
            x, y, mask = padded(clients, batch, active)
        else:  # one padded batch per member of the clients' groups
            x, y, mask = zip(*(padded(clients, [None if b is None else b[j] for b in batch],
                                      active) for j in range(per_step)), strict=True)
            batch = [None if b is None else b[0] for b in batch]
        for _ in range(run.steps_per_batch):
            params, others, added = (_rows(part, rows) for part in (trained, fixed, extras))
            (g, g_extras), (_, (losses, metrics, carried)) = gradient(
                params, added, others, _select(objective, rows).tensors(), _rows(state, rows),
                x, y, mask)
            grads = [g[n] for n in names]
            if correction is not None:
                with torch.no_grad():
                    _select(correction, rows).apply_(grads, [params[n] for n in names], names)
            optimizer.step(stacked, grads + [g_extras[n] for n in extras], rows)
        put_rows(list(state.values()), [carried[n] for n in state], rows)
        if rows is None:
            state = dict(carried)
        if correction is not None and correction.moves:
            with torch.no_grad():
                part = _select(correction, rows)
                part.end_batch_(rows_of(stacked, rows), names)
                _put_back(correction, part, rows)
        sizes = torch.tensor([len(batch[i]) for i in active], device=device,
                             dtype=loss_sums.dtype)
        at = rows if rows is not None else torch.arange(count, device=device)
        loss_sums.index_add_(0, at, losses.detach() * sizes)
        for name, value in metrics.items():
            metric_sums.setdefault(name, torch.zeros(count, device=device)).index_add_(
                0, at, value.detach() * sizes)
        for k, i in enumerate(active):
            seen[i] += len(batch[i])
            steps[i] += 1
            if run.until is not None:
                records[i].append(losses[k].detach())
    outcomes = optimizer.outcomes(stacked)
    moved = correction is not None and correction.moves
    return [RunResult({k: trained[k][i].clone() if k in trained else r.start[k] for k in keys},
                      TrainStats(loss=float(loss_sums[i]) / max(seen[i], 1), steps=steps[i],
                                 samples=seen[i],
                                 metrics={k: float(v[i]) / max(seen[i], 1)
                                          for k, v in metric_sums.items()}),
                      outcomes[i], _row(correction, i) if moved else None,
                      {n: t[i].clone() for n, t in extras.items()},
                      {n: t[i].clone() for n, t in state.items()})
            for i, r in enumerate(runs)]
