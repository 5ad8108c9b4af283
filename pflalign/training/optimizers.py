"""How a local run's trained tensors are stepped: optimizer rules, for one client and for a cohort.

An :class:`OptimizerRule` builds a client's ``torch.optim`` optimizer over its tensors (the
per-client executor) or a :class:`StackedOptimizer` over a cohort's stacked tensors (the
vectorised executor), both through the functional cores of :mod:`pflalign.training.optim`.
The run's ``local-optimizer`` (:class:`LocalOptimizer`) and GENIE with state kept across rounds
(:class:`PersistentGenie`) are here; a method's own rule lives in its file (pFLAlign's).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Self

import torch

from pflalign.settings.schema import LocalTraining
from pflalign.training.corrections import Entries
from pflalign.training.optim import GenieBuffers, genie_update
from pflalign.training.optim.common import closure_loss
from pflalign.training.optim.genie import draw_device
from pflalign.training.optim.genie import hyperparameters as genie_hyperparameters
from pflalign.wire.state import state_key


class StackedOptimizer:
    """A cohort's optimizer: steps stacked tensors (a leading client dimension) in place.

    ``step(params, grads, active)``: ``grads`` are the active clients' (their rows, in the order
    of ``active``; every client when ``active`` is None); the other clients' rows are left as
    they are. :meth:`outcomes` gives each client what :meth:`OptimizerRule.outcome` gives it."""

    def step(self, params: list[torch.Tensor], grads: list[torch.Tensor],
             active: torch.Tensor | None) -> None:
        raise NotImplementedError

    def outcomes(self, params: list[torch.Tensor]) -> list[object]:
        return [None] * params[0].shape[0]


class CohortOfOne(torch.optim.Optimizer):
    """A client's optimizer from a rule's stacked form: the client as a cohort of one, its
    tensors viewed with a leading dimension of 1 (views: the stacked step updates them in place),
    stepped on their ``.grad``. So a stateful optimizer (pFLAlign's PersonalizedLocalUpdate,
    GENIE) is written once, as its :class:`StackedOptimizer` over its functional core, and both
    executors call it."""

    def __init__(self, stacked: StackedOptimizer, params: list[torch.Tensor]):
        super().__init__(params, {})
        self.stacked = stacked
        self.views = [p.unsqueeze(0) for p in params]

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = closure_loss(closure)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p)
                 for p in self.param_groups[0]["params"]]
        self.stacked.step(self.views, [g.unsqueeze(0) for g in grads], None)
        return loss

    def outcome(self) -> object:
        return self.stacked.outcomes(self.views)[0]


class OptimizerRule:
    """How a run's trained tensors are stepped: :meth:`build` a client's ``torch.optim``
    optimizer over its tensors, or :meth:`stacked` one for a cohort's stacked tensors; after the
    run, :meth:`outcome` is what the rule returns about it (a persistent state, diagnostics).
    Rules of one class describe the same optimizer; a cohort may differ only in their state.
    A stateful rule defines :meth:`stacked` only: a client's optimizer is then its cohort of
    one (:class:`CohortOfOne`)."""

    #: the vectorised executor can step a cohort with this rule (:meth:`stacked`)
    stackable: ClassVar[bool] = False

    def build(self, params: list[torch.Tensor], names: Sequence[str],
              generator: torch.Generator) -> torch.optim.Optimizer:
        """A client's optimizer over its trained tensors ``params`` (entries ``names``); its
        randomness (GENIE's) from ``generator``. By default the rule's stacked form for a cohort
        of one."""
        return CohortOfOne(type(self).stacked([self], [p.unsqueeze(0) for p in params], names,
                                              [generator]), params)

    def outcome(self, optimizer: torch.optim.Optimizer, names: Sequence[str]) -> object:
        return optimizer.outcome() if isinstance(optimizer, CohortOfOne) else None

    @classmethod
    def stacked(cls, rules: Sequence[Self], params: list[torch.Tensor], names: Sequence[str],
                generators: Sequence[torch.Generator]) -> StackedOptimizer:
        raise NotImplementedError

    def cohort_key(self) -> object:
        """What must be equal for clients to be stepped together (the hyperparameters)."""
        return type(self)


@dataclass(frozen=True)
class LocalOptimizer(OptimizerRule):
    """The run's ``local-optimizer`` (sgd, adam, adamw or genie), a new one each run
    (:func:`local_optimizer`)."""

    stackable: ClassVar[bool] = True

    training: LocalTraining

    def build(self, params: list[torch.Tensor], names: Sequence[str],
              generator: torch.Generator) -> torch.optim.Optimizer:
        if self.training.local_optimizer == "genie":  # stateful: its stacked form, for one
            return super().build(params, names, generator)
        return local_optimizer(self.training, params, generator)

    def cohort_key(self) -> object:
        return (type(self), self.training)

    @classmethod
    def stacked(cls, rules: Sequence[Self], params: list[torch.Tensor], names: Sequence[str],
                generators: Sequence[torch.Generator]) -> StackedOptimizer:
        training = rules[0].training
        if training.local_optimizer == "genie":
            zeros = [torch.zeros_like(p) for p in params]
            return StackedGenie(training, params, zeros, zeros, 0, generators)
        return ElementwiseStacked(local_optimizer(training, params))


@dataclass(frozen=True)
class PlainSGD(OptimizerRule):
    """Plain SGD at rate ``lr`` (no momentum, no weight decay), a new one each run: a method's
    own step rule for one of its phases (Per-FedAvg's personalization at rate alpha)."""

    stackable: ClassVar[bool] = True

    lr: float

    def build(self, params: list[torch.Tensor], names: Sequence[str],
              generator: torch.Generator) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr)

    def cohort_key(self) -> object:
        return (type(self), self.lr)

    @classmethod
    def stacked(cls, rules: Sequence[Self], params: list[torch.Tensor], names: Sequence[str],
                generators: Sequence[torch.Generator]) -> StackedOptimizer:
        return ElementwiseStacked(torch.optim.SGD(params, lr=rules[0].lr))


@dataclass(frozen=True)
class EntryGroup:
    """Entries stepped with their own SGD hyperparameters: those whose name starts with
    ``prefix``; ``lr`` and ``weight_decay`` (None: the rule's), and ``bounds``, an interval the
    entries are projected onto after every step (projected gradient descent)."""

    prefix: str
    lr: float | None = None
    weight_decay: float | None = None
    bounds: tuple[float, float] | None = None


@dataclass(frozen=True)
class SGDGroups(OptimizerRule):
    """SGD (``lr``, ``momentum``, ``weight_decay``) with groups of entries that have their own
    (:class:`EntryGroup`; an entry belongs to the first group whose prefix it has), a new one
    each run: GPFL's modules with their own weight decay, APFL's personal model and its projected
    mixing weight. The torch parameter groups follow the order of the entries' first
    appearance."""

    stackable: ClassVar[bool] = True

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    groups: tuple[EntryGroup, ...] = ()

    def _group(self, name: str) -> EntryGroup | None:
        return next((g for g in self.groups if name.startswith(g.prefix)), None)

    def build(self, params: list[torch.Tensor], names: Sequence[str],
              generator: torch.Generator | None = None) -> torch.optim.Optimizer:
        grouped: dict[EntryGroup | None, list[torch.Tensor]] = {}
        for name, q in zip(names, params, strict=True):
            grouped.setdefault(self._group(name), []).append(q)
        optimizer = torch.optim.SGD(
            [{"params": qs, **({} if g is None else {
                k: v for k, v in (("lr", g.lr), ("weight_decay", g.weight_decay))
                if v is not None})} for g, qs in grouped.items()],
            lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        bounded = [(g.bounds, qs) for g, qs in grouped.items()
                   if g is not None and g.bounds is not None]
        if bounded:
            @torch.no_grad()
            def project(*_: object) -> None:
                for (low, high), qs in bounded:
                    torch._foreach_clamp_min_(qs, low)
                    torch._foreach_clamp_max_(qs, high)

            optimizer.register_step_post_hook(project)
        return optimizer

    def cohort_key(self) -> object:
        return (type(self), self.lr, self.momentum, self.weight_decay, self.groups)

    @classmethod
    def stacked(cls, rules: Sequence[Self], params: list[torch.Tensor], names: Sequence[str],
                generators: Sequence[torch.Generator]) -> StackedOptimizer:
        return ElementwiseStacked(rules[0].build(params, names))


def local_optimizer(training: LocalTraining, params: Iterable[torch.Tensor],
                    generator: torch.Generator | None = None) -> torch.optim.Optimizer:
    """The run's ``local-optimizer`` over ``params``: ``sgd`` (``lr``, ``momentum``,
    ``weight-decay``), ``adam`` and ``adamw`` (``adam-lr``, ``weight-decay``: L2 in the
    gradient for adam, decoupled for adamw) or ``genie`` (``genie-*``,
    ``weight-decay``; its mask and noise drawn from ``generator``). A new one each run: its state
    does not outlive it."""
    if training.local_optimizer == "sgd":
        return training.sgd(params)
    if training.local_optimizer == "adam":
        return torch.optim.Adam(params, lr=training.adam_lr, weight_decay=training.weight_decay)
    if training.local_optimizer == "adamw":
        return torch.optim.AdamW(params, lr=training.adam_lr, weight_decay=training.weight_decay)
    if training.local_optimizer == "genie":  # GENIE's stacked form for a cohort of one
        return LocalOptimizer(training).build(list(params), (), generator)
    raise ValueError(f"Unknown local-optimizer {training.local_optimizer!r}; choose sgd, adam, "
                     "adamw or genie.")


@dataclass(frozen=True)
class PersistentGenie(OptimizerRule):
    """GENIE with its state kept by the client across rounds (pFLAlign's GENIE variant,
    docs/algorithms.md 4.2): ``m``, ``s`` and the step count from ``saved`` (``<entry>.m``,
    ``<entry>.s``, ``<entry>.step``; fresh when None); the outcome is the new state."""

    stackable: ClassVar[bool] = True

    training: LocalTraining
    saved: Entries | None = None

    def steps_done(self) -> int:
        return int(next(v for k, v in self.saved.items() if k.endswith(state_key("", "step")))) \
            if self.saved else 0

    def cohort_key(self) -> object:
        return (type(self), self.training, self.steps_done())

    @classmethod
    def stacked(cls, rules: Sequence[Self], params: list[torch.Tensor], names: Sequence[str],
                generators: Sequence[torch.Generator]) -> StackedOptimizer:
        def moments(key: str) -> list[torch.Tensor]:
            if rules[0].saved is None:
                return [torch.zeros_like(p) for p in params]
            return [torch.stack([r.saved[state_key(n, key)] for r in rules]).to(p)
                    for n, p in zip(names, params, strict=True)]

        return StackedGenie(rules[0].training, params, moments("m"), moments("s"),
                            rules[0].steps_done(), generators, names=names)


# --- cohorts' optimizers (the vectorised executor's) ---------------------------------------
def rows_of(tensors: list[torch.Tensor], active: torch.Tensor | None) -> list[torch.Tensor]:
    """The rows of ``active`` clients of each stacked tensor (all of them when None)."""
    return list(tensors) if active is None else [t.index_select(0, active) for t in tensors]


def put_rows(targets: list[torch.Tensor], values: list[torch.Tensor],
              active: torch.Tensor | None) -> None:
    if active is not None:
        for target, value in zip(targets, values, strict=True):
            target.index_copy_(0, active, value)


class ElementwiseStacked(StackedOptimizer):
    """A ``torch.optim`` optimizer with an element-wise rule (SGD, Adam) over a cohort's stacked
    tensors: one optimizer steps every client's rows at once, each row as the client's own
    optimizer would (the cohort takes its steps together, so Adam's shared step count is every
    active client's). A client with fewer steps has finished: its rows are put back after each
    later step (a fresh local optimizer's state dies with the run)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    @torch.no_grad()
    def step(self, params: list[torch.Tensor], grads: list[torch.Tensor],
             active: torch.Tensor | None) -> None:
        if active is None:
            for p, g in zip(params, grads, strict=True):
                p.grad = g
        else:
            done = torch.ones(params[0].shape[0], dtype=torch.bool, device=params[0].device)
            done[active] = False
            kept = [p[done].clone() for p in params]
            for p, g in zip(params, grads, strict=True):
                p.grad = torch.zeros_like(p).index_copy_(0, active, g)
        self.optimizer.step()
        for p in params:
            p.grad = None
        if active is not None:
            for p, k in zip(params, kept, strict=True):
                p[done] = k


class StackedGenie(StackedOptimizer):
    """GENIE for a cohort at one step count: :func:`~pflalign.training.optim.genie_update` on
    stacked buffers, each client drawing from its own generator; a finished client's rows are left
    out of the later steps. With ``names``, :meth:`outcomes` gives each client's new state as
    :meth:`PersistentGenie.outcome` does."""

    def __init__(self, training: LocalTraining, params: list[torch.Tensor],
                 m: list[torch.Tensor], s: list[torch.Tensor], steps: int,
                 generators: Sequence[torch.Generator], names: Sequence[str] | None = None):
        self.options = genie_hyperparameters({**training.genie_options(),
                                              "moving_avg": training.genie_moving_avg})
        self.generators = list(generators)
        self.device = draw_device(self.generators[0], params[0])
        self.buffers = GenieBuffers(params, m, s, self.device, stacked=True)
        self.steps = steps
        self.names = names

    def step(self, params: list[torch.Tensor], grads: list[torch.Tensor],
             active: torch.Tensor | None) -> None:
        self.steps += 1
        if active is None:
            genie_update(self.buffers, params, grads, step=self.steps,
                         generators=self.generators, **self.options)
            return
        rows = rows_of(params, active)
        part = GenieBuffers(rows, rows_of(self.buffers.m_views, active),
                            rows_of(self.buffers.s_views, active), self.device, stacked=True)
        genie_update(part, rows, grads, step=self.steps,
                     generators=[self.generators[i] for i in active.tolist()], **self.options)
        put_rows(params, rows, active)
        put_rows(self.buffers.m_views, part.m_views, active)
        put_rows(self.buffers.s_views, part.s_views, active)

    def outcomes(self, params: list[torch.Tensor]) -> list[object]:
        if self.names is None:
            return super().outcomes(params)
        out = []
        for i in range(params[0].shape[0]):
            state = {}
            for name, m, s in zip(self.names, self.buffers.m_views, self.buffers.s_views,
                                  strict=True):
                state.update({state_key(name, "m"): m[i].clone(),
                              state_key(name, "s"): s[i].clone(),
                              state_key(name, "step"): torch.tensor(self.steps)})
            out.append(state)
        return out
