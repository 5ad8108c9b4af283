"""Model registry: build a model by name for a given input shape and number of classes; the
run's model template, which hands out copies."""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from pflalign.models.language import LoraSpec, build_adapter_model, is_language_model
from pflalign.models.user import (
    HEAD_ATTRIBUTE,
    LAST_LAYER_IS_NOT_OUTPUT,
    build_user_model,
    is_user_model,
)
from pflalign.process.caches import cached
from pflalign.settings.options import ConfigError
from pflalign.settings.schema import FEATURES, IMAGE, TOKENS


class CNN(nn.Module):
    """The 4-layer CNN of McMahan et al. as used by PFLlib (``FedAvgCNN``).

    conv 5x5 (32) -> ReLU -> max-pool 2 -> conv 5x5 (64) -> ReLU -> max-pool 2 -> fc 512 -> ReLU ->
    fc classes. 582,026 parameters on 28 x 28 greyscale inputs with 10 classes. With
    ``batch_norm`` (``cnn-bn``) a BatchNorm2d follows each convolution (for FedBN-style methods).
    """

    def __init__(self, in_channels: int, image_size: int, num_classes: int,
                 batch_norm: bool = False):
        super().__init__()

        def norm(channels: int) -> nn.Module:
            return nn.BatchNorm2d(channels) if batch_norm else nn.Identity()

        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, kernel_size=5), norm(32), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=5), norm(64), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        )
        side = ((image_size - 4) // 2 - 4) // 2
        self.fc1 = nn.Sequential(nn.Flatten(), nn.Linear(64 * side * side, 512),
                                 nn.ReLU(inplace=True))
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.fc1(self.features(x)))


class MLP(nn.Module):
    """Two hidden layers of 200 units (McMahan et al.'s "2NN")."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 200):
        super().__init__()
        self.body = nn.Sequential(
            nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True),
        )
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x))


class CharLSTM(nn.Module):
    """LEAF's next-character model for Shakespeare (Caldas et al. 2018; McMahan et al. 2017): an
    embedding of 8 per symbol, two LSTM layers of 256, and a linear layer from the last step's
    output to the ``vocabulary`` logits. 819,920 parameters with the 80-symbol vocabulary."""

    def __init__(self, vocabulary: int, embedding: int = 8, hidden: int = 256, layers: int = 2):
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, embedding)
        self.lstm = nn.LSTM(embedding, hidden, num_layers=layers, batch_first=True)
        self.fc = nn.Linear(hidden, vocabulary)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs, _ = self.lstm(self.embedding(x))
        return self.fc(outputs[:, -1])


def _resnet18(in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    """torchvision's ResNet-18 for small images: a 3x3 stride-1 stem and no stem max-pool."""
    import torchvision

    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def _image_model(factory: Callable[[int, int, int], nn.Module],
                 ) -> Callable[[str, tuple[int, ...], int], nn.Module]:
    """A model of square images (channels, side, classes) as a factory of (name, input shape,
    classes) that refuses other inputs in one sentence."""
    def build(name: str, shape: tuple[int, ...], num_classes: int) -> nn.Module:
        if len(shape) != 3 or shape[1] != shape[2]:
            raise ConfigError(f"Model '{name}' takes square images (channels x side x side), "
                              f"but the dataset's samples have shape {tuple(shape)}: "
                              f"{_INPUT_HINT}")
        return factory(shape[0], shape[1], num_classes)
    return build


def _mlp(name: str, shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """McMahan et al.'s 2NN on flattened images or on feature vectors."""
    if len(shape) not in (1, 3):
        raise ConfigError(f"Model '{name}' takes images (channels x height x width) or feature "
                          f"vectors, but the dataset's samples have shape {tuple(shape)}: "
                          f"{_INPUT_HINT}")
    return MLP(math.prod(shape), num_classes)


def _sequence_model(name: str, shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if len(shape) != 1:
        raise ConfigError(f"Model '{name}' takes sequences of token indices, but the dataset's "
                          f"samples have shape {tuple(shape)}: {_INPUT_HINT}")
    return CharLSTM(num_classes)


ModelFactory = Callable[[str, tuple[int, ...], int], nn.Module]


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: how to build it, what it takes, and its batch norm."""

    build: ModelFactory
    #: the kinds of samples it takes (:data:`~pflalign.settings.schema.DATASETS`' kinds)
    takes: tuple[str, ...]
    #: it has batch-norm layers (a method that needs batch norm can run on it)
    batch_norm: bool = False
    #: the registered model with batch norm that a method needing it runs on instead
    batch_norm_version: str | None = None


#: every registered model: the one table of them (``hf:<model>`` language models aside)
MODELS: dict[str, ModelSpec] = {
    "cnn": ModelSpec(_image_model(lambda c, s, k: CNN(c, s, k)), (IMAGE,),
                     batch_norm_version="cnn-bn"),
    "cnn-bn": ModelSpec(_image_model(lambda c, s, k: CNN(c, s, k, batch_norm=True)), (IMAGE,),
                        batch_norm=True),
    "mlp": ModelSpec(_mlp, (IMAGE, FEATURES)),
    "resnet18": ModelSpec(_image_model(_resnet18), (IMAGE,), batch_norm=True),
    "char-lstm": ModelSpec(_sequence_model, (TOKENS,)),
}
_INPUT_HINT = "; ".join(
    f"choose {', '.join(m for m, spec in MODELS.items() if kind in spec.takes)} for {noun}"
    for kind, noun in ((IMAGE, "images"), (TOKENS, "text"), (FEATURES, "feature vectors"))) + "."


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int,
                seed: int | None = None, lora: LoraSpec | None = None) -> nn.Module:
    """Build a registered model, or ``hf:<model>`` with the adapters ``lora``
    (:mod:`pflalign.models.language`); with ``seed`` its initial weights are reproducible."""
    if not is_language_model(name) and not is_user_model(name) and name not in MODELS:
        raise ConfigError(f"Unknown model '{name}'; choose one of: {', '.join(MODELS)}, "
                          "hf:<model>, or py:module:factory (your own).")

    def build() -> nn.Module:
        if is_language_model(name):
            return build_adapter_model(name, lora or LoraSpec())
        if is_user_model(name):
            return build_user_model(name, tuple(int(d) for d in input_shape), num_classes)
        return MODELS[name].build(name, tuple(int(d) for d in input_shape), num_classes)

    if seed is None:
        return build()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def parameter_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that own parameters directly (a layer, not a container), in registration order."""
    return [(name, module) for name, module in model.named_modules()
            if any(True for _ in module.parameters(recurse=False))]


def head_of(model: nn.Module) -> tuple[str, nn.Module]:
    """The model's classifier head and its name: the linear submodule its ``pflalign_head``
    attribute names, or else its last parameterised layer, which must be linear (every
    registered model's ``fc``). A method that splits a body from a head refuses a model
    without one, in one sentence."""
    declared = getattr(model, HEAD_ATTRIBUTE, None)
    if declared is not None:
        try:
            head = model.get_submodule(str(declared))
        except AttributeError:
            raise ConfigError(f"The model's {HEAD_ATTRIBUTE} = {declared!r} names no submodule "
                              "of it.") from None
        if not isinstance(head, nn.Linear):
            raise ConfigError(f"The model's {HEAD_ATTRIBUTE} = {declared!r} is a "
                              f"{type(head).__name__}; the head must be a torch.nn.Linear.")
        return str(declared), head
    name, head = parameter_modules(model)[-1]
    if not isinstance(head, nn.Linear):
        raise ConfigError(f"This method splits the model into a body and a linear head, and the "
                          f"model's last layer with parameters, {name!r}, is a "
                          f"{type(head).__name__}: set {HEAD_ATTRIBUTE} = '<name of its "
                          "nn.Linear classifier>' on the model, or choose another method.")
    if getattr(model, LAST_LAYER_IS_NOT_OUTPUT, False):
        raise ConfigError(f"This method splits the model into a body and a linear head, and the "
                          f"model's last layer with parameters, {name!r}, is not the one that "
                          f"gives its output: set {HEAD_ATTRIBUTE} = '<name of its nn.Linear "
                          "classifier>' on the model, or choose another method.")
    return name, head


@contextlib.contextmanager
def without_head(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` with its head replaced by the identity, so that it returns its features."""
    name, head = head_of(model)
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, nn.Identity())
    try:
        yield model
    finally:
        setattr(parent, attr, head)


def _entries(prefix: str, module: nn.Module) -> list[str]:
    return [f"{prefix}.{name}" if prefix else name
            for name, _ in [*module.named_parameters(recurse=False),
                            *module.named_buffers(recurse=False)]]


def head_keys(model: nn.Module, layers: int = 1) -> tuple[str, ...]:
    """State-dict keys of the model's head: its last ``layers`` parameterised layers (for the
    registered models, ``layers = 1`` is the final linear classifier ``fc``). A language model's
    head is the adapters of its last ``layers`` adapted modules (its own state is its adapters;
    with lora-targets q_proj,v_proj, ``layers = 1`` is the last block's v_proj adapters)."""
    adapters = getattr(model, "adapters", None)
    if adapters is not None:
        owners = list(dict.fromkeys(key.split(".lora_")[0] for key in adapters))
        if not 1 <= layers < len(owners):
            raise ConfigError(f"The model has {len(owners)} adapted modules; a head of {layers} "
                              f"must leave a body: choose 1..{len(owners) - 1}.")
        chosen = set(owners[-layers:])
        return tuple(key for key in adapters if key.split(".lora_")[0] in chosen)
    head_name, _ = head_of(model)
    # the head, and before it the other parameterised layers in registration order
    head = model.get_submodule(head_name)
    modules = [m for m in parameter_modules(model) if m[1] is not head] + [(head_name, head)]
    if not 1 <= layers < len(modules):
        raise ConfigError(f"The model has {len(modules)} parameterised layers; a head of {layers} "
                          f"must leave a body: choose 1..{len(modules) - 1}.")
    return tuple(key for name, module in modules[-layers:] for key in _entries(name, module))


def batch_norm_keys(model: nn.Module) -> tuple[str, ...]:
    """State-dict keys (affine parameters and running statistics) of every batch-norm layer."""
    return tuple(key for name, module in model.named_modules()
                 if isinstance(module, nn.modules.batchnorm._BatchNorm)
                 for key in _entries(name, module))


def is_deterministic_in_training(model: nn.Module) -> bool:
    """True when train mode computes the same function as eval mode (no batch norm, no dropout),
    so activations can be computed once and reused across epochs."""
    return not any(isinstance(m, nn.modules.batchnorm._BatchNorm | nn.modules.dropout._DropoutNd)
                   for m in model.modules())


class ModelTemplate:
    """The run's initial model (seeded; identical on the server and every client), shared by
    every client of a process and changed by none: it is never handed out. :meth:`new` gives a
    copy to train, :meth:`initial_state` a copy of its values, :attr:`layout` a copy on the
    meta device (the model's structure, without values) for looking up layers and names, and
    :meth:`trainer` and :meth:`scorer` reused modules to train and to score a model's state
    with (never handed to a method's rule)."""

    def __init__(self, model: nn.Module):
        self._model = model
        #: the model's structure (layers, names, shapes) on the meta device: no values (a
        #: language model builds its own: its copies share the frozen base's tensors)
        self.layout = (model.meta_copy() if hasattr(model, "meta_copy")
                       else copy.deepcopy(model).to("meta"))
        #: the parameters that train, in the model's order
        self.trainable = tuple(n for n, p in model.named_parameters() if p.requires_grad)
        #: whether training draws dropout masks (from torch's global generator)
        self.has_dropout = any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
                               for m in model.modules())
        self._scorers: dict[str, tuple[_Reloadable, Mapping[str, torch.Tensor]]] = {}
        self._trainers: dict[str, _Reloadable] = {}

    def new(self, state: Mapping[str, torch.Tensor] | None = None,
            device: torch.device | str = "cpu") -> nn.Module:
        """A fresh copy of the model, loaded with ``state`` if given, on ``device``."""
        model = copy.deepcopy(self._model)
        if state is not None:
            model.load_state_dict(state)
        return model.to(device)

    def initial_state(self) -> dict[str, torch.Tensor]:
        """A copy of the initial model's state dict."""
        return {k: v.clone() for k, v in self._model.state_dict().items()}

    def trainer(self, state: Mapping[str, torch.Tensor], device: torch.device | str = "cpu",
                ) -> nn.Module:
        """A module loaded with ``state`` for one run of local training (the per-client
        executor's, :meth:`pflalign.training.client.ClientRuntime.execute`): one module per device,
        reused from run to run (its gradients cleared), so that a run copies no model
        structure; whatever a run returns is copied out of it."""
        key = str(device)
        if key not in self._trainers:
            self._trainers[key] = _Reloadable(self.new(device=device))
        trainer = self._trainers[key]
        for p in trainer.module.parameters():
            p.grad = None
        trainer.load(state)
        return trainer.module

    def scorer(self, state: Mapping[str, torch.Tensor], device: torch.device | str = "cpu",
               ) -> nn.Module:
        """A module loaded with ``state`` for scoring it (evaluation only): one module per
        device, reused, loaded again only when ``state`` is another object than the last one
        (the same global model scored for a thousand clients is loaded once)."""
        key = str(device)
        scorer, last = self._scorers.get(key, (None, None))
        if scorer is None:
            scorer = _Reloadable(self.new(device=device))
        if last is not state:
            scorer.load(state)
        self._scorers[key] = (scorer, state)  # the state is kept, so that its id is not reused
        return scorer.module


class _Reloadable:
    """A module whose whole state is loaded again and again: one multi-tensor copy into its
    tensors, in state-dict order (``load_state_dict`` copies the same values, entry by entry
    through every submodule, several times slower for a small model)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.tensors = module.state_dict(keep_vars=True)

    @torch.no_grad()
    def load(self, state: Mapping[str, torch.Tensor]) -> None:
        sources = []
        for key, target in self.tensors.items():
            value = state.get(key)
            if value is not None and value.shape != target.shape and target.dim() == 0 \
                    and value.shape == (1,):  # a 0-d entry serialized as 1-d, as load_state_dict
                value = value.reshape(())
            if value is None or value.shape != target.shape:
                sources = None
                break
            sources.append(value)
        if sources is None or len(state) != len(self.tensors):
            self.module.load_state_dict(state)  # its error names the key and what is wrong
            return
        torch._foreach_copy_([t.data for t in self.tensors.values()], sources)


@cached(maxsize=4)
def model_template(name: str, input_shape: tuple[int, ...], num_classes: int,
                   seed: int, lora: LoraSpec | None = None) -> ModelTemplate:
    """The run's model template, built once per process."""
    return ModelTemplate(build_model(name, tuple(input_shape), num_classes, seed=seed,
                                     lora=lora))
