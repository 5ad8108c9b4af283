"""The trained models a run gives back (``save-models``), and loading them again.

A run with ``save-models = final`` (the default) writes, per method entry, under
``<out-dir>/models/<entry>/``:

- ``clients/<id>.safetensors``: each client's personal model, the model its final evaluation
  scored (fedavg-ft's fine-tuned model, FedRep's personal head on the shared body, Ditto's
  personal model, pFLAlign's model right after its last training, FedDBE's, GPFL's and FedCP's
  own modules around the run's model: :meth:`~pflalign.methods.base.Method.scored_module`), every
  entry but a language model's frozen base weights;
- ``global.safetensors``: the server's state after the last round (the global model under
  ``model/<entry>``, and whatever else the method keeps on the server);
- ``manifest.json``: the method and its settings, the config's fingerprint
  (:func:`models_fingerprint`), the round, the model and how its inputs
  are prepared, the class names, and per client its id, name, file and final metrics.

:func:`pflalign.run.models.load_model` rebuilds one of them as a ready :class:`SavedModel` (an
``nn.Module`` that takes the data as it is stored: uint8 images, float features, token ids), and
``pflalign-evaluate`` (:mod:`pflalign.run.evaluate`) scores every saved client model on data
given later. A deployed SuperNode keeps its own client's model in its node directory instead
(``clients/app.py``); the manifest lists those clients under ``on-node``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pflalign.outputs.results import slug
from pflalign.settings.fingerprint import entry_fingerprint
from pflalign.settings.options import ConfigError
from pflalign.settings.schema import EngineConfig
from pflalign.wire.protocol import NUM_TEST, PERSONAL_CORRECT, PERSONAL_LOSS
from pflalign.wire.state import atomic_write

#: where the models of a run writing to ``out-dir`` live
DIRECTORY = "models"
MANIFEST = "manifest.json"
GLOBAL = "global.safetensors"
#: the manifest's format, raised when its meaning changes
FORMAT = 1


def entry_dir(out_dir: str | Path, label: str) -> Path:
    """The folder of method entry ``label``'s models in a run's ``out_dir``."""
    return Path(out_dir) / DIRECTORY / slug(label)


def client_file(cid: int) -> str:
    return f"clients/{int(cid)}.safetensors"


def write_arrays(path: Path, arrays: Mapping[str, np.ndarray],
                 metadata: Mapping[str, str] | None = None) -> None:
    """Write ``arrays`` as a safetensors file at ``path``, atomically
    (:func:`~pflalign.wire.state.atomic_write`)."""
    from safetensors.numpy import save

    data = save({k: np.ascontiguousarray(v) for k, v in arrays.items()},
                metadata=dict(metadata or {}))
    atomic_write(path, lambda handle: handle.write(data))


def read_arrays(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))


def write_manifest(folder: Path, manifest: Mapping) -> Path:
    path = folder / MANIFEST
    text = (json.dumps(manifest, indent=1) + "\n").encode()
    atomic_write(path, lambda handle: handle.write(text))
    return path


# --- loading ------------------------------------------------------------------------------------
class SavedModel(nn.Module):
    """A saved model, ready to use: ``forward`` takes a batch as the data stores it (uint8
    images N x C x H x W, float feature vectors N x D, token ids) and returns the model's outputs
    (class logits). ``module`` is the model itself (it takes prepared inputs) and ``inputs`` what
    prepares them, so that ``module(inputs(x))`` is exactly what the run computed. Its
    attributes name what it is: ``method``, ``label``, ``client`` and ``client_name`` (None for
    the global model), ``class_names``, a table's ``feature_names`` (the columns its inputs are,
    in order) and the whole ``manifest``."""

    def __init__(self, module: nn.Module, inputs, manifest: Mapping, client: int | None,
                 client_name: str | None):
        super().__init__()
        self.module = module
        self.inputs = inputs
        self.manifest = dict(manifest)
        self.method, self.label = manifest["method"], manifest["label"]
        self.client, self.client_name = client, client_name
        self.class_names = tuple(manifest.get("class-names") or ())
        #: a table's feature columns, in the order ``forward`` takes them (empty: not a table)
        self.feature_names = tuple(manifest.get("feature-names") or ())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(self.inputs(x))


def _manifests(out_dir: Path) -> dict[str, tuple[Path, dict]]:
    root = out_dir / DIRECTORY
    found = {}
    for path in sorted(root.glob(f"*/{MANIFEST}")) if root.is_dir() else []:
        manifest = json.loads(path.read_text())
        found[manifest["label"]] = (path.parent, manifest)
    return found


def find_entry(out_dir: str | Path, method: str | None = None) -> tuple[Path, dict]:
    """The models folder and manifest of ``method`` (an entry's label, or a method's name when
    one entry runs it) in ``out_dir``; the only entry when ``method`` is None."""
    out = Path(out_dir)
    entries = _manifests(out)
    if not entries:
        raise ConfigError(f"{out} holds no saved models (no {DIRECTORY}/*/{MANIFEST}); run with "
                          "save-models = final (the default) to write them.")
    if method is None:
        if len(entries) > 1:
            raise ConfigError(f"{out} holds the models of {len(entries)} method entries "
                              f"({', '.join(entries)}); name one with method=.")
        return next(iter(entries.values()))
    if method in entries:
        return entries[method]
    named = [e for e in entries.values() if e[1]["method"] == method]
    if len(named) == 1:
        return named[0]
    raise ConfigError(f"{out} holds no saved models of {method!r}"
                      + (f" alone ({len(named)} entries run it: name one by its label)" if named
                         else "") + f"; it holds {', '.join(entries)}.")


def check_fingerprint(out_dir: Path, folder: Path, manifest: Mapping) -> None:
    """Refuse a models folder that another config wrote: its manifest's fingerprint must be the
    one its entry has in ``out_dir``'s results.json."""
    results = out_dir / "results.json"
    if not results.is_file():
        return
    entry = json.loads(results.read_text()).get("methods", {}).get(manifest["label"])
    recorded = (entry or {}).get("models", {}).get("fingerprint")
    if recorded is not None and recorded != manifest["fingerprint"]:
        raise ConfigError(f"{folder} was written by another config (fingerprint "
                          f"{manifest['fingerprint']}) than the results in {out_dir} "
                          f"(fingerprint {recorded}); use the models folder of that run.")


def client_entry(manifest: Mapping, client: int | str) -> dict:
    """The manifest's record of ``client``: an id, or a client's name."""
    records = manifest["clients"]
    if isinstance(client, str) and not client.lstrip("-").isdigit():
        match = [c for c in records if c.get("name") == client]
    else:
        match = [c for c in records if c["id"] == int(client)]
    if not match:
        names = [str(c.get("name", c["id"])) for c in records[:8]]
        on_node = client in manifest.get("on-node", []) if isinstance(client, int) else False
        raise ConfigError(
            f"no saved model of client {client!r} for {manifest['label']}"
            + ("; its SuperNode kept it in its node directory" if on_node else "")
            + f" (saved: {', '.join(names)}{' ...' if len(records) > 8 else ''}).")
    return match[0]


def models_fingerprint(settings: Mapping[str, object], label: str) -> str:
    """The fingerprint of the config that trained a method entry's saved models: a hash of its
    settings without those that change nothing it computes (the output keys, keys added later at
    their old value) nor the engine's (every engine computes the same models)."""
    engine = set(EngineConfig.keys().values())
    return entry_fingerprint({k: v for k, v in settings.items() if k not in engine}, label)


# --- a deployed SuperNode's own model -----------------------------------------------------------
def save_node_model(root: Path, settings, label: str, method: str, node, arrays: Mapping,
                    metrics: Mapping[str, float], server_round: int) -> Path:
    """Write a deployed node's personal model (``arrays``, the evaluation's scored model) and a
    manifest of its own under ``root`` (the node's models folder), as a run's out-dir holds
    them: ``load_model(root, label, client)`` loads it. Returns the model's file."""
    folder = entry_dir(root, label)
    cid = int(node.client_id)
    file = client_file(cid)
    write_arrays(folder / file, {k: np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach")
                                               else v) for k, v in arrays.items()},
                 {"client": str(cid), "round": str(server_round)})
    count = int(metrics[NUM_TEST])
    write_manifest(folder, {
        "format": FORMAT, "label": label, "method": method,
        "fingerprint": models_fingerprint(settings, label), "round": server_round,
        "model": {"name": settings.run.model, "input-shape": list(node.input_shape),
                  "num-classes": node.num_classes},
        "inputs": dict(node.inputs), "class-names": [],
        "settings": settings.to_dict(), "global": None, "server-state": None,
        "clients": [{"id": cid, "file": file, "round": server_round, "unseen": node.unseen,
                     NUM_TEST: count, "personal-acc": metrics[PERSONAL_CORRECT] / max(count, 1),
                     PERSONAL_LOSS: float(metrics[PERSONAL_LOSS])}],
        "on-node": []})
    return folder / file
