"""A researcher's own model: ``model = py:package.module:factory`` or ``py:FILE.py:factory``.

The factory is called as ``factory(input_shape, num_classes)`` (``input_shape``: one sample's
shape, e.g. ``(1, 28, 28)`` or ``(12,)``) and returns a ``torch.nn.Module`` whose output is
``batch x num_classes`` logits. It must build the same module every time (the run seeds torch
before calling it, so its random initial weights are the run's).

Methods that split the model into a body and a head (FedPer, FedRep, FedALA's layers, FedCP,
GPFL, FedDBE) take the head from the module's ``pflalign_head`` attribute (the name of a
``torch.nn.Linear`` submodule) or, without one, its last layer with parameters, which must then
be a ``torch.nn.Linear``; otherwise they refuse in one sentence. A method that needs batch norm
(FedBN) runs on a model that has some.

A file path is made absolute when the config is read, so that every process (each Ray worker of
the Flower engine, each SuperNode of a deployment on this machine) imports the same file; a
package module must be importable in every process (installed, or on ``PYTHONPATH``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from torch import nn

from pflalign.settings.options import ConfigError

PY = "py:"
#: the attribute a model may name its head submodule by
HEAD_ATTRIBUTE = "pflalign_head"
#: set on a user's model without a declared head whose last parameterised layer (in
#: registration order) is not the one that gives its output, so no method takes it for the head
LAST_LAYER_IS_NOT_OUTPUT = "_pflalign_last_layer_is_not_output"


def is_user_model(name: str) -> bool:
    return name.startswith(PY)


def _parts(name: str) -> tuple[str, str]:
    """``py:TARGET:ATTR`` -> (TARGET, ATTR), in one sentence if malformed."""
    target, sep, attr = name[len(PY):].rpartition(":")
    if not sep or not target or not attr.isidentifier():
        raise ConfigError(f"model = {name!r}: name a factory as py:package.module:function or "
                          "py:path/to/file.py:function.")
    return target, attr


def resolved(name: str) -> str:
    """``name`` with a file path made absolute (the same file for every process)."""
    target, attr = _parts(name)
    if target.endswith(".py"):
        return f"{PY}{Path(target).expanduser().resolve()}:{attr}"
    return name


def _module(target: str, name: str):
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ConfigError(f"model = {name!r}: the file {path} does not exist.")
        # one module per file, under a name of its own (a file imported twice is one module)
        module_name = "pflalign_user_model_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
        if module_name in sys.modules:
            return sys.modules[module_name]
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as err:
            del sys.modules[module_name]
            raise ConfigError(f"model = {name!r}: importing {path} failed: "
                              f"{type(err).__name__}: {err}") from err
        return module
    try:
        return importlib.import_module(target)
    except Exception as err:
        raise ConfigError(f"model = {name!r}: the module {target!r} cannot be imported "
                          f"({type(err).__name__}: {err}); install it or put its folder on "
                          "PYTHONPATH (every process of the run imports it).") from err


def factory(name: str) -> Callable[..., nn.Module]:
    """The factory ``model = name`` names (its module imported once per process)."""
    target, attr = _parts(name)
    module = _module(target, name)
    built = getattr(module, attr, None)
    if not callable(built):
        raise ConfigError(f"model = {name!r}: {target} has no callable {attr!r}.")
    return built


def build_user_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The user's model for this data, checked: a Module, whose output on a batch of two samples
    is two rows of ``num_classes`` logits."""
    import torch

    try:
        model = factory(name)(tuple(input_shape), num_classes)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"model = {name!r}: the factory raised {type(err).__name__}: {err} "
                          f"(called with input_shape={tuple(input_shape)}, "
                          f"num_classes={num_classes}).") from err
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model = {name!r}: the factory returned a {type(model).__name__}, not "
                          "a torch.nn.Module.")
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"model = {name!r}: the model has no trainable parameters.")
    was_training = model.training
    model.eval()
    # without a declared head, the head is the last parameterised layer: see that it is the
    # layer whose output is the model's (a classifier registered before its body is not)
    last = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))][-1]
    seen: list = []
    hook = last.register_forward_hook(lambda module, args, output: seen.append(output))
    # a batch of zeros as the model will get it: floats (images, feature vectors) or, for
    # one-dimensional samples that floats fail on, token indices
    dtypes = (torch.float32, torch.int64) if len(input_shape) == 1 else (torch.float32,)
    try:
        with torch.no_grad():
            for dtype in dtypes:
                try:
                    out = model(torch.zeros((2, *input_shape), dtype=dtype))
                    break
                except Exception:
                    if dtype is dtypes[-1]:
                        raise
    except Exception as err:
        raise ConfigError(f"model = {name!r}: the model fails on a batch of shape "
                          f"{(2, *input_shape)}: {type(err).__name__}: {err}") from err
    finally:
        model.train(was_training)
        hook.remove()
    if getattr(model, HEAD_ATTRIBUTE, None) is None:
        gives_output = bool(seen) and isinstance(seen[-1], torch.Tensor) and isinstance(
            out, torch.Tensor) and seen[-1].shape == out.shape and torch.equal(seen[-1], out)
        if not gives_output:
            setattr(model, LAST_LAYER_IS_NOT_OUTPUT, True)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(f"model = {name!r}: on a batch of 2 samples the model returns {shape}; "
                          f"it must return (2, {num_classes}) logits, one per class.")
    return model
