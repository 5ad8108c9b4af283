"""What every method's client half shares: its data, its persistent state, models, local training.

A ClientApp object does not survive between messages, so a :class:`ClientMethod` is built for each
message. What must persist lives in the node's ``context.state`` (:class:`ClientState`); the data
and the partition are cached per process by :func:`pflalign.federation.federated_dataset`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from torch import nn

from pflalign.config import Settings
from pflalign.federation import federated_dataset
from pflalign.gga import candidate_statistics
from pflalign.models import build_model, is_deterministic_in_training, parameter_modules
from pflalign.train import (
    STREAM_GGA,
    STREAM_OPTIMIZER,
    STREAM_TRAIN,
    EvalStats,
    TrainStats,
    batch_indices,
    evaluate,
    make_generator,
    make_local_optimizer,
    train_local,
)

TorchState = dict[str, torch.Tensor]


class ClientState:
    """A method's namespace in the node's persistent ``context.state``.

    Keys are ``<method>.<name>``. Methods run one after another in a comparison, so when a client
    starts serving a method it drops what earlier methods left behind (less to carry per message).
    """

    def __init__(self, records: RecordDict, namespace: str):
        self.records = records
        self.prefix = f"{namespace}."
        for key in [k for k in records if not k.startswith(self.prefix)]:
            del records[key]

    def get_arrays(self, name: str) -> TorchState | None:
        record = self.records.array_records.get(self.prefix + name)
        return None if record is None else record.to_torch_state_dict()

    def set_arrays(self, name: str, state: Mapping[str, torch.Tensor]) -> None:
        self.records[self.prefix + name] = ArrayRecord(
            {k: v.detach().cpu() for k, v in state.items()})

    def get_metrics(self, name: str) -> dict[str, float] | None:
        record = self.records.metric_records.get(self.prefix + name)
        return None if record is None else dict(record)

    def set_metrics(self, name: str, values: Mapping[str, float | int]) -> None:
        self.records[self.prefix + name] = MetricRecord(dict(values))


_TEMPLATES: dict[tuple, nn.Module] = {}


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass
class RoundInput:
    """What a message brings a client: its array records (as torch state dicts) and config."""

    server_round: int
    records: dict[str, TorchState] = field(default_factory=dict)
    config: dict[str, object] = field(default_factory=dict)

    @property
    def global_state(self) -> TorchState | None:
        """The ``arrays`` record: the global model (or what the strategy sends in its place)."""
        return self.records.get("arrays")


@dataclass
class FitResult:
    """What a client's training returns: its model (None if nothing is uploaded) and metrics."""

    state: Mapping[str, torch.Tensor] | None
    metrics: dict[str, float | int] = field(default_factory=dict)
    #: further array records uploaded beside the model (SCAFFOLD's control-variate change)
    records: dict[str, Mapping[str, torch.Tensor]] = field(default_factory=dict)


class ClientMethod:
    """Base client half. Subclasses implement :meth:`fit` and :meth:`evaluate`."""

    def __init__(self, settings: Settings, client_id: int, state: ClientState,
                 device: torch.device):
        self.settings = settings
        self.client_id = client_id
        self.state = state
        self.device = device
        self.federation = federated_dataset(settings)
        self.data = self.federation.client_data(client_id, device)

    # --- helpers shared by methods -------------------------------------------------------------
    def new_model(self, state: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
        """A fresh model (a copy of a per-process template), loaded with ``state`` if given."""
        model = copy.deepcopy(self.template())
        if state is not None:
            model.load_state_dict(state)
        return model.to(self.device)

    def template(self) -> nn.Module:
        """The run's initial model (seeded; identical to the server's), cached per process.
        Read-only: :meth:`new_model` hands out copies."""
        ds = self.federation.dataset
        key = (self.settings["model"], ds.input_shape, ds.num_classes, int(self.settings["seed"]))
        if key not in _TEMPLATES:
            _TEMPLATES[key] = build_model(str(key[0]), ds.input_shape, ds.num_classes,
                                          seed=key[3])
        return _TEMPLATES[key]

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
        s = self.settings
        inputs, normalize = ((self.data.train_x, self.data.normalize) if features is None
                             else (features, _identity))
        return train_local(
            model, inputs, self.data.train_y, normalize,
            optimizer=optimizer or self.make_optimizer(model.parameters(), server_round, stream),
            batch_size=int(s["batch-size"]),
            epochs=int(s["local-epochs"]) if epochs is None else epochs,
            max_steps=int(s["local-steps"]) if epochs is None else 0,
            generator=make_generator(int(s["seed"]), server_round, self.client_id, stream),
            before_step=before_step)

    def make_optimizer(self, params: Iterable[torch.Tensor], server_round: int,
                       stream: int = STREAM_TRAIN) -> torch.optim.Optimizer:
        """The run's ``local-optimizer`` over ``params``; its randomness (GENIE's) is seeded by
        (seed, round, client, training stream)."""
        return make_local_optimizer(params, self.settings, make_generator(
            int(self.settings["seed"]), server_round, self.client_id, STREAM_OPTIMIZER, stream))

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
        s = self.settings
        return batch_indices(self.data.num_train, int(s["batch-size"]),
                             int(s["local-epochs"]) if epochs is None else epochs,
                             int(s["local-steps"]) if epochs is None else 0,
                             make_generator(int(s["seed"]), server_round, self.client_id, stream),
                             self.data.train_x.device)

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
        captured: list[torch.Tensor] = []
        hook = head.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
        was_training = model.training
        try:
            model.eval()
            for start in range(0, len(chosen), 256):
                model(data.normalize(data.train_x[chosen[start:start + 256]]))
        finally:
            hook.remove()
            model.train(was_training)
        return torch.cat(captured)

    def test(self, model: nn.Module) -> EvalStats:
        return evaluate(model, self.data.test_x, self.data.test_y, self.data.normalize)

    @staticmethod
    def eval_metrics(personal: EvalStats, global_: EvalStats | None = None) -> dict:
        metrics: dict[str, float | int] = {
            "num-test": personal.count, "personal-correct": personal.correct,
            "personal-loss": personal.loss_sum / max(personal.count, 1)}
        if global_ is not None:
            metrics["global-correct"] = global_.correct
        return metrics

    def gga_statistics(self, inputs: RoundInput) -> tuple[list[float], torch.Tensor]:
        """This client's answer to an annealing round of the federated warm start
        (:func:`pflalign.gga.candidate_statistics`): the global model (shared entries over the
        run's initial model), ``gga-batch-size`` of its train samples drawn by (seed, round,
        client), the candidates named by the server's seed."""
        s = self.settings
        model = self.new_model()
        model.load_state_dict(inputs.global_state, strict=False)
        model.train()
        gen = make_generator(int(s["seed"]), inputs.server_round, self.client_id, STREAM_GGA)
        idx = torch.randperm(self.data.num_train, generator=gen)[:int(s["gga-batch-size"])]
        idx = idx.to(self.data.train_x.device)
        perturb = [n for n in str(inputs.config["gga-perturb"]).split(",") if n]
        return candidate_statistics(
            model, self.data.normalize(self.data.train_x[idx]), self.data.train_y[idx], perturb,
            seed=int(s["seed"]), server_round=inputs.server_round,
            candidates=int(inputs.config["gga-candidates"]), rho=float(s["gga-rho"]),
            sketch_dim=int(s["gga-sketch-dim"]))

    # --- the method's two actions --------------------------------------------------------------
    def fit(self, inputs: RoundInput) -> FitResult:
        raise NotImplementedError

    def evaluate(self, inputs: RoundInput) -> dict:
        raise NotImplementedError
