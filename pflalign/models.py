"""Model registry: build a model by name for a given input shape and number of classes."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pflalign.options import ConfigError


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


def _resnet18(in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    """torchvision's ResNet-18 for small images: a 3x3 stride-1 stem and no stem max-pool."""
    import torchvision

    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


ModelFactory = Callable[[int, int, int], nn.Module]
MODELS: dict[str, ModelFactory] = {
    "cnn": lambda c, s, k: CNN(c, s, k),
    "cnn-bn": lambda c, s, k: CNN(c, s, k, batch_norm=True),
    "mlp": lambda c, s, k: MLP(c * s * s, k),
    "resnet18": _resnet18,
}


def build_model(name: str, input_shape: tuple[int, int, int], num_classes: int,
                seed: int | None = None) -> nn.Module:
    """Build a registered model; with ``seed`` its initial weights are reproducible."""
    if name not in MODELS:
        raise ConfigError(f"Unknown model '{name}'; choose one of: {', '.join(MODELS)}.")
    channels, height, width = input_shape
    if height != width:
        raise ConfigError(f"Model '{name}' expects square images, got {height} x {width}.")
    if seed is None:
        return MODELS[name](channels, height, num_classes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODELS[name](channels, height, num_classes)


def parameter_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that own parameters directly (a layer, not a container), in registration order."""
    return [(name, module) for name, module in model.named_modules()
            if any(True for _ in module.parameters(recurse=False))]


def _entries(prefix: str, module: nn.Module) -> list[str]:
    return [f"{prefix}.{name}" if prefix else name
            for name, _ in [*module.named_parameters(recurse=False),
                            *module.named_buffers(recurse=False)]]


def head_keys(model: nn.Module, layers: int = 1) -> tuple[str, ...]:
    """State-dict keys of the model's head: its last ``layers`` parameterised layers (for the
    registered models, ``layers = 1`` is the final linear classifier ``fc``)."""
    modules = parameter_modules(model)
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
