"""Loading the models a run saved (``save-models``).

The files and the manifest are :mod:`pflalign.outputs.models`'; here they become modules again:
:func:`load_model` rebuilds a client's personal model (the method's scored module, loaded with
its saved entries) or the global model, from the manifest's settings alone (the data is not
read).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from pflalign.data.datasets import input_transform
from pflalign.methods.registry import METHODS
from pflalign.models.language import LoraSpec
from pflalign.models.registry import model_template
from pflalign.outputs.models import (
    GLOBAL,
    SavedModel,
    check_fingerprint,
    client_entry,
    find_entry,
    read_arrays,
)
from pflalign.run.config import build_settings
from pflalign.settings.options import ConfigError
from pflalign.settings.schema import Settings


def entry_settings(manifest: Mapping) -> Settings:
    """The method entry's settings as the run resolved them."""
    return build_settings(manifest["settings"], source=f"{manifest['label']}'s manifest",
                          follow=frozenset())


def _base_model(manifest: Mapping, settings: Settings) -> nn.Module:
    """A fresh copy of the run's model (its initial weights: a language model's frozen base)."""
    model = manifest["model"]
    template = model_template(model["name"], tuple(model["input-shape"]), model["num-classes"],
                              settings.run.seed, LoraSpec.of(settings.run))
    return template.new()


def _inputs(manifest: Mapping):
    inputs = manifest["inputs"]
    return input_transform(inputs["kind"], tuple(inputs["mean"]), tuple(inputs["std"]))


def load_model(out_dir: str | Path, method: str | None = None,
               client: int | str | None = None) -> SavedModel:
    """The model a run saved in ``out_dir`` (``save-models``): client ``client``'s personal
    model (by id, or by its name where the data names clients), or the global model when
    ``client`` is None; of ``method`` (an entry's label, or a method's name), which may be left
    out when the run had one entry. Returns a :class:`SavedModel` in eval mode, on the CPU."""
    out = Path(out_dir)
    folder, manifest = find_entry(out, method)
    check_fingerprint(out, folder, manifest)
    settings = entry_settings(manifest)
    if client is not None:
        return client_model(folder, manifest, settings, client_entry(manifest, client))
    if not manifest.get("global"):
        raise ConfigError(f"{manifest['label']} has no global model that scores a client "
                          "(its clients keep their own); name a client with client=.")
    model = _base_model(manifest, settings)
    arrays = read_arrays(folder / GLOBAL)
    state = {k.partition("/")[2]: torch.from_numpy(v) for k, v in arrays.items()
             if k.startswith("model/")}
    model.load_state_dict({**model.state_dict(), **state})
    return SavedModel(model, _inputs(manifest), manifest, None, None).eval()


def client_model(folder: Path, manifest: Mapping, settings: Settings,
                 record: Mapping) -> SavedModel:
    """The saved personal model of the client ``record`` (the manifest's) in the entry's models
    ``folder``, its ``settings`` (:func:`entry_settings`) given, so that loading many clients
    reads the manifest and builds the settings once."""
    built = METHODS[manifest["method"]].build(settings)
    module = built.scored_module(_base_model(manifest, settings),
                                 manifest["model"]["num-classes"])
    state = {k: torch.from_numpy(v) for k, v in read_arrays(folder / record["file"]).items()}
    expected = module.state_dict()
    unknown = [k for k in state if k not in expected]
    if unknown:
        raise ConfigError(f"{folder / record['file']} holds entries this model does not have "
                          f"({', '.join(unknown[:3])}); it was written for another model.")
    module.load_state_dict({**expected, **state})
    return SavedModel(module, _inputs(manifest), manifest, record["id"],
                      record.get("name")).eval()
