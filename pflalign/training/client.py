"""What a client rule works with: its data, the run's model, seeded local training, evaluation.

A :class:`ClientRuntime` is one client's view of a run, built by an engine for each action: its
train and test splits (the process-wide cached partition, never re-read, or the node's own partition
file: :mod:`pflalign.data.node`), the run's model template (a per-process
:class:`~pflalign.models.registry.ModelTemplate`, identical to the server's initial model, that
hands out copies), the run's :class:`~pflalign.settings.schema.LocalTraining`, and the seeded loops
every method shares. It executes a rule's local runs one client at a time
(:meth:`ClientRuntime.execute`). It holds no method state and knows no engine: a method's client
rule receives it with what the server sent and its own ``ClientState``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import nn

from pflalign.data.node import NodeData, pooled_node_data
from pflalign.models.language import LoraSpec
from pflalign.models.registry import (
    ModelTemplate,
    is_deterministic_in_training,
    model_template,
    parameter_modules,
)
from pflalign.settings.schema import LocalTraining, Settings
from pflalign.training.backdoor import success_counts
from pflalign.training.loops import (
    STREAM_DROPOUT,
    STREAM_OPTIMIZER,
    STREAM_TRAIN,
    EvalStats,
    StepLoss,
    TrainStats,
    batch_indices,
    derive_seed,
    evaluate,
    head_inputs,
    make_generator,
    train_batches,
)
from pflalign.training.objectives import ModelCall
from pflalign.training.optimizers import LocalOptimizer
from pflalign.training.runs import LocalRun, RunResult
from pflalign.wire.protocol import (
    BACKDOOR_HITS,
    BACKDOOR_TRIED,
    GLOBAL_CORRECT,
    GLOBAL_LOSS,
    NUM_TEST,
    PERSONAL_CORRECT,
    PERSONAL_LOSS,
)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class ClientRuntime:
    """One client of a run: data, model template, and the seeded loops (no method state)."""

    def __init__(self, settings: Settings, client_id: int, device: torch.device,
                 node: NodeData | None = None):
        """``node``: the client's data as its node holds it (a partition file); None takes it
        from the process-wide pooled dataset and partition."""
        self.client_id = client_id
        self.device = device
        self.seed = settings.run.seed
        #: the run-wide settings (dp = local's clip and noise, among others)
        self.run = settings.run
        self.training: LocalTraining = settings.training
        node = node if node is not None else pooled_node_data(settings, client_id, device)
        self.data = node.data.to(device)
        self.input_shape, self.num_classes = node.input_shape, node.num_classes
        self.template: ModelTemplate = model_template(settings.run.model, tuple(node.input_shape),
                                                      node.num_classes, settings.run.seed,
                                                      LoraSpec.of(settings.run))
        #: what the latest :meth:`eval_metrics` scored as this client's personal model (a
        #: module or a state dict; None before one, or when the score was recorded earlier)
        self.scored: nn.Module | Mapping[str, torch.Tensor] | None = None
        #: the scores beyond accuracy each test computes (``eval-metrics``)
        self.scores = tuple(s.strip() for s in settings.run.eval_metrics.split(",") if s.strip())

    # --- models --------------------------------------------------------------------------------
    def new_model(self, state: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
        """A fresh model (a copy of the run's template), loaded with ``state`` if given."""
        return self.template.new(state, self.device)

    def initial_state(self) -> dict[str, torch.Tensor]:
        """A copy of the run's initial model (its full state dict)."""
        return self.template.initial_state()

    @property
    def layout(self) -> nn.Module:
        """The run's model on the meta device: its layers and names, for lookups."""
        return self.template.layout

    # --- training ------------------------------------------------------------------------------
    def generator(self, server_round: int, *streams: int) -> torch.Generator:
        """A generator seeded by (seed, round, this client, streams...)."""
        return make_generator(self.seed, server_round, self.client_id, *streams)

    def execute(self, run: LocalRun, server_round: int) -> RunResult:
        """Run ``run`` on this client (:class:`~pflalign.training.runs.LocalRun`): the template's
        reused training module loaded with its start, its optimizer over the trained parameters, and
        at every step ``backward`` (of the run's objective, when it has one: with its extra
        tensors trained after the model's), the correction on their ``.grad``, ``step``. When
        only the model's last layer trains, the rest is deterministic in training and the run has
        no objective of its own, the layer trains on the body's features computed once (the
        same batches and updates at the cost of one forward pass of the body)."""
        model = self.template.trainer(run.start, self.device)
        if self.template.has_dropout:
            # dropout draws from torch's global generator: seed it per run (lora-dropout > 0),
            # so that the masks are a function of (seed, round, client, stream) on every engine
            torch.manual_seed(derive_seed(self.seed, server_round, self.client_id, run.stream,
                                          STREAM_DROPOUT))
        named = dict(model.named_parameters())
        names = [n for n, p in named.items()
                 if (p.requires_grad if run.trainable is None else n in set(run.trainable))]
        params = [named[n] for n in names]
        extras = {n: t.to(self.device).clone().requires_grad_(True)
                  for n, t in run.extras.items()}
        rule = run.optimizer or LocalOptimizer(self.training)
        before_step = after_batch = correction = step_loss = None
        if run.correction is not None:
            correction = run.correction.to(self.device)
            if correction.moves:  # its own copies, which it moves
                correction = correction.replaced({
                    field: {n: t.clone() for n, t in entries.items()}
                    for field, entries in correction.tensors().items()})

            @torch.no_grad()
            def before_step() -> None:
                correction.apply_([p.grad for p in params], params, names)

            if correction.moves:
                @torch.no_grad()
                def after_batch() -> None:
                    correction.end_batch_(params, names)

        trained = [*params, *extras.values()]
        trained_names = [*names, *extras]
        generator = self.generator(server_round, run.stream)
        rows = self._sample(generator, run.sample)
        with self._only_training(model, run.trainable):
            changing = None if run.trainable is None else set(run.trainable)
            if run.objective is not None and changing is not None:
                changes = run.objective.changes()
                changing = None if changes is None else changing | set(changes)
            head = None if changing is None else self.last_layer_owning(model, changing)
            state: dict[str, torch.Tensor] = {}
            if run.objective is not None:
                objective = run.objective.to(self.device)
                call = ModelCall(model, on_features=head is not None)
                state = {k: v.to(self.device) for k, v in objective.initial_state().items()}

                def step_loss(inputs: torch.Tensor, targets: torch.Tensor) -> tuple:
                    nonlocal state
                    step = objective.loss(call, named, extras, state, inputs, targets, None)
                    state = dict(step.state) or state
                    return step.objective, step.loss, step.metrics

            optimizer = rule.build(trained, trained_names, self.generator(
                server_round, STREAM_OPTIMIZER, run.stream))
            features = None
            if head is not None:
                features = self.head_inputs(model, head, rows)
                model.train()
            stats = self.train_split(head if head is not None and step_loss is None else model,
                                     server_round, run.stream, run.epochs, optimizer,
                                     before_step, features=features, max_steps=run.max_steps,
                                     steps_per_batch=run.steps_per_batch,
                                     after_batch=after_batch, step_loss=step_loss,
                                     batches_per_step=run.batches_per_step, rows=rows,
                                     generator=generator, until=run.until)
        model_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return RunResult(model_state, stats, rule.outcome(optimizer, trained_names),
                         correction if correction is not None and correction.moves else None,
                         {n: t.detach().clone() for n, t in extras.items()},
                         {n: t.detach().clone() for n, t in state.items()})

    @staticmethod
    @contextmanager
    def _only_training(model: nn.Module, keys: Iterable[str] | None) -> Iterator[None]:
        """With ``keys`` (None: everything trains), the other parameters frozen, and the buffers
        (batch-norm statistics) of layers none of whose parameters train kept as they are."""
        if keys is None:
            yield
            return
        wanted = set(keys)
        frozen = [p for n, p in model.named_parameters() if n not in wanted and p.requires_grad]
        kept = {}
        for module_name, module in model.named_modules():
            prefix = f"{module_name}." if module_name else ""
            if not any(prefix + n in wanted for n, _ in module.named_parameters(recurse=False)):
                kept.update({prefix + n: b.clone()
                             for n, b in module.named_buffers(recurse=False)})
        for p in frozen:
            p.requires_grad_(False)
        try:
            yield
        finally:
            for p in frozen:
                p.requires_grad_(True)
            if kept:
                model.load_state_dict(kept, strict=False)

    def train_split(self, model: nn.Module, server_round: int, stream: int = STREAM_TRAIN,
                    epochs: int | None = None,
                    optimizer: torch.optim.Optimizer | None = None,
                    before_step: Callable[[], None] | None = None,
                    features: torch.Tensor | None = None,
                    max_steps: int | None = None, steps_per_batch: int = 1,
                    after_batch: Callable[[], None] | None = None,
                    step_loss: StepLoss | None = None, batches_per_step: int = 1,
                    rows: torch.Tensor | None = None,
                    generator: torch.Generator | None = None,
                    until: Callable[[list[float]], bool] | None = None) -> TrainStats:
        """Train on the client's train split, shuffled by (seed, round, client, stream).

        ``epochs=None`` is the round's local training: ``local-epochs``, capped at ``local-steps``.
        An explicit ``epochs`` (a method's other phases: fine-tuning, personal models, heads) is
        run in full; ``max_steps`` caps either. ``features``, one row per train sample, replaces
        the normalised images as ``model``'s input (a head trained on a frozen body's
        outputs). ``rows``: train on these train samples only (``features`` then has one row per
        sample of ``rows``), with ``generator`` (the stream's, as it was left after drawing them).
        ``steps_per_batch``, ``after_batch``, ``step_loss``, ``batches_per_step`` and ``until``:
        as :func:`~pflalign.training.loops.train_batches` takes them."""
        t = self.training
        inputs, targets = self.data.train_x, self.data.train_y
        if rows is not None:
            inputs, targets = inputs[rows], targets[rows]
        inputs, normalize = ((inputs, self.data.normalize) if features is None
                             else (features, _identity))
        return train_batches(
            model, inputs, targets, normalize,
            optimizer=optimizer or self.make_optimizer(model.parameters(), server_round, stream),
            batch_size=t.batch_size, epochs=t.local_epochs if epochs is None else epochs,
            max_steps=self._step_cap(epochs, max_steps),
            generator=generator or self.generator(server_round, stream), before_step=before_step,
            steps_per_batch=steps_per_batch, after_batch=after_batch, step_loss=step_loss,
            batches_per_step=batches_per_step, until=until)

    def make_optimizer(self, params: Iterable[torch.Tensor], server_round: int,
                       stream: int = STREAM_TRAIN) -> torch.optim.Optimizer:
        """The run's ``local-optimizer`` over ``params``; its randomness (GENIE's) is seeded by
        (seed, round, client, training stream)."""
        return LocalOptimizer(self.training).build(
            list(params), (), self.generator(server_round, STREAM_OPTIMIZER, stream))

    def batches(self, server_round: int, stream: int = STREAM_TRAIN, epochs: int | None = None,
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Normalised (inputs, targets) batches of the train split, in the seeded order
        :meth:`train_split` uses for the same ``(round, stream)``."""
        data = self.data
        for idx in self.batch_order(server_round, stream, epochs):
            yield data.normalize(data.train_x[idx]), data.train_y[idx]

    def batch_order(self, server_round: int, stream: int = STREAM_TRAIN,
                    epochs: int | None = None, max_steps: int | None = None,
                    sample: int | None = None) -> Iterator[torch.Tensor]:
        """The index batches behind :meth:`batches` (the step cap as in :meth:`train_split`);
        with ``sample``, of a random subset of that many train samples, drawn first from the
        stream (a :attr:`~pflalign.training.runs.LocalRun.sample`)."""
        t = self.training
        generator = self.generator(server_round, stream)
        rows = self._sample(generator, sample)
        order = batch_indices(self.data.num_train if rows is None else len(rows), t.batch_size,
                              t.local_epochs if epochs is None else epochs,
                              self._step_cap(epochs, max_steps), generator,
                              self.data.train_x.device)
        return order if rows is None else (rows[idx] for idx in order)

    def _sample(self, generator: torch.Generator, sample: int | None) -> torch.Tensor | None:
        """A run's random subset of ``sample`` train samples, drawn first from its stream's
        ``generator`` (which its batches then continue); None without one."""
        if sample is None:
            return None
        return torch.randperm(self.data.num_train, generator=generator)[:sample].to(
            self.data.train_x.device)

    def _step_cap(self, epochs: int | None, max_steps: int | None) -> int:
        """A run's cap on its steps (0: none): ``max_steps`` when given, else ``local-steps`` for
        the round's local training and none for a run of its own ``epochs``."""
        if max_steps is not None:
            return max_steps
        return self.training.local_steps if epochs is None else 0

    @staticmethod
    def last_layer_owning(model: nn.Module, keys: Iterable[str]) -> nn.Module | None:
        """The model's last parameterised layer when it owns exactly the parameters ``keys`` and
        the rest of the model is deterministic in train mode (no batch norm, no dropout), so its
        inputs can be computed once and reused; else None."""
        if not is_deterministic_in_training(model):
            return None
        name, last = parameter_modules(model)[-1]
        own = {f"{name}.{k}" if name else k for k, _ in last.named_parameters(recurse=False)}
        return last if own == set(keys) else None

    @torch.no_grad()
    def head_inputs(self, model: nn.Module, head: nn.Module,
                    indices: torch.Tensor | None = None) -> torch.Tensor:
        """What ``head`` (the model's last layer) receives for the train samples ``indices``
        (all when None), computed in batches of 256."""
        data = self.data
        chosen = torch.arange(data.num_train, device=data.train_x.device) \
            if indices is None else indices
        return head_inputs(model, head, (data.normalize(data.train_x[chosen[start:start + 256]])
                                         for start in range(0, len(chosen), 256)))

    # --- evaluation ----------------------------------------------------------------------------
    def test(self, model: nn.Module | Mapping[str, torch.Tensor]) -> EvalStats:
        """The test counts and summed loss of ``model``: a module, or a model's state dict
        (scored on the template's reused module: :meth:`~pflalign.models.registry.ModelTemplate.
        scorer`)."""
        scored = model
        if not isinstance(model, nn.Module):
            model = self.template.scorer(model, self.device)
        stats = evaluate(model, self.data.test_x, self.data.test_y, self.data.normalize,
                         scores=self.scores)
        if self.run.attack == "backdoor":
            stats = replace(stats, backdoor=success_counts(
                model, self.data, self.run.backdoor_target, self.run.backdoor_patch))
        return replace(stats, scored=scored)

    def eval_metrics(self, personal: EvalStats, global_: EvalStats | None = None,
                     ) -> dict[str, float | int]:
        """An evaluation reply: the personal model's counts and loss, and the global model's
        correct count when the method has one, and the personal model's scores beyond
        accuracy (``eval-metrics``: ``personal-<score>``). What ``personal`` scored is kept as
        :attr:`scored` (``save-models`` sends it back in the run's final round)."""
        self.scored = personal.scored
        metrics: dict[str, float | int] = {
            NUM_TEST: personal.count, PERSONAL_CORRECT: personal.correct,
            PERSONAL_LOSS: personal.loss_sum / max(personal.count, 1)}
        if global_ is not None:
            metrics[GLOBAL_CORRECT] = global_.correct
            metrics[GLOBAL_LOSS] = global_.loss_sum / max(global_.count, 1)
        for name, value in personal.scores.items():  # eval-metrics: the personal model's
            metrics[f"personal-{name}"] = value
        if personal.backdoor is not None:  # attack = backdoor: its success on this client
            metrics[BACKDOOR_HITS], metrics[BACKDOOR_TRIED] = personal.backdoor
        return metrics
