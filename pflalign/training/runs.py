"""A method's local training, written once: runs of local training that an engine executes.

A client rule (:meth:`~pflalign.methods.base.Method.train`,
:meth:`~pflalign.methods.base.Method.evaluate`) is written once, as a generator. Each ``yield
LocalRun(...)`` hands one stretch of local training to whoever runs the rule and receives its
:class:`RunResult`; what comes before and after a ``yield`` (starting points, uploads, new state,
scoring) is the method's own code, run per client. A rule that trains in a loop of its own (APFL,
Per-FedAvg, pFedMe, FedCP, GPFL) is a plain function.

A :class:`LocalRun` names everything one run needs, and nothing about how it is executed: the
model it starts from, which parameters train, the data stream and epochs, the optimizer, and a
per-step gradient correction. Two executors run it:

- one client at a time (:meth:`pflalign.training.client.ClientRuntime.execute`): a module, a
  ``torch.optim`` optimizer, ``backward``, the correction on ``.grad``, ``step`` (every engine;
  on the CPU the only one);
- a cohort together (:mod:`pflalign.training.vectorised`, ``engine = batched`` with the ``vmap``
  backend): the clients' models stacked along a leading client dimension and stepped in
  lockstep, each client on its own seeded batches.

Both read the same declarations. Corrections (:class:`Correction`) are gradient transformations
in the style of Optax: their tensors are per client, one per trained entry, and their rule is
element-wise, so one ``apply_`` serves a client's tensors and a stacked cohort's. Optimizers
(:class:`OptimizerRule`) say how to build a client's ``torch.optim`` optimizer and how to step a
stacked cohort, through the functional cores of :mod:`pflalign.training.optim`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import torch

from pflalign.settings.schema import LocalTraining
from pflalign.training.loops import STREAM_TRAIN, TrainStats
from pflalign.training.optim import GENIE, GenieBuffers, PFLAlign, genie_update, pflalign_update
from pflalign.training.optim.genie import draw_device
from pflalign.training.optim.genie import hyperparameters as genie_hyperparameters

Entries = Mapping[str, torch.Tensor]
#: a client rule: a generator of local runs that returns the rule's result, or the result itself
Rule = Generator["LocalRun", "RunResult", Any] | Any


class Correction:
    """A per-step gradient transformation: ``apply_(grads, params, names)`` changes the
    gradients in place after ``backward`` and before the optimizer steps.

    A correction is a frozen dataclass. Its :data:`Entries` fields hold one tensor per trained
    entry (keyed by the entry's name): they are per client, and the vectorised executor stacks
    them along a leading client dimension. Its other fields are hyperparameters, the same for
    every client of a cohort. ``apply_`` must be element-wise over the tensors, so that it gives a
    client's rows of a stacked cohort the values it gives the client's own tensors."""

    def apply_(self, grads: list[torch.Tensor], params: list[torch.Tensor],
               names: Sequence[str]) -> None:
        raise NotImplementedError

    def tensors(self) -> dict[str, Entries]:
        """The correction's per-client tensor fields."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)  # type: ignore
                if isinstance(getattr(self, f.name), Mapping)}

    def replaced(self, tensors: Mapping[str, Entries]) -> Self:
        """The same correction with its tensor fields replaced (stacked, moved, or selected)."""
        return dataclasses.replace(self, **tensors)  # type: ignore[type-var]

    def to(self, device: torch.device) -> Self:
        return self.replaced({field: {n: t.to(device) for n, t in entries.items()}
                              for field, entries in self.tensors().items()})


@dataclass(frozen=True)
class Proximal(Correction):
    """``g += mu (w - w_anchor)``: the gradient of ``mu/2 ||w - w_anchor||^2``. FedProx (Li et al.,
    MLSys 2020, eq. 2) with the received global model as anchor; Ditto's personal objective (Li et
    al., ICML 2021, Algorithm 1) with ``mu = lambda``."""

    anchor: Entries
    mu: float

    def apply_(self, grads: list[torch.Tensor], params: list[torch.Tensor],
               names: Sequence[str]) -> None:
        anchor = [self.anchor[n] for n in names]
        torch._foreach_add_(grads, torch._foreach_sub(params, anchor), alpha=self.mu)


@dataclass(frozen=True)
class ControlVariates(Correction):
    """SCAFFOLD's corrected gradient ``g + c - c_i`` (Karimireddy et al., ICML 2020, Algorithm 1
    line 10): ``server`` is ``c``, ``client`` is ``c_i``."""

    server: Entries
    client: Entries

    def apply_(self, grads: list[torch.Tensor], params: list[torch.Tensor],
               names: Sequence[str]) -> None:
        torch._foreach_add_(grads, torch._foreach_sub([self.server[n] for n in names],
                                                      [self.client[n] for n in names]))


@dataclass(frozen=True)
class DynamicRegularizer(Correction):
    """FedDyn's ``g += alpha (w - w^{t-1}) - g_k`` (Acar et al., ICLR 2021, Algorithm 1): the
    gradient of its quadratic and linear terms, ``anchor`` the received server model and
    ``linear`` the client's ``g_k``."""

    anchor: Entries
    linear: Entries
    alpha: float

    def apply_(self, grads: list[torch.Tensor], params: list[torch.Tensor],
               names: Sequence[str]) -> None:
        torch._foreach_add_(grads, torch._foreach_sub(params, [self.anchor[n] for n in names]),
                            alpha=self.alpha)
        torch._foreach_sub_(grads, [self.linear[n] for n in names])


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


class OptimizerRule:
    """How a run's trained tensors are stepped: :meth:`build` a client's ``torch.optim``
    optimizer over its tensors, or :meth:`stacked` one for a cohort's stacked tensors; after the
    run, :meth:`outcome` is what the rule returns about it (a persistent state, diagnostics).
    Rules of one class describe the same optimizer; a cohort may differ only in their state."""

    #: the vectorised executor can step a cohort with this rule (:meth:`stacked`)
    stackable: ClassVar[bool] = False

    def build(self, params: list[torch.Tensor], names: Sequence[str],
              generator: torch.Generator) -> torch.optim.Optimizer:
        """A client's optimizer over its trained tensors ``params`` (entries ``names``); its
        randomness (GENIE's) from ``generator``."""
        raise NotImplementedError

    def outcome(self, optimizer: torch.optim.Optimizer, names: Sequence[str]) -> object:
        return None

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
    if training.local_optimizer == "genie":
        return GENIE(params, **training.genie_options(), generator=generator)
    raise ValueError(f"Unknown local-optimizer {training.local_optimizer!r}; choose sgd, adam, "
                     "adamw or genie.")


@dataclass(frozen=True)
class PFLAlignRule(OptimizerRule):
    """pFLAlign's PersonalizedLocalUpdate for one client's round (:class:`~pflalign.training.optim.
    PFLAlign`, ALGORITHMS.md 1.4 and 1.8): ``v`` and ``P`` from ``saved`` (``<entry>.v``,
    ``<entry>.P``; zeros when None), the offset ``offsets`` (None: no correction) and the round's
    ``num_steps``. Its outcome is the new ``v`` and ``P`` and the round's mean P and gamma."""

    stackable: ClassVar[bool] = True

    lr: float
    beta: float
    eps: float
    precondition: bool
    gamma: str
    num_steps: int
    saved: Entries | None = None
    offsets: Entries | None = None

    def build(self, params: list[torch.Tensor], names: Sequence[str],
              generator: torch.Generator) -> torch.optim.Optimizer:
        optimizer = PFLAlign(params, lr=self.lr, beta=self.beta, eps=self.eps,
                             precondition=self.precondition, gamma=self.gamma)
        if self.saved:  # freshly deserialized tensors: the optimizer may own them
            for name, q in zip(names, params, strict=True):
                optimizer.state[q]["v"] = self.saved[f"{name}.v"].to(q.device)
                optimizer.state[q]["P"] = self.saved[f"{name}.P"].to(q.device)
        optimizer.begin_round([self.offsets[n] for n in names] if self.offsets else None,
                              self.num_steps)
        return optimizer

    def outcome(self, optimizer: torch.optim.Optimizer, names: Sequence[str]) -> PFLAlignOutcome:
        params = [q for group in optimizer.param_groups for q in group["params"]]
        state = {}
        for name, q in zip(names, params, strict=True):
            state.update({f"{name}.v": optimizer.state[q]["v"],
                          f"{name}.P": optimizer.state[q]["P"]})
        return PFLAlignOutcome(state, optimizer.mean_preconditioner(), optimizer.mean_gamma())

    def cohort_key(self) -> object:
        return (type(self), self.lr, self.beta, self.eps, self.precondition, self.gamma,
                self.offsets is None)

    @classmethod
    def stacked(cls, rules: Sequence[Self], params: list[torch.Tensor], names: Sequence[str],
                generators: Sequence[torch.Generator]) -> StackedOptimizer:
        return StackedPFLAlign(rules, params, names)


@dataclass
class PFLAlignOutcome:
    """What a pFLAlign run reports: ``v`` and ``P`` by ``<entry>.v``/``<entry>.P``, and the
    round's mean preconditioner and mean gamma."""

    state: dict[str, torch.Tensor]
    mean_p: float
    mean_gamma: float


@dataclass(frozen=True)
class PersistentGenie(OptimizerRule):
    """GENIE with its state kept by the client across rounds (pFLAlign's GENIE variant,
    ALGORITHMS.md 4.2): ``m``, ``s`` and the step count from ``saved`` (``<entry>.m``,
    ``<entry>.s``, ``<entry>.step``; fresh when None); the outcome is the new state."""

    stackable: ClassVar[bool] = True

    training: LocalTraining
    saved: Entries | None = None

    def build(self, params: list[torch.Tensor], names: Sequence[str],
              generator: torch.Generator) -> torch.optim.Optimizer:
        optimizer = GENIE(params, **self.training.genie_options(), generator=generator)
        if self.saved:
            for name, q in zip(names, params, strict=True):
                optimizer.state[q].update(step=int(self.saved[f"{name}.step"]),
                                          m=self.saved[f"{name}.m"].to(q.device),
                                          s=self.saved[f"{name}.s"].to(q.device))
        return optimizer

    def outcome(self, optimizer: torch.optim.Optimizer, names: Sequence[str],
                ) -> dict[str, torch.Tensor]:
        params = [q for group in optimizer.param_groups for q in group["params"]]
        state = {}
        for name, q in zip(names, params, strict=True):
            s = optimizer.state[q]
            state.update({f"{name}.m": s["m"], f"{name}.s": s["s"],
                          f"{name}.step": torch.tensor(s["step"])})
        return state

    def steps_done(self) -> int:
        return int(next(v for k, v in self.saved.items() if k.endswith(".step"))) \
            if self.saved else 0

    def cohort_key(self) -> object:
        return (type(self), self.training, self.steps_done())

    @classmethod
    def stacked(cls, rules: Sequence[Self], params: list[torch.Tensor], names: Sequence[str],
                generators: Sequence[torch.Generator]) -> StackedOptimizer:
        def moments(key: str) -> list[torch.Tensor]:
            if rules[0].saved is None:
                return [torch.zeros_like(p) for p in params]
            return [torch.stack([r.saved[f"{n}.{key}"] for r in rules]).to(p)
                    for n, p in zip(names, params, strict=True)]

        return StackedGenie(rules[0].training, params, moments("m"), moments("s"),
                            rules[0].steps_done(), generators, names=names)


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
    - ``optimizer``: None is the run's ``local-optimizer``;
    - ``correction``: a per-step change to the gradients (None: none).
    """

    start: Entries
    trainable: tuple[str, ...] | None = None
    stream: int = STREAM_TRAIN
    epochs: int | None = None
    optimizer: OptimizerRule | None = None
    correction: Correction | None = None


@dataclass
class RunResult:
    """What a run gives back: the model's full state after it, its training statistics, and
    what its optimizer rule reports (:meth:`OptimizerRule.outcome`; None for most)."""

    model: dict[str, torch.Tensor]
    stats: TrainStats
    optimizer: object = None


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


# --- cohorts' optimizers (the vectorised executor's) ---------------------------------------
def _rows(tensors: list[torch.Tensor], active: torch.Tensor | None) -> list[torch.Tensor]:
    return list(tensors) if active is None else [t.index_select(0, active) for t in tensors]


def _put_rows(targets: list[torch.Tensor], values: list[torch.Tensor],
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
    stacked
    buffers, each client drawing from its own generator; a finished client's rows are left out of
    the later steps. With ``names``, :meth:`outcomes` gives each client's new state as
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
        rows = _rows(params, active)
        part = GenieBuffers(rows, _rows(self.buffers.m_views, active),
                            _rows(self.buffers.s_views, active), self.device, stacked=True)
        genie_update(part, rows, grads, step=self.steps,
                     generators=[self.generators[i] for i in active.tolist()], **self.options)
        _put_rows(params, rows, active)
        _put_rows(self.buffers.m_views, part.m_views, active)
        _put_rows(self.buffers.s_views, part.s_views, active)

    def outcomes(self, params: list[torch.Tensor]) -> list[object]:
        if self.names is None:
            return super().outcomes(params)
        out = []
        for i in range(params[0].shape[0]):
            state = {}
            for name, m, s in zip(self.names, self.buffers.m_views, self.buffers.s_views,
                                  strict=True):
                state.update({f"{name}.m": m[i].clone(), f"{name}.s": s[i].clone(),
                              f"{name}.step": torch.tensor(self.steps)})
            out.append(state)
        return out


class StackedPFLAlign(StackedOptimizer):
    """pFLAlign for a cohort: :func:`~pflalign.training.optim.pflalign_update` on stacked ``m``,
    ``v``,
    ``P`` and offsets, with each client's own T; a finished client's rows are left out of the
    later steps. Its outcomes are :class:`PFLAlignOutcome` per client."""

    def __init__(self, rules: Sequence[PFLAlignRule], params: list[torch.Tensor],
                 names: Sequence[str]):
        rule = rules[0]
        self.options = dict(lr=rule.lr, beta=rule.beta, eps=rule.eps,
                            precondition=rule.precondition, gamma=rule.gamma)
        self.names = list(names)

        def stacked(field: str, suffix: str = "") -> list[torch.Tensor]:
            """Each entry's tensors from every rule's ``field`` (zeros where a rule has none),
            stacked."""
            return [torch.stack([getattr(r, field)[f"{n}{suffix}"].to(p) if getattr(r, field)
                                 else torch.zeros_like(p[0]) for r in rules])
                    for n, p in zip(self.names, params, strict=True)]

        self.m = [torch.zeros_like(p) for p in params]
        self.v, self.P = stacked("saved", ".v"), stacked("saved", ".P")
        self.deltas = stacked("offsets") if rule.offsets else None
        self.signs = [torch.sign(d) for d in self.deltas] if self.deltas else None
        steps = [r.num_steps for r in rules]
        self.num_steps = steps[0] if len(set(steps)) == 1 else torch.tensor(
            steps, dtype=torch.float64, device=params[0].device)
        self.gamma_sum = torch.zeros(len(rules), dtype=torch.float64, device=params[0].device)
        self.gamma_count = 0
        self.counted = torch.zeros(len(rules), dtype=torch.float64, device=params[0].device)

    @torch.no_grad()
    def step(self, params: list[torch.Tensor], grads: list[torch.Tensor],
             active: torch.Tensor | None) -> None:
        state = [_rows(x, active) for x in (params, self.m, self.v, self.P)]
        deltas = _rows(self.deltas, active) if self.deltas else [None] * len(params)
        signs = _rows(self.signs, active) if self.signs else [None] * len(params)
        steps = self.num_steps
        if isinstance(steps, torch.Tensor) and active is not None:
            steps = steps.index_select(0, active)
        gamma_sum, self.gamma_count = pflalign_update(
            *state[:1], list(grads), *state[1:], deltas, signs, **self.options,
            num_steps=steps, stacked=True)
        for target, value in zip((params, self.m, self.v, self.P), state, strict=True):
            _put_rows(target, value, active)
        rows = slice(None) if active is None else active
        self.gamma_sum[rows] += torch.as_tensor(gamma_sum, dtype=torch.float64)
        self.counted[rows] += 1

    def outcomes(self, params: list[torch.Tensor]) -> list[object]:
        out = []
        for i in range(params[0].shape[0]):
            state = {}
            for name, v, p in zip(self.names, self.v, self.P, strict=True):
                state.update({f"{name}.v": v[i].clone(), f"{name}.P": p[i].clone()})
            total = sum(p[i].numel() for p in self.P)
            mean_p = float(sum(float(p[i].sum()) for p in self.P) / total)
            count = float(self.counted[i]) * self.gamma_count
            mean_gamma = float(self.gamma_sum[i]) / count if count else float("nan")
            out.append(PFLAlignOutcome(state, mean_p, mean_gamma))
        return out
