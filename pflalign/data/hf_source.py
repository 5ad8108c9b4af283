"""A Hugging Face dataset: ``dataset = hf:NAME_OR_PATH``.

``NAME_OR_PATH`` is a folder written by the ``datasets`` library's ``save_to_disk`` (a
``Dataset`` or a ``DatasetDict``), read with ``load_from_disk``; or, where there is no such
folder and the value is not written as a path, a dataset's name on the Hugging Face hub, read
with ``load_dataset`` (online; downloaded once into the library's cache). Every split is pooled,
as the built-in datasets' train and test sets are, before the partition.

Three keys name the columns (empty: found by their names and types, before any data is read):

- ``input-column``: an ``Image`` column (each image decoded once, greyscale when every image is
  and RGB otherwise, resized to ``image-size``), a column of uint8 arrays (``H x W``,
  ``C x H x W`` or ``H x W x C``), one column of number lists (feature vectors), or
  comma-separated numeric columns (a feature each). Found: the ``Image`` column, else a column
  named ``image`` or ``img``, else every numeric column but the label and client columns.
- ``label-column``: integers ``0..K-1``, a ``ClassLabel`` (``K``: its names) or an integer column
  (``K``: the largest label + 1). Found: ``label``, ``labels``, or the one ``ClassLabel`` column.
- ``client-column``: each sample's client (integers or strings), for ``partition = natural``.
  Found: ``client`` or ``client_id`` where there is one.

Images are normalised per channel by the data's own mean and standard deviation; feature
vectors go to the model as they are (float32). Decoded images are kept in ``cache-dir``
(``~/.cache/pflalign`` by default; keyed by the data's Arrow files' paths, sizes and times, the
column and ``image-size``), so that later processes, each Ray worker too, read one array file
(``.pflalign-cache/`` folders that earlier versions wrote beside the data are skipped). Needs the
``datasets`` library: ``pip install "pflalign[hf]"``.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pflalign.data.image_arrays import cache_root, channel_moments, common_mode, write_cache
from pflalign.process.caches import cached
from pflalign.settings.options import ConfigError
from pflalign.settings.schema import FEATURES, IMAGE

HF = "hf:"
INSTALL = 'pip install "pflalign[hf]"'
#: the keys that name an hf: dataset's columns, in the order of a ``columns`` tuple
COLUMN_KEYS = ("input-column", "label-column", "client-column")
#: every column found by its name and type
NO_COLUMNS = ("", "", "")
_IMAGE_NAMES = ("image", "img")
_LABEL_NAMES = ("label", "labels")
_CLIENT_NAMES = ("client", "client_id")
_CACHE = ".pflalign-cache"


def hf_target(name: str) -> str | None:
    """What ``dataset = hf:NAME_OR_PATH`` names, or None for another dataset."""
    if not name.startswith(HF):
        return None
    text = name[len(HF):].strip()
    if not text:
        raise ConfigError("dataset = 'hf:' needs a folder written by save_to_disk or a dataset's "
                          "name on the hub: dataset = 'hf:/path/to/folder'.")
    return text


def local_folder(target: str) -> Path | None:
    """The folder ``target`` names: one that exists, or a value written as a path (absolute,
    ``./``, ``../``, ``~``, or with more than one ``/``); None for a name on the hub."""
    path = Path(target).expanduser()
    if (path.exists() or path.is_absolute() or target.startswith((".", "~"))
            or target.count("/") > 1):
        return path
    return None


def library():
    """The ``datasets`` module, or one sentence naming the extra that installs it."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"dataset = hf:... reads data with the datasets library, which is not "
                          f"installed: {INSTALL}.") from None
    return datasets


def _stamp(folder: Path) -> tuple:
    """What a folder holds (each file's path, size and time), so that a rewritten folder is
    read again and not taken from this process's cache."""
    if not folder.is_dir():
        return ()
    return tuple(sorted((str(p.relative_to(folder)), st.st_size, st.st_mtime_ns)
                        for p in folder.rglob("*")
                        if _CACHE not in p.relative_to(folder).parts and p.is_file()
                        for st in (p.stat(),)))


def open_pool(name: str):
    """The pooled ``datasets.Dataset`` of ``dataset = hf:...`` (every split, in order), read
    once per process and again when its folder changes."""
    target = hf_target(name)
    folder = local_folder(target)
    return _opened(target, None if folder is None else _stamp(folder))


def _short(err: Exception) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 200 else text[:197] + "..."


@cached(maxsize=4)
def _opened(target: str, stamp: tuple | None):
    """The folder's dataset, or the hub's, with its splits pooled (``stamp``: the folder's
    state, the cache key that makes a rewritten folder read again)."""
    datasets = library()
    where = f"dataset = 'hf:{target}'"
    folder = local_folder(target)
    if folder is not None:
        if not folder.exists():
            raise ConfigError(f"{where}: the folder does not exist; write one with "
                              "Dataset.save_to_disk(folder), or name a dataset on the hub.")
        if not folder.is_dir():
            raise ConfigError(f"{where} is a file; give the folder that Dataset.save_to_disk "
                              "wrote.")
        try:
            data = datasets.load_from_disk(str(folder))
        except FileNotFoundError:
            raise ConfigError(f"{where}: the folder was not written by save_to_disk (it has no "
                              "state.json or dataset_dict.json); write it with "
                              "Dataset.save_to_disk(folder).") from None
        except (OSError, ValueError) as err:
            raise ConfigError(f"{where}: the folder cannot be read as a saved dataset "
                              f"({type(err).__name__}: {_short(err)}); write it again with "
                              "save_to_disk.") from None
    else:
        try:
            data = datasets.load_dataset(target)
        except Exception as err:  # offline, no such dataset, a private one: all one answer
            raise ConfigError(f"{where}: there is no folder {target!r} here, and the Hugging "
                              f"Face hub did not give that dataset ({type(err).__name__}: "
                              f"{_short(err)}); give the folder save_to_disk wrote, or the "
                              "hub's name while online.") from None
    if isinstance(data, datasets.DatasetDict):
        splits = list(data.items())
        if not splits:
            raise ConfigError(f"{where} has no splits; save a Dataset with rows.")
        first = splits[0][1].features
        differ = [n for n, split in splits if split.features != first]
        if differ:
            raise ConfigError(f"{where}: split {differ[0]!r} has other columns or types than "
                              f"split {splits[0][0]!r}; give splits of one schema.")
        data = datasets.concatenate_datasets([s for _, s in splits]) if len(splits) > 1 else (
            splits[0][1])
    if not isinstance(data, datasets.Dataset):
        raise ConfigError(f"{where} is a {type(data).__name__}; give a Dataset or a "
                          "DatasetDict (save_to_disk's folder).")
    if len(data) == 0:
        raise ConfigError(f"{where} holds no rows.")
    return data


@dataclass(frozen=True)
class Layout:
    """Which columns of an hf: dataset are its inputs, labels and clients, and how its inputs
    are stored: ``image`` (an Image column), ``array`` (uint8 arrays), ``vector`` (a column of
    number lists) or ``scalars`` (a number a column)."""

    inputs: tuple[str, ...]
    label: str
    client: str | None
    form: str
    num_classes: int
    #: a ClassLabel's names (empty for an integer label column)
    class_names: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        return IMAGE if self.form in ("image", "array") else FEATURES


def layout(name: str, columns: tuple[str, str, str] = NO_COLUMNS) -> Layout:
    """The columns of ``dataset = hf:...`` (``columns``: the input-column, label-column and
    client-column keys), checked, its labels too; one sentence for what cannot serve."""
    target = hf_target(name)
    folder = local_folder(target)
    return _layout(target, None if folder is None else _stamp(folder), tuple(columns))


def _numeric(dtype: str) -> str:
    """The numpy kind of a ``Value``'s dtype (``i``, ``u``, ``f``, ``b``, ...), '' for none."""
    try:
        return np.dtype(dtype).kind
    except TypeError:
        return ""


def _nesting(feature) -> tuple[int, str]:
    """The rank and leaf dtype of a (nested) list or array feature; (0, '') for others."""
    if hasattr(feature, "shape") and hasattr(feature, "dtype"):  # Array2D .. Array5D
        return len(feature.shape), feature.dtype
    depth = 0
    while type(feature).__name__ in ("List", "LargeList", "Sequence"):
        depth += 1
        feature = feature.feature
    if depth and type(feature).__name__ == "Value":
        return depth, feature.dtype
    return 0, ""


def _is_number(feature) -> bool:
    return type(feature).__name__ == "Value" and _numeric(feature.dtype) in ("i", "u", "f")


def _form(feature, column: str, where: str) -> str:
    """How a single input column stores its samples, or one sentence."""
    if type(feature).__name__ == "Image":
        return "image"
    if _is_number(feature):
        return "scalars"
    depth, leaf = _nesting(feature)
    if depth == 1 and _numeric(leaf) in ("i", "u", "f"):
        return "vector"
    if depth in (2, 3) and leaf == "uint8":
        return "array"
    if depth in (2, 3) and _numeric(leaf) in ("i", "u", "f"):
        raise ConfigError(f"{where}: column {column!r} holds {feature!r}; images must be uint8 "
                          "(0..255), and feature vectors lists of numbers (one level).")
    raise ConfigError(f"{where}: column {column!r} holds {feature!r}; inputs must be images (an "
                      "Image column, or uint8 arrays) or numbers (numeric columns, or one column "
                      "of number lists): name those with input-column.")


def _listing(features) -> str:
    return ", ".join(features) or "none"


def _named(features, column: str, key: str, where: str) -> str:
    if column not in features:
        raise ConfigError(f"{where} has no column {column!r} ({key}); its columns are "
                          f"{_listing(features)}.")
    return column


def _label_column(features, given: str, where: str) -> str:
    if given:
        return _named(features, given, "label-column", where)
    found = next((n for n in _LABEL_NAMES if n in features), None)
    if found is not None:
        return found
    class_labels = [n for n, f in features.items() if type(f).__name__ == "ClassLabel"]
    if len(class_labels) == 1:
        return class_labels[0]
    raise ConfigError(f"{where} has no 'label' or 'labels' column and "
                      f"{'no' if not class_labels else len(class_labels)} ClassLabel columns; "
                      f"name the labels with label-column (its columns are "
                      f"{_listing(features)}).")


def _client_column(features, given: str, where: str) -> str | None:
    column = (_named(features, given, "client-column", where) if given
              else next((n for n in _CLIENT_NAMES if n in features), None))
    if column is None:
        return None
    feature = features[column]
    kind = _numeric(feature.dtype) if type(feature).__name__ == "Value" else ""
    if type(feature).__name__ != "ClassLabel" and kind not in ("i", "u") and (
            type(feature).__name__ != "Value" or "string" not in feature.dtype):
        raise ConfigError(f"{where}: the client column {column!r} holds {feature!r}; give each "
                          "sample's client as an integer or a string.")
    return column


def _input_columns(features, given: str, taken: set[str], where: str,
                   ) -> tuple[tuple[str, ...], str]:
    """The input columns and how they store the samples."""
    if given:
        columns = tuple(c.strip() for c in given.split(",") if c.strip())
        for column in columns:
            _named(features, column, "input-column", where)
            if column in taken:
                raise ConfigError(f"{where}: input-column names {column!r}, the label or client "
                                  "column; name the inputs' own columns.")
        if len(columns) == 1:
            return columns, _form(features[columns[0]], columns[0], where)
        odd = [c for c in columns if not _is_number(features[c])]
        if odd:
            raise ConfigError(f"{where}: input-column names several columns, and {odd[0]!r} "
                              f"holds {features[odd[0]]!r}; several input columns must each "
                              "hold one number a sample.")
        return columns, "scalars"
    free = {n: f for n, f in features.items() if n not in taken}
    images = [n for n, f in free.items() if type(f).__name__ == "Image"]
    if len(images) > 1:
        preferred = [n for n in images if n in _IMAGE_NAMES]
        if not preferred:
            raise ConfigError(f"{where} has {len(images)} Image columns ({', '.join(images)}); "
                              "name one with input-column.")
        images = preferred[:1]
    if images:
        return (images[0],), "image"
    named = next((n for n in _IMAGE_NAMES if n in free), None)
    if named is not None:
        return (named,), _form(free[named], named, where)
    numbers = tuple(n for n, f in free.items() if _is_number(f))
    if numbers:
        return numbers, "scalars"
    vectors = [n for n, f in free.items() if _nesting(f)[0] == 1 and _numeric(_nesting(f)[1])
               in ("i", "u", "f")]
    if len(vectors) == 1:
        return (vectors[0],), "vector"
    raise ConfigError(f"{where} has no Image column, no 'image' or 'img' column, and no numeric "
                      "columns besides the labels; name the inputs with input-column (its "
                      f"columns are {_listing(features)}).")


def column_values(data, column: str, **dtype) -> np.ndarray:
    """A column of ``data`` as one numpy array (object dtype when its rows differ in shape);
    integers come as int64 and floats as float32 unless ``dtype`` says otherwise."""
    return np.asarray(data.with_format("numpy", columns=[column], **dtype)[:][column])


@cached(maxsize=8)
def _layout(target: str, stamp: tuple | None, columns: tuple[str, str, str]) -> Layout:
    data = _opened(target, stamp)
    where = f"dataset = 'hf:{target}'"
    features = data.features
    given_input, given_label, given_client = (c.strip() for c in columns)
    label = _label_column(features, given_label, where)
    client = _client_column(features, given_client, where)
    if client == label:
        raise ConfigError(f"{where}: column {label!r} is both the labels and the clients; name "
                          "the clients' own column with client-column.")
    inputs, form = _input_columns(features, given_input, {label, client} - {None}, where)
    feature = features[label]
    class_label = type(feature).__name__ == "ClassLabel"
    if not class_label and not (type(feature).__name__ == "Value"
                                and _numeric(feature.dtype) in ("i", "u")):
        raise ConfigError(f"{where}: the label column {label!r} holds {feature!r}; labels must "
                          "be integers 0..K-1, a ClassLabel or an integer column: "
                          f"dataset.class_encode_column({label!r}) makes one.")
    labels = column_values(data, label)
    if labels.dtype.kind not in "iu":
        raise ConfigError(f"{where}: the label column {label!r} has empty rows; every sample "
                          "needs a label.")
    if labels.min() < 0:
        raise ConfigError(f"{where}: the label column {label!r} holds {int(labels.min())}; labels "
                          "must be 0..K-1" + (" (-1 is a ClassLabel's missing label: drop those "
                                               "rows)." if class_label else "."))
    num_classes = feature.num_classes if class_label else int(labels.max()) + 1
    if labels.max() >= num_classes:
        raise ConfigError(f"{where}: the label column {label!r} holds {int(labels.max())}, "
                          f"beyond its ClassLabel's {num_classes} names.")
    if num_classes < 2:
        raise ConfigError(f"{where}: the labels hold one class; a classifier needs at least two.")
    return Layout(inputs=inputs, label=label, client=client, form=form, num_classes=num_classes,
                  class_names=tuple(str(n) for n in feature.names) if class_label else ())


# --- reading the samples ----------------------------------------------------------------------
def _image_entries(data, column: str) -> Iterator[dict | None]:
    """Each row's image as stored (``bytes`` and ``path``), nothing decoded."""
    datasets = library()
    raw = data.cast_column(column, datasets.Image(decode=False)).select_columns([column])
    for batch in raw.with_format(None).iter(batch_size=256):
        yield from batch[column]


def _open_image(entry: dict | None, row: int, where: str):
    from PIL import Image, UnidentifiedImageError

    if entry is None or not (entry.get("bytes") or entry.get("path")):
        raise ConfigError(f"{where}: row {row} has no image; drop the rows without one.")
    source = io.BytesIO(entry["bytes"]) if entry.get("bytes") else entry["path"]
    try:
        return Image.open(source)
    except (UnidentifiedImageError, OSError) as err:
        raise ConfigError(f"{where}: the image of row {row} cannot be read ({err}).") from None


def _decode_images(data, column: str, size: int, where: str) -> np.ndarray:
    """Every image of an Image column decoded once, as uint8 N x C x H x W: greyscale when
    every image is, else RGB; resized to size x size (bilinear), or all of one size when
    ``size`` is 0."""
    from PIL import Image

    modes, sizes = set(), set()
    for row, entry in enumerate(_image_entries(data, column)):  # the headers first
        with _open_image(entry, row, where) as img:
            modes.add(img.mode)
            sizes.add(img.size)
    mode = common_mode(modes, sizes, size, where)
    images = []
    for row, entry in enumerate(_image_entries(data, column)):
        try:
            with _open_image(entry, row, where) as img:
                img = img.convert(mode)
                if size:
                    img = img.resize((size, size), Image.Resampling.BILINEAR)
                array = np.asarray(img, dtype=np.uint8)
        except OSError as err:
            raise ConfigError(f"{where}: the image of row {row} cannot be decoded "
                              f"({err}).") from None
        images.append(array[None] if array.ndim == 2 else array.transpose(2, 0, 1))
    return np.stack(images)


def _array_images(data, column: str, size: int, where: str) -> np.ndarray:
    """A column of uint8 arrays as N x C x H x W (H x W x C turned channels first), resized
    to size x size (bilinear) when ``size`` is given."""
    from PIL import Image

    images = column_values(data, column, dtype=np.uint8)
    if images.dtype == object or images.ndim not in (3, 4):
        raise ConfigError(f"{where}: the arrays of column {column!r} differ in shape; store the "
                          "images as an Image column and set image-size.")
    if images.ndim == 3:
        images = images[:, None]
    elif images.shape[1] not in (1, 3):
        if images.shape[3] not in (1, 3):
            raise ConfigError(f"{where}: the arrays of column {column!r} are "
                              f"{images.shape[1:]}; images must have 1 or 3 channels, first "
                              "or last.")
        images = images.transpose(0, 3, 1, 2)
    if size and images.shape[2:] != (size, size):
        mode = "L" if images.shape[1] == 1 else "RGB"
        resized = [np.asarray(Image.fromarray(img[0] if mode == "L" else img.transpose(1, 2, 0),
                                              mode).resize((size, size),
                                                           Image.Resampling.BILINEAR))
                   for img in images]
        images = np.stack([r[None] if r.ndim == 2 else r.transpose(2, 0, 1) for r in resized])
    return images.astype(np.uint8, copy=False)


def _cache_path(data, column: str, size: int, cache_dir: str = "") -> Path | None:
    """Where the decoded images of ``data`` are kept: in ``cache_dir``
    (:func:`~pflalign.data.image_arrays.cache_root`), keyed by every Arrow file's path, size and
    time, the column and ``size``; None for data in memory."""
    files = [Path(f["filename"]) for f in data.cache_files]
    if not files:
        return None
    try:
        key = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    except OSError:
        return None
    digest = hashlib.sha256(repr((column, size, key)).encode()).hexdigest()[:20]
    return cache_root(cache_dir) / "images" / f"hf-{digest}.npy"


def _images(data, column: str, form: str, size: int, where: str,
            cache_dir: str = "") -> np.ndarray:
    """The images of column ``column``, from the decoded cache where it holds them."""
    if form == "array":
        return _array_images(data, column, size, where)
    cache = _cache_path(data, column, size, cache_dir)
    if cache is not None and cache.is_file():
        try:
            images = np.load(cache, allow_pickle=False)
        except (OSError, ValueError):
            images = None  # damaged: decoded again, and written again
        if images is not None and images.ndim == 4 and len(images) == len(data):
            return images
    images = _decode_images(data, column, size, where)
    if cache is not None:
        write_cache(cache, images)
    return images


def load_hf(name: str, columns: tuple[str, str, str] = NO_COLUMNS, image_size: int = 0,
            cache_dir: str = "") -> dict:
    """The fields of the pooled :class:`~pflalign.data.datasets.Dataset` of ``dataset =
    hf:NAME_OR_PATH`` (which :func:`pflalign.data.datasets.load_dataset` reads once per
    process)."""
    data = open_pool(name)
    found = layout(name, columns)
    where = f"dataset = 'hf:{hf_target(name)}'"
    labels = column_values(data, found.label).astype(np.int64)
    if found.kind == IMAGE:
        samples = np.ascontiguousarray(_images(data, found.inputs[0], found.form, image_size,
                                               where, cache_dir))
        mean, std = channel_moments(samples)
    else:
        if found.form == "vector":
            x = column_values(data, found.inputs[0])
            if x.dtype == object or x.ndim != 2:
                raise ConfigError(f"{where}: the lists of column {found.inputs[0]!r} differ in "
                                  "length; every feature vector must have as many numbers.")
        else:
            x = np.stack([column_values(data, c) for c in found.inputs], axis=1)
        if x.dtype.kind not in "iuf" or not np.isfinite(x).all():
            raise ConfigError(f"{where}: the inputs hold empty, NaN or infinite values; fill or "
                              "drop those rows.")
        samples = np.ascontiguousarray(x, dtype=np.float32)
        mean, std = (), ()
    groups, group_names = None, ()
    if found.client is not None:
        clients = column_values(data, found.client)
        if clients.dtype.kind not in "iuU":
            clients = clients.astype(str)  # strings come as objects
        names, groups = np.unique(clients, return_inverse=True)
        groups = groups.astype(np.int64)
        group_names = tuple(str(n) for n in names)
    samples.setflags(write=False)
    labels.setflags(write=False)
    return {"name": name, "images": samples, "labels": labels,
            "num_classes": found.num_classes, "mean": mean, "std": std, "kind": found.kind,
            "groups": groups, "group_names": group_names, "class_names": found.class_names}
