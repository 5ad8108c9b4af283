"""What a client rule works with: its data, the run's model, seeded local training, evaluation.

A :class:`ClientRuntime` is one client's view of a run, built by an engine for each action: its
train and test splits (the process-wide cached partition, never re-read, or the node's own
partition file: :mod:`pflalign.node`), the run's initial model (a per-process template,
identical to the server's), the run's :class:`LocalTraining`, and the seeded training and
evaluation loops every method shares. It holds no method state and knows no engine: a method's
client rule receives it with what the server sent and its own ``ClientState``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from pflalign.federation import FederatedDataset, federated_dataset
from pflalign.models import build_model, is_deterministic_in_training, parameter_modules
from pflalign.node import NodeData, pooled_node_data
from pflalign.options import Value
from pflalign.protocol import (
    GLOBAL_CORRECT,
    GLOBAL_LOSS,
    MODEL,
    NUM_TEST,
    PERSONAL_CORRECT,
    PERSONAL_LOSS,
)
from pflalign.state import TorchState
from pflalign.train import (
    STREAM_OPTIMIZER,
    STREAM_TRAIN,
    EvalStats,
    LocalTraining,
    TrainStats,
    batch_indices,
    evaluate,
    make_generator,
    train_local,
)

if TYPE_CHECKING:  # the parser imports the method registry, which imports this module
    from pflalign.config import Settings

_TEMPLATES: dict[tuple, nn.Module] = {}


def _template(model: str, input_shape: tuple, num_classes: int, seed: int) -> nn.Module:
    key = (model, tuple(input_shape), num_classes, seed)
    if key not in _TEMPLATES:
        _TEMPLATES[key] = build_model(model, tuple(input_shape), num_classes, seed=seed)
    return _TEMPLATES[key]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


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


@dataclass
class Received:
    """What the server sent a client for one action: named array records (torch state dicts;
    :data:`~pflalign.protocol.MODEL` is the model) and the message's config."""

    server_round: int
    arrays: dict[str, TorchState] = field(default_factory=dict)
    config: dict[str, Value] = field(default_factory=dict)

    @property
    def model(self) -> TorchState | None:
        """The global model (or what the server rule sends in its place); None when not sent."""
        return self.arrays.get(MODEL)


@dataclass
class Upload:
    """What a client's training returns: its model (None when nothing is uploaded), its metrics,
    and further array records uploaded beside the model (SCAFFOLD's control-variate change)."""

    model: Mapping[str, torch.Tensor] | None
    metrics: dict[str, float | int] = field(default_factory=dict)
    arrays: dict[str, Mapping[str, torch.Tensor]] = field(default_factory=dict)


class ClientRuntime:
    """One client of a run: data, model template, and the seeded loops (no method state)."""

    def __init__(self, settings: Settings, client_id: int, device: torch.device,
                 node: NodeData | None = None):
        """``node``: the client's data as its node holds it (a partition file); None takes it
        from the process-wide pooled dataset and partition."""
        self.client_id = client_id
        self.device = device
        self.seed = settings.run.seed
        self.model_name = settings.run.model
        self.training: LocalTraining = settings.training
        self._settings = settings
        node = node if node is not None else pooled_node_data(settings, client_id, device)
        self.data = node.data.to(device)
        self.input_shape, self.num_classes = node.input_shape, node.num_classes

    @property
    def federation(self) -> FederatedDataset:
        """The run's pooled dataset and partition (read on first use: a node given its own
        partition file never needs it; prefer :attr:`data`, :attr:`num_classes`)."""
        return federated_dataset(self._settings)

    # --- models --------------------------------------------------------------------------------
    def new_model(self, state: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
        """A fresh model (a copy of a per-process template), loaded with ``state`` if given."""
        model = copy.deepcopy(self.template())
        if state is not None:
            model.load_state_dict(state)
        return model.to(self.device)

    def template(self) -> nn.Module:
        """The run's initial model (seeded; identical to the server's), cached per process.
        Read-only: :meth:`new_model` hands out copies."""
        return _template(self.model_name, self.input_shape, self.num_classes, self.seed)

    @staticmethod
    def template_for(settings: Settings) -> nn.Module:
        """:meth:`template` for a run's pooled dataset (the batched engine's clients)."""
        dataset = federated_dataset(settings).dataset
        return _template(settings.run.model, dataset.input_shape, dataset.num_classes,
                         settings.run.seed)

    # --- training ------------------------------------------------------------------------------
    def generator(self, server_round: int, *streams: int) -> torch.Generator:
        """A generator seeded by (seed, round, this client, streams...)."""
        return make_generator(self.seed, server_round, self.client_id, *streams)

    def local_train(self, model: nn.Module, server_round: int, stream: int = STREAM_TRAIN,
                    epochs: int | None = None,
                    optimizer: torch.optim.Optimizer | None = None,
                    before_step: Callable[[], None] | None = None,
                    features: torch.Tensor | None = None) -> TrainStats:
        """Train on the client's train split, shuffled by (seed, round, client, stream).

        ``epochs=None`` is the round's local training: ``local-epochs``, capped at ``local-steps``.
        An explicit ``epochs`` (a method's other phases: fine-tuning, personal models, heads) is
        run in full. ``features``, one row per train sample, replaces the normalised images as
        ``model``'s input (a head trained on a frozen body's outputs)."""
        t = self.training
        inputs, normalize = ((self.data.train_x, self.data.normalize) if features is None
                             else (features, _identity))
        return train_local(
            model, inputs, self.data.train_y, normalize,
            optimizer=optimizer or self.make_optimizer(model.parameters(), server_round, stream),
            batch_size=t.batch_size, epochs=t.local_epochs if epochs is None else epochs,
            max_steps=t.local_steps if epochs is None else 0,
            generator=self.generator(server_round, stream), before_step=before_step)

    def make_optimizer(self, params: Iterable[torch.Tensor], server_round: int,
                       stream: int = STREAM_TRAIN) -> torch.optim.Optimizer:
        """The run's ``local-optimizer`` over ``params``; its randomness (GENIE's) is seeded by
        (seed, round, client, training stream)."""
        return self.training.optimizer(
            params, self.generator(server_round, STREAM_OPTIMIZER, stream))

    def batches(self, server_round: int, stream: int = STREAM_TRAIN, epochs: int | None = None,
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Normalised (inputs, targets) batches of the train split, in the seeded order
        :meth:`local_train` uses for the same ``(round, stream)``."""
        data = self.data
        for idx in self.batch_order(server_round, stream, epochs):
            yield data.normalize(data.train_x[idx]), data.train_y[idx]

    def batch_order(self, server_round: int, stream: int = STREAM_TRAIN,
                    epochs: int | None = None) -> Iterator[torch.Tensor]:
        """The index batches behind :meth:`batches` (the step cap as in :meth:`local_train`)."""
        t = self.training
        return batch_indices(self.data.num_train, t.batch_size,
                             t.local_epochs if epochs is None else epochs,
                             t.local_steps if epochs is None else 0,
                             self.generator(server_round, stream), self.data.train_x.device)

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
    def test(self, model: nn.Module) -> EvalStats:
        return evaluate(model, self.data.test_x, self.data.test_y, self.data.normalize)

    @staticmethod
    def eval_metrics(personal: EvalStats, global_: EvalStats | None = None,
                     ) -> dict[str, float | int]:
        """An evaluation reply: the personal model's counts and loss, and the global model's
        correct count when the method has one."""
        metrics: dict[str, float | int] = {
            NUM_TEST: personal.count, PERSONAL_CORRECT: personal.correct,
            PERSONAL_LOSS: personal.loss_sum / max(personal.count, 1)}
        if global_ is not None:
            metrics[GLOBAL_CORRECT] = global_.correct
            metrics[GLOBAL_LOSS] = global_.loss_sum / max(global_.count, 1)
        return metrics
