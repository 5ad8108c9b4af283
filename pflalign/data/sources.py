"""A researcher's own data: ``dataset = npz:PATH``.

The file holds ``x`` and ``y`` (and optionally ``client``), as ``numpy.savez`` writes them:

- ``x``: the samples, either images as ``uint8`` (0..255), ``N x H x W`` (one channel) or
  ``N x C x H x W`` (channels first), or feature vectors as floats, ``N x D``;
- ``y``: ``N`` integer labels, ``0..K-1`` (``K`` = the largest label + 1);
- ``client`` (optional): ``N`` integers or strings, each sample's own client, for
  ``partition = natural``; every other partition splits by ``y`` as it does a built-in dataset.

Images are normalised per channel by the file's own mean and standard deviation, as the
built-in datasets are by their published ones; feature vectors go to the model as they are
(float32). What the samples are (:func:`dataset_kind`) is read from the array headers alone,
before any data, so a config is checked without loading the file.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from pflalign.settings.options import ConfigError
from pflalign.settings.schema import DATASETS, FEATURES, IMAGE

NPZ = "npz:"
#: what a dataset value may be besides a built-in name, for messages
USER_FORMS = "npz:PATH (your own arrays: docs/data.md)"


def npz_path(name: str) -> Path | None:
    """The file of ``dataset = npz:PATH``, or None for a built-in dataset."""
    if not name.startswith(NPZ):
        return None
    text = name[len(NPZ):].strip()
    if not text:
        raise ConfigError("dataset = 'npz:' needs a path: dataset = 'npz:/path/to/data.npz'.")
    return Path(text).expanduser()


def check_dataset_name(name: str) -> None:
    """A dataset value names a built-in dataset or a readable source, in one sentence if not."""
    if name in DATASETS:
        return
    if name.startswith(NPZ):
        _headers(npz_path(name))
        return
    raise ConfigError(f"Unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}, or "
                      f"{USER_FORMS}.")


def _headers(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Each array's shape and dtype in the .npz file, from its header alone (no data read)."""
    if not path.exists():
        raise ConfigError(f"dataset = 'npz:{path}': the file does not exist.")
    try:
        with zipfile.ZipFile(path) as archive:
            headers = {}
            for member in archive.namelist():
                if not member.endswith(".npy"):
                    continue
                with archive.open(member) as handle:
                    version = np.lib.format.read_magic(handle)
                    shape, _, dtype = (np.lib.format.read_array_header_1_0(handle)
                                       if version == (1, 0)
                                       else np.lib.format.read_array_header_2_0(handle))
                headers[member[:-len(".npy")]] = (tuple(shape), np.dtype(dtype))
    except (zipfile.BadZipFile, ValueError, OSError) as err:
        raise ConfigError(f"dataset = 'npz:{path}' is not a readable .npz file ({err}); write "
                          "it with numpy.savez(path, x=..., y=...).") from err
    missing = [k for k in ("x", "y") if k not in headers]
    if missing:
        raise ConfigError(f"dataset = 'npz:{path}' has no {' or '.join(missing)} array (it has "
                          f"{', '.join(sorted(headers)) or 'none'}); write it with "
                          "numpy.savez(path, x=samples, y=labels[, client=ids]).")
    (x_shape, x_dtype), (y_shape, y_dtype) = headers["x"], headers["y"]
    where = f"dataset = 'npz:{path}'"
    if len(y_shape) != 1 or y_shape[0] != x_shape[0]:
        raise ConfigError(f"{where}: y has shape {y_shape} but x has {x_shape[0] if x_shape else 0}"
                          f" samples; y must hold one label per sample (shape ({x_shape[0]},)).")
    if y_dtype.kind not in "iu":
        raise ConfigError(f"{where}: y is {y_dtype}; labels must be integers 0..K-1.")
    if x_dtype.kind == "u" and x_dtype.itemsize == 1:
        if len(x_shape) == 4 and x_shape[1] not in (1, 3) and x_shape[3] in (1, 3):
            raise ConfigError(f"{where}: x has shape {x_shape}, channels last; images must be "
                              "channels first: x.transpose(0, 3, 1, 2).")
        if len(x_shape) not in (3, 4):
            raise ConfigError(f"{where}: x is uint8 of shape {x_shape}; images must be N x H x W "
                              "or N x C x H x W.")
    elif x_dtype.kind == "f":
        if len(x_shape) != 2:
            raise ConfigError(f"{where}: x is {x_dtype} of shape {x_shape}; feature vectors "
                              "must be N x D (images: uint8 N x H x W or N x C x H x W).")
    else:
        raise ConfigError(f"{where}: x is {x_dtype}; give images as uint8 (0..255) or feature "
                          "vectors as floats.")
    if x_shape[0] == 0:
        raise ConfigError(f"{where}: x holds no samples.")
    if "client" in headers:
        c_shape, c_dtype = headers["client"]
        if c_shape != (x_shape[0],):
            raise ConfigError(f"{where}: client has shape {c_shape}; it must name one client per "
                              f"sample (shape ({x_shape[0]},)).")
        if c_dtype.kind not in "iuUS":
            raise ConfigError(f"{where}: client is {c_dtype}; give integer or string ids.")
    return headers


def dataset_kind(name: str) -> str:
    """What the samples of dataset ``name`` are (``image``, ``tokens`` or ``features``), known
    before any data is read."""
    path = npz_path(name)
    if path is None:
        if name not in DATASETS:
            check_dataset_name(name)
        return DATASETS[name]
    shape, dtype = _headers(path)["x"]
    return FEATURES if dtype.kind == "f" else IMAGE


def has_natural_clients(name: str) -> bool:
    """Whether dataset ``name`` says which client each sample belongs to."""
    path = npz_path(name)
    if path is None:
        return name == "shakespeare"
    return "client" in _headers(path)


def _channel_moments(images: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and standard deviation of uint8 images, in [0, 1] units, in chunks
    (no float copy of the whole array)."""
    channels = images.shape[1]
    total = np.zeros(channels)
    squares = np.zeros(channels)
    for start in range(0, len(images), 4096):
        chunk = images[start:start + 4096].astype(np.float64) / 255.0
        total += chunk.sum(axis=(0, 2, 3))
        squares += np.square(chunk).sum(axis=(0, 2, 3))
    count = images.shape[0] * images.shape[2] * images.shape[3]
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - mean ** 2, 0.0))
    if not (std > 0).all():
        raise ConfigError("dataset = npz: every image has the same value in a channel; "
                          "nothing can be learned from it.")
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


def load_npz(name: str) -> dict:
    """The fields of the pooled :class:`~pflalign.data.datasets.Dataset` of ``dataset =
    npz:PATH`` (which :func:`pflalign.data.datasets.load_dataset` reads once per process)."""
    path = npz_path(name)
    headers = _headers(path)
    where = f"dataset = 'npz:{path}'"
    with np.load(path, allow_pickle=False) as data:
        x, y = data["x"], data["y"]
        client = data["client"] if "client" in headers else None
    if y.size and y.min() < 0:
        raise ConfigError(f"{where}: y holds the label {int(y.min())}; labels must be 0..K-1.")
    labels = y.astype(np.int64)
    num_classes = int(labels.max()) + 1
    if num_classes < 2:
        raise ConfigError(f"{where}: y holds one class; a classifier needs at least two.")
    groups, group_names = None, ()
    if client is not None:
        names, groups = np.unique(client, return_inverse=True)
        groups = groups.astype(np.int64)
        group_names = tuple(str(n) for n in names)
    if x.dtype.kind == "f":
        if not np.isfinite(x).all():
            raise ConfigError(f"{where}: x holds NaN or infinite values.")
        samples = np.ascontiguousarray(x, dtype=np.float32)
        kind, mean, std = FEATURES, (), ()
    else:
        samples = np.ascontiguousarray(x[:, None] if x.ndim == 3 else x)
        kind = IMAGE
        mean, std = _channel_moments(samples)
    samples.setflags(write=False)
    labels.setflags(write=False)
    return {"name": name, "images": samples, "labels": labels, "num_classes": num_classes,
            "mean": mean, "std": std, "kind": kind, "groups": groups,
            "group_names": group_names}
