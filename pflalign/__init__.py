"""pflalign: a federated personalization simulator (the core library; never imports flwr).

What a user imports from here (each name is loaded when first used, so importing one module of
the library loads nothing else):

- the optimizers, ``torch.optim.Optimizer`` classes over public functional cores:
  :class:`PFLAlign` and :func:`pflalign_update` (docs/algorithms.md 1.4), :class:`GENIE` and
  :func:`genie_update` (docs/algorithms.md 2.3);
- the model loader :func:`build_model` (a registered model, ``py:module:factory`` of your own, or
  ``hf:<model>`` with LoRA adapters);
- the settings and a run: :func:`build_settings` (a config as typed settings, checked once) and
  :func:`simulate` (every method entry of the settings, on their engine);
- the trained models a run saved (``save-models``): :func:`load_model` (a client's personal
  model, or the global model, as a ready ``nn.Module``);
- the registries: :data:`METHODS` (every method and variant) and :data:`FEATURES` (the round
  features).

Beside it, the Flower side: ``from strategies import PFLAlign`` (every method as a Flower
strategy), ``from clients import answer`` (a method's client side for a ClientApp of your own,
with your model and data loaders) and ``from clients.app import app`` (the project's ClientApp).
"""

from importlib import import_module

__version__ = "0.1.0"

#: the public names, and the module each is loaded from
_PUBLIC = {
    "PFLAlign": "pflalign.training.optim", "pflalign_update": "pflalign.training.optim",
    "GENIE": "pflalign.training.optim", "genie_update": "pflalign.training.optim",
    "build_model": "pflalign.models.registry",
    "build_settings": "pflalign.run.config", "simulate": "pflalign.run.driver",
    "load_model": "pflalign.run.models",
    "METHODS": "pflalign.methods.registry", "FEATURES": "pflalign.round.feature",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> object:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'pflalign' has no attribute {name!r}")
    value = getattr(import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
