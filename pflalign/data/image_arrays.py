"""Decoded uint8 images (N x C x H x W): their per-channel moments, and an array of them kept in a
file for later processes (the image folders' and Hugging Face datasets' decoded caches)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from pflalign.settings.options import ConfigError


def channel_moments(images: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
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
        raise ConfigError("The dataset's images have one value in a channel, everywhere; "
                          "nothing can be learned from it.")
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


def cache_root(cache_dir: str | Path = "") -> Path:
    """The folder of the decoded-image caches: ``cache_dir`` (the ``cache-dir`` key), or when
    empty ``$XDG_CACHE_HOME/pflalign`` (``~/.cache/pflalign`` when that is unset)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pflalign"


def write_cache(cache: Path, images: np.ndarray) -> None:
    """``images`` to ``cache`` through a temporary file of its own (renamed into place, so a
    reader sees a whole file or none); a folder that cannot be written is left as it is."""
    import tempfile

    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=cache.parent, prefix=".images-", suffix=".tmp")
    except OSError:
        return  # a read-only folder: every process decodes
    try:
        with os.fdopen(handle, "wb") as out:
            np.save(out, images, allow_pickle=False)
        os.replace(partial, cache)
    except OSError:
        Path(partial).unlink(missing_ok=True)


def common_mode(modes: set[str], sizes: set[tuple[int, int]], size: int, where: str) -> str:
    """The PIL mode every image of a source is decoded in (``L`` when all are greyscale, else
    ``RGB``), given the modes and sizes its headers show; one sentence for 16- or 32-bit images,
    and for mixed sizes without ``image-size``."""
    deep = sorted(m for m in modes if m.startswith("I") or m == "F")
    if deep:
        raise ConfigError(f"{where}: some images are {deep[0]} (16- or 32-bit); convert them to "
                          "8-bit greyscale or RGB (converting here would clip them).")
    if size == 0 and len(sizes) > 1:
        shown = ", ".join(f"{w}x{h}" for w, h in sorted(sizes)[:4])
        raise ConfigError(f"{where}: the images have {len(sizes)} sizes ({shown}, ...); set "
                          "image-size = N to resize every image to N x N.")
    return "L" if modes <= {"L", "1"} else "RGB"
