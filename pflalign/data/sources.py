"""A researcher's own data: ``dataset = npz:PATH``, ``csv:PATH`` / ``parquet:PATH``,
``imagefolder:DIR``, ``text:DIR`` (and ``jsonl:``/``hf:`` in their own modules).

An npz file holds ``x`` and ``y`` (and optionally ``client`` and ``split``), as
``numpy.savez`` writes them:

- ``x``: the samples, either images as ``uint8`` (0..255), ``N x H x W`` (one channel) or
  ``N x C x H x W`` (channels first), images as floats (already normalised: used as given), or
  feature vectors as floats, ``N x D``;
- ``y``: ``N`` integer labels, ``0..K-1`` (``K`` = the largest label + 1);
- ``client`` (optional): ``N`` integers or strings, each sample's own client, for
  ``partition = natural``; every other partition splits by ``y`` as it does a built-in dataset;
- ``split`` (optional): each sample's split, ``train``/``test`` or 0/1, which ``partition =
  natural`` keeps in place of a drawn one.

A table (:func:`load_table`) has a label column (names or integers, encoded with their names kept),
feature columns, and optionally a client and a split column. Images in uint8 are normalised per
channel by the data's own mean and standard deviation, as the built-in datasets are by their
published ones; feature vectors go to the model as they are (float32). What the samples are
(:func:`dataset_kind`) is read from the array headers alone, before any data, so a config is checked
without loading the file.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from pflalign.data import hf_source
from pflalign.data.hf_source import HF, NO_COLUMNS
from pflalign.data.image_arrays import cache_root, common_mode
from pflalign.data.image_arrays import channel_moments as _channel_moments
from pflalign.data.image_arrays import write_cache as _write_cache
from pflalign.data.instructions import JSONL, check_instructions, has_clients
from pflalign.settings.options import ConfigError
from pflalign.settings.schema import DATASETS, FEATURES, IMAGE, TOKENS

NPZ = "npz:"
#: the splits a sample's split (a column, an array, a folder) may name, and their codes
SPLITS = {"train": 0, "test": 1}
#: what a dataset value may be besides a built-in name, for messages
USER_FORMS = ("npz:PATH, csv:PATH, parquet:PATH, imagefolder:DIR, text:DIR, jsonl:PATH or "
              "hf:NAME_OR_PATH (your own data: docs/data.md)")


def npz_path(name: str) -> Path | None:
    """The file of ``dataset = npz:PATH``, or None for a built-in dataset."""
    if not name.startswith(NPZ):
        return None
    text = name[len(NPZ):].strip()
    if not text:
        raise ConfigError("dataset = 'npz:' needs a path: dataset = 'npz:/path/to/data.npz'.")
    return Path(text).expanduser()


def check_dataset_name(name: str, columns: tuple[str, ...] = NO_COLUMNS,
                       task: str | None = None) -> None:
    """A dataset value names a built-in dataset or a readable source, in one sentence if not
    (``columns``: the input, label, client and split column keys of a Hugging Face dataset,
    :mod:`pflalign.data.hf_source`, or of a table; ``task``: an npz file's labels checked
    against it)."""
    if name in DATASETS:
        return
    if name.startswith(HF):
        hf_source.layout(name, tuple(columns)[:3])
        return
    if table_path(name) is not None:
        table_layout(name, columns)
        return
    if name.startswith(NPZ):
        _headers(npz_path(name), task)
        return
    if name.startswith(IMAGEFOLDER):
        scan_imagefolder(folder_of(name, IMAGEFOLDER))
        return
    if name.startswith(TEXT):
        text_files(folder_of(name, TEXT))
        return
    if name.startswith(JSONL):
        check_instructions(name)
        return
    raise ConfigError(f"Unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}, or "
                      f"{USER_FORMS}.")


def _headers(path: Path, task: str | None = None) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Each array's shape and dtype in the .npz file, from its header alone (no data read);
    with ``task``, ``y``'s type checked against it (float targets only for a regression)."""
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
    if not x_shape or not y_shape:
        raise ConfigError(f"{where}: x and y must be arrays of samples, not single values.")
    if len(y_shape) != 1 or y_shape[0] != x_shape[0]:
        raise ConfigError(f"{where}: y has shape {y_shape} but x has {x_shape[0] if x_shape else 0}"
                          f" samples; y must hold one label per sample (shape ({x_shape[0]},)).")
    if y_dtype.kind not in "iuf" or (y_dtype.kind == "f" and task == "classification"):
        raise ConfigError(f"{where}: y is {y_dtype}; labels must be integers 0..K-1 (for "
                          "float targets, set task = regression).")
    if x_dtype.kind == "u" and x_dtype.itemsize == 1:
        if len(x_shape) == 4 and x_shape[1] not in (1, 3) and x_shape[3] in (1, 3):
            raise ConfigError(f"{where}: x has shape {x_shape}, channels last; images must be "
                              "channels first: x.transpose(0, 3, 1, 2).")
        if len(x_shape) not in (3, 4):
            raise ConfigError(f"{where}: x is uint8 of shape {x_shape}; images must be N x H x W "
                              "or N x C x H x W.")
    elif x_dtype.kind == "f":
        if len(x_shape) == 4 and x_shape[1] not in (1, 3) and x_shape[3] in (1, 3):
            raise ConfigError(f"{where}: x has shape {x_shape}, channels last; images must be "
                              "channels first: x.transpose(0, 3, 1, 2).")
        if len(x_shape) not in (2, 3, 4):
            raise ConfigError(f"{where}: x is {x_dtype} of shape {x_shape}; give feature "
                              "vectors N x D, or images N x H x W or N x C x H x W.")
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
    if "split" in headers:
        s_shape, s_dtype = headers["split"]
        if s_shape != (x_shape[0],) or s_dtype.kind not in "iubUS":
            raise ConfigError(f"{where}: split has shape {s_shape} and dtype {s_dtype}; it must "
                              f"give each sample's split (shape ({x_shape[0]},)): 'train' or "
                              "'test', or 0 and 1.")
    return headers


def dataset_kind(name: str, columns: tuple[str, ...] = NO_COLUMNS) -> str:
    """What the samples of dataset ``name`` are (``image``, ``tokens`` or ``features``), known
    before any data is read."""
    if name.startswith(HF):
        return hf_source.layout(name, tuple(columns)[:3]).kind
    if table_path(name) is not None:
        return FEATURES
    if name.startswith(IMAGEFOLDER):
        return IMAGE
    if name.startswith(TEXT):
        return TOKENS
    if name.startswith(JSONL):
        return TOKENS
    path = npz_path(name)
    if path is None:
        if name not in DATASETS:
            check_dataset_name(name)
        return DATASETS[name]
    shape, dtype = _headers(path)["x"]
    return FEATURES if dtype.kind == "f" and len(shape) == 2 else IMAGE


def has_natural_clients(name: str, columns: tuple[str, ...] = NO_COLUMNS) -> bool:
    """Whether dataset ``name`` says which client each sample belongs to."""
    if name.startswith(HF):
        return hf_source.layout(name, tuple(columns)[:3]).client is not None
    if table_path(name) is not None:
        return table_layout(name, columns)["client"] is not None
    if name.startswith(IMAGEFOLDER):
        return scan_imagefolder(folder_of(name, IMAGEFOLDER))[0] is not None
    if name.startswith(TEXT):
        return True
    if name.startswith(JSONL):
        return has_clients(name)
    path = npz_path(name)
    if path is None:
        return name in ("shakespeare", "synthetic", "clients")
    return "client" in _headers(path)


def regression_targets(values: np.ndarray, where: str) -> np.ndarray:
    """A regression's targets as float32, or one sentence for a missing or infinite one."""
    targets = np.asarray(values, dtype=np.float64)
    bad = ~np.isfinite(targets)
    if bad.any():
        raise ConfigError(f"{where}: the target of row {int(np.flatnonzero(bad)[0])} is "
                          f"{float(targets[bad][0])}; a regression needs a finite target for "
                          "every sample (fill or drop it).")
    return targets.astype(np.float32)


def load_npz(name: str, task: str = "classification") -> dict:
    """The fields of the pooled :class:`~pflalign.data.datasets.Dataset` of ``dataset =
    npz:PATH`` (which :func:`pflalign.data.datasets.load_dataset` reads once per process);
    ``task = regression``: ``y`` holds float targets."""
    path = npz_path(name)
    headers = _headers(path)
    where = f"dataset = 'npz:{path}'"
    with np.load(path, allow_pickle=False) as data:
        x, y = data["x"], data["y"]
        client = data["client"] if "client" in headers else None
        split = split_codes(data["split"], where) if "split" in headers else None
    if task == "regression":
        labels, num_classes = regression_targets(y, where), 1
    else:
        if y.dtype.kind == "f":
            raise ConfigError(f"{where}: y is {y.dtype}; labels must be integers 0..K-1 (for "
                              "float targets, set task = regression).")
        if y.size and y.min() < 0:
            raise ConfigError(f"{where}: y holds the label {int(y.min())}; labels must be "
                              "0..K-1.")
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
        # feature vectors, or images already normalised by the user: used as given
        samples = np.ascontiguousarray(x[:, None] if x.ndim == 3 else x, dtype=np.float32)
        kind, mean, std = (FEATURES if x.ndim == 2 else IMAGE), (), ()
    else:
        samples = np.ascontiguousarray(x[:, None] if x.ndim == 3 else x)
        kind = IMAGE
        mean, std = _channel_moments(samples)
    samples.setflags(write=False)
    labels.setflags(write=False)
    if split is not None:
        split.setflags(write=False)
    return {"name": name, "images": samples, "labels": labels, "num_classes": num_classes,
            "mean": mean, "std": std, "kind": kind, "groups": groups,
            "group_names": group_names, "split": split}


# --- image folders: dataset = imagefolder:DIR ---------------------------------------------------
IMAGEFOLDER = "imagefolder:"
TEXT = "text:"
_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm",
                   ".pgm"}


def folder_of(name: str, prefix: str) -> Path | None:
    """The folder of ``dataset = <prefix>DIR``, or None for another dataset."""
    if not name.startswith(prefix):
        return None
    text = name[len(prefix):].strip()
    if not text:
        raise ConfigError(f"dataset = {prefix!r} needs a folder: dataset = '{prefix}/path/to/dir'.")
    return Path(text).expanduser()


def _visible(folder: Path) -> list[Path]:
    """A folder's entries but hidden ones (``.ipynb_checkpoints``, ``._name``, the cache)."""
    return sorted(p for p in folder.iterdir() if not p.name.startswith("."))


def _images_in(folder: Path) -> list[Path]:
    return [p for p in _visible(folder) if p.is_file() and p.suffix.lower() in _IMAGE_SUFFIXES]


def scan_imagefolder(root: Path) -> tuple[list[str] | None, list[str], list[tuple[Path, str, str]]]:
    """The layout of an image folder: ``ROOT/<class>/<image>`` (torchvision's ImageFolder),
    ``ROOT/<client>/<class>/<image>`` (each client's own folder: a natural partition), or
    ``ROOT/<client>/{train,test}/<class>/<image>`` (each client's own split too). Returns the
    clients (None for the first layout), the classes (sorted, as ImageFolder sorts them) and
    every image as (path, class, client); :func:`folder_splits` gives the split of each."""
    where = f"dataset = 'imagefolder:{root}'"
    if not root.is_dir():
        raise ConfigError(f"{where}: the folder does not exist.")
    subfolders = [p for p in _visible(root) if p.is_dir()]
    if not subfolders:
        raise ConfigError(f"{where}: the folder has no class folders; lay it out as "
                          "DIR/<class>/<image> or DIR/<client>/<class>/<image>.")
    nested = [p for p in subfolders if any(q.is_dir() for q in _visible(p))]
    files: list[tuple[Path, str, str]] = []
    if nested:
        if len(nested) != len(subfolders):
            flat = [p.name for p in subfolders if p not in nested][:3]
            raise ConfigError(f"{where}: some folders hold class folders and some ({flat}) do "
                              "not; use one layout: DIR/<class>/<image> or "
                              "DIR/<client>/<class>/<image>.")
        clients = [p.name for p in subfolders]
        split = [c for c in subfolders if {p.name for p in _visible(c) if p.is_dir()}
                 <= set(SPLITS)]
        if split and len(split) != len(subfolders):
            odd = [p.name for p in subfolders if p not in split][:3]
            raise ConfigError(f"{where}: some client folders hold train and test folders and "
                              f"some ({odd}) do not; use one layout: DIR/<client>/<class>/<image>"
                              " or DIR/<client>/{train,test}/<class>/<image>.")
        for client in subfolders:
            homes = ([client / s for s in SPLITS if (client / s).is_dir()] if split
                     else [client])
            for home in homes:
                for cls in [p for p in _visible(home) if p.is_dir()]:
                    files += [(f, cls.name, client.name) for f in _images_in(cls)]
    else:
        clients = None
        for cls in subfolders:
            files += [(f, cls.name, "") for f in _images_in(cls)]
    if not files:
        raise ConfigError(f"{where}: no image files ({', '.join(sorted(_IMAGE_SUFFIXES))}) in "
                          "its class folders.")
    classes = sorted({cls for _, cls, _ in files})
    if len(classes) < 2:
        raise ConfigError(f"{where}: one class ({classes[0]!r}); a classifier needs at least two.")
    if clients is not None:
        counts = {c: 0 for c in clients}
        for _, _, client in files:
            counts[client] += 1
        empty = [c for c, n in counts.items() if n == 0]
        if empty:
            raise ConfigError(f"{where}: client folder {empty[0]!r} has no images.")
    return clients, classes, files


def folder_splits(root: Path, files: list[tuple[Path, str, str]]) -> np.ndarray | None:
    """Each image's split (0 train, 1 test) in the layout ``ROOT/<client>/{train,test}/...``;
    None in the others."""
    parts = [p.relative_to(root).parts for p, _, _ in files]
    if not parts or len(parts[0]) != 4 or parts[0][1] not in SPLITS:
        return None
    return np.array([SPLITS[p[1]] for p in parts], dtype=np.int8)


def _decoded(files: list[tuple[Path, str, str]], size: int, where: str) -> np.ndarray:
    """Every image decoded once, as uint8 N x C x H x W: greyscale when every image is, else RGB;
    resized to size x size (bilinear), or all of one size when ``size`` is 0."""
    from PIL import Image, UnidentifiedImageError

    modes, sizes = set(), set()
    for path, _, _ in files:  # the headers first (one file open at a time)
        try:
            with Image.open(path) as img:
                modes.add(img.mode)
                sizes.add(img.size)
        except (UnidentifiedImageError, OSError) as err:
            raise ConfigError(f"{where}: {path} cannot be read as an image ({err}).") from None
    mode = common_mode(modes, sizes, size, where)
    images = []
    for path, _, _ in files:
        try:
            with Image.open(path) as img:
                img = img.convert(mode)
                if size:
                    img = img.resize((size, size), Image.Resampling.BILINEAR)
                array = np.asarray(img, dtype=np.uint8)
        except OSError as err:
            raise ConfigError(f"{where}: {path} cannot be decoded ({err}).") from None
        images.append(array[None] if array.ndim == 2 else array.transpose(2, 0, 1))
    return np.stack(images)


def load_imagefolder(name: str, image_size: int, cache_dir: str = "") -> dict:
    """The fields of the pooled dataset of ``dataset = imagefolder:DIR``: decoded once, and kept
    decoded in ``cache_dir`` (:func:`~pflalign.data.image_arrays.cache_root`; keyed by the folder,
    every file's path, size and time and ``image_size``), so that every later process, each Ray
    worker too, reads one array file."""
    import hashlib

    root = folder_of(name, IMAGEFOLDER)
    where = f"dataset = 'imagefolder:{root}'"
    clients, classes, files = scan_imagefolder(root)
    digest = hashlib.sha256(repr((str(root.resolve()), image_size, [
        (str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p, _, _ in files
    ])).encode()).hexdigest()[:20]
    cache = cache_root(cache_dir) / "images" / f"imagefolder-{digest}.npy"
    images = None
    if cache.is_file():
        try:
            images = np.load(cache, allow_pickle=False)
        except (OSError, ValueError):
            images = None  # damaged: decoded again, and written again
        if images is not None and (images.ndim != 4 or len(images) != len(files)):
            images = None
    if images is None:
        images = _decoded(files, image_size, where)
        _write_cache(cache, images)
    index = {cls: k for k, cls in enumerate(classes)}
    labels = np.array([index[cls] for _, cls, _ in files], dtype=np.int64)
    groups, group_names = None, ()
    if clients is not None:
        position = {c: i for i, c in enumerate(clients)}
        groups = np.array([position[client] for _, _, client in files], dtype=np.int64)
        group_names = tuple(clients)
    images = np.ascontiguousarray(images)
    mean, std = _channel_moments(images)
    split = folder_splits(root, files)
    for array in (images, labels, *([] if split is None else [split])):
        array.setflags(write=False)
    return {"name": name, "images": images, "labels": labels, "num_classes": len(classes),
            "class_names": tuple(classes),
            "mean": mean, "std": std, "kind": IMAGE, "groups": groups,
            "group_names": group_names, "split": split}


# --- text files: dataset = text:DIR -------------------------------------------------------------
def text_files(root: Path) -> list[Path]:
    """The clients of ``dataset = text:DIR``: its ``*.txt`` files, one client each, by name."""
    where = f"dataset = 'text:{root}'"
    if not root.is_dir():
        raise ConfigError(f"{where}: the folder does not exist.")
    files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix == ".txt")
    if len(files) < 2:
        raise ConfigError(f"{where}: {len(files)} .txt file(s); give one UTF-8 file per client "
                          "(at least two).")
    return files


def read_texts(name: str) -> list[tuple[str, str]]:
    """Every client's (name, text) of ``dataset = text:DIR``, each file UTF-8 and not empty."""
    root = folder_of(name, TEXT)
    texts = []
    for path in text_files(root):
        try:
            text = path.read_bytes().decode("utf-8").replace("\r\n", "\n")
        except UnicodeDecodeError as err:
            raise ConfigError(f"dataset = 'text:{root}': {path.name} is not UTF-8 text "
                              f"({err.reason} at byte {err.start}); convert it with "
                              "`iconv -t utf-8`.") from None
        if not text.strip():
            raise ConfigError(f"dataset = 'text:{root}': {path.name} is empty; every client "
                              "needs text.")
        texts.append((path.stem, text))
    return texts


def check_characters(name: str, texts: list[tuple[str, str]]) -> None:
    """Text for a character model: at most 5% of it outside the 80-symbol vocabulary (which
    would become spaces), or one sentence saying to use a language model's tokenizer."""
    from pflalign.data.shakespeare import VOCABULARY

    known = set(VOCABULARY)
    total = sum(len(text) for _, text in texts)
    outside = sum(sum(ch not in known for ch in text) for _, text in texts)
    if outside > 0.05 * total:
        raise ConfigError(f"dataset = {name!r}: {outside / total:.0%} of the text's characters "
                          "are outside char-lstm's 80-symbol vocabulary (they would all become "
                          "spaces); use model = hf:<model>, whose own tokenizer reads them.")


# --- tables: dataset = csv:PATH or parquet:PATH --------------------------------------------------
CSV, PARQUET = "csv:", "parquet:"
TABLES = (CSV, PARQUET)
#: a table's columns when the keys leave them empty: the first of each list that is there
_LABEL_NAMES = ("label", "labels", "y", "target", "class")
_CLIENT_NAMES = ("client", "client_id", "user", "user_id")
_SPLIT_NAMES = ("split",)


def table_path(name: str) -> Path | None:
    """The file of ``dataset = csv:PATH`` or ``parquet:PATH``, or None for another dataset."""
    prefix = next((p for p in TABLES if name.startswith(p)), None)
    if prefix is None:
        return None
    text = name[len(prefix):].strip()
    if not text:
        raise ConfigError(f"dataset = {prefix!r} needs a path: dataset = '{prefix}/path/to/"
                          f"data.{prefix[:-1]}'.")
    return Path(text).expanduser()


def _read_table(path: Path, header_only: bool = False):
    """The table as a pandas DataFrame (no rows with ``header_only``)."""
    where = f"dataset = '{path}'"
    try:
        import pandas as pd
    except ImportError:
        raise ConfigError(f"{where}: a table is read with pandas (and Parquet with pyarrow): "
                          "pip install \"pflalign[tables]\".") from None
    if not path.is_file():
        raise ConfigError(f"{where}: the file does not exist.")
    try:
        if path.suffix.lower() in (".parquet", ".pq") or str(path).endswith(".parquet"):
            if header_only:
                import pyarrow.parquet as pq

                return pd.DataFrame(columns=pq.read_schema(path).names)
            return pd.read_parquet(path)
        return pd.read_csv(path, nrows=0 if header_only else None)
    except (ValueError, OSError, ImportError) as err:
        raise ConfigError(f"{where} cannot be read as a table ({type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else ''}).") from None
    except Exception as err:  # pandas' and pyarrow's own parser errors
        raise ConfigError(f"{where} cannot be read as a table ({type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else ''}).") from None


def table_layout(name: str, columns: tuple[str, ...]) -> dict[str, object]:
    """The columns of ``dataset = csv:/parquet:PATH`` from its header alone: ``label``,
    ``client`` (or None), ``split`` (or None) and the ``features``; ``columns``: the
    input-column, label-column, client-column and split-column keys (empty: found by name)."""
    path = table_path(name)
    where = f"dataset = '{name}'"
    header = [str(c) for c in _read_table(path, header_only=True).columns]
    given_input, given_label, given_client, given_split = (
        (tuple(columns) + ("", "", "", ""))[:4])

    def pick(given: str, names: tuple[str, ...], key: str, required: bool) -> str | None:
        given = given.strip()
        if given:
            if given not in header:
                raise ConfigError(f"{where}: {key} = {given!r} is not one of its columns "
                                  f"({', '.join(header[:12])}{' ...' if len(header) > 12 else ''})"
                                  f"; name one of them.")
            return given
        found = next((c for c in names if c in header), None)
        if found is None and required:
            raise ConfigError(f"{where} has no label column (none of {', '.join(names)}; its "
                              f"columns are {', '.join(header[:12])}"
                              f"{' ...' if len(header) > 12 else ''}); name it with "
                              "label-column.")
        return found

    label = pick(given_label, _LABEL_NAMES, "label-column", True)
    client = pick(given_client, _CLIENT_NAMES, "client-column", False)
    split = pick(given_split, _SPLIT_NAMES, "split-column", False)
    taken = {label, client, split} - {None}
    if given_input.strip():
        features = [c.strip() for c in given_input.split(",") if c.strip()]
        unknown = [c for c in features if c not in header]
        if unknown:
            raise ConfigError(f"{where}: input-column names {', '.join(unknown[:3])}, which "
                              "it does not have; name its feature columns.")
        clash = [c for c in features if c in taken]
        if clash:
            raise ConfigError(f"{where}: column {clash[0]!r} is both a feature and the "
                              "labels, clients or split; leave it out of input-column.")
    else:
        features = [c for c in header if c not in taken]
    if not features:
        raise ConfigError(f"{where} has no feature columns beside its labels, clients and "
                          "split.")
    return {"label": label, "client": client, "split": split, "features": features}


def split_codes(values: np.ndarray, where: str) -> np.ndarray:
    """Each sample's split as 0 (train) or 1 (test), from ``train``/``test`` strings
    (any case) or the integers 0 and 1; one sentence for any other value."""
    values = np.asarray(values)
    if values.dtype.kind in "iub":
        bad = values[(values != 0) & (values != 1)]
        if bad.size:
            raise ConfigError(f"{where}: the split holds {bad[0]!r}; each sample's split must "
                              "be train or test (0 or 1).")
        return values.astype(np.int8)
    text = np.char.lower(np.char.strip(values.astype(str)))
    known = np.isin(text, list(SPLITS))
    if not known.all():
        first = int(np.flatnonzero(~known)[0])
        raise ConfigError(f"{where}: the split of row {first} is {str(values[first])!r}; each "
                          "row's split must be train or test.")
    return (text == "test").astype(np.int8)


def load_table(name: str, columns: tuple[str, ...], task: str = "classification") -> dict:
    """The fields of the pooled dataset of ``dataset = csv:PATH`` or ``parquet:PATH``: its
    feature columns as float32 vectors, its labels encoded 0..K-1 with their names kept (the
    sorted distinct values: strings, or numbers written as text), each row's client and split
    where the table has those columns."""
    path = table_path(name)
    where = f"dataset = '{name}'"
    layout = table_layout(name, columns)
    frame = _read_table(path)
    if len(frame) == 0:
        raise ConfigError(f"{where} holds no rows.")
    features = frame[layout["features"]]
    numeric = [c for c in layout["features"] if features[c].dtype.kind not in "iufb"]
    if numeric:
        raise ConfigError(f"{where}: column {numeric[0]!r} is not numeric "
                          f"({features[numeric[0]].dtype}); encode it as numbers, or leave it "
                          "out with input-column.")
    x = features.to_numpy(dtype=np.float32)
    if not np.isfinite(x).all():
        row = int(np.flatnonzero(~np.isfinite(x).all(axis=1))[0])
        raise ConfigError(f"{where}: row {row} has a missing or infinite feature value; fill "
                          "or drop it.")
    raw = frame[layout["label"]]
    if task == "regression":
        if raw.dtype.kind not in "iuf":
            raise ConfigError(f"{where}: the target column {layout['label']!r} is not numeric "
                              f"({raw.dtype}); a regression needs numbers.")
        names, labels = (), regression_targets(raw.to_numpy(), where)
    else:
        if raw.isna().any():
            raise ConfigError(f"{where}: row {int(np.flatnonzero(raw.isna().to_numpy())[0])} "
                              f"has no label in column {layout['label']!r}.")
        if raw.dtype.kind == "f" and not np.all(np.mod(raw.to_numpy(), 1) == 0):
            raise ConfigError(f"{where}: the label column {layout['label']!r} holds "
                              "non-integer numbers; a classifier needs classes (integers or "
                              "names), and float targets need task = regression.")
        values = raw.to_numpy()
        if values.dtype.kind == "f":
            values = values.astype(np.int64)
        names, labels = np.unique(values if values.dtype.kind in "iu" else values.astype(str),
                                  return_inverse=True)
        if len(names) < 2:
            raise ConfigError(f"{where}: the label column {layout['label']!r} holds one class; "
                              "a classifier needs at least two.")
        labels = labels.astype(np.int64)
    groups, group_names = None, ()
    if layout["client"] is not None:
        clients = frame[layout["client"]]
        if clients.isna().any():
            raise ConfigError(f"{where}: row {int(np.flatnonzero(clients.isna().to_numpy())[0])} "
                              f"has no client in column {layout['client']!r}.")
        ids = clients.to_numpy()
        found, groups = np.unique(ids if ids.dtype.kind in "iu" else ids.astype(str),
                                  return_inverse=True)
        groups = groups.astype(np.int64)
        group_names = tuple(str(n) for n in found)
    split = None
    if layout["split"] is not None:
        split = split_codes(frame[layout["split"]].to_numpy(), where)
        split.setflags(write=False)
    samples = np.ascontiguousarray(x)
    samples.setflags(write=False)
    labels.setflags(write=False)
    return {"name": name, "images": samples, "labels": labels,
            "num_classes": len(names) if task != "regression" else 1,
            "class_names": tuple(str(n) for n in names), "mean": (), "std": (),
            "kind": FEATURES, "groups": groups, "group_names": group_names, "split": split,
            "feature_names": tuple(layout["features"])}
