"""Datasets as uint8 arrays, read once per process and normalised per batch.

Fashion-MNIST is the embedded default: Debian's ``dataset-fashion-mnist`` package puts the original
idx files in ``/usr/share/datasets/fashion-mnist``. MNIST, CIFAR-10 and CIFAR-100 come through
torchvision (a local ``data-root`` that already holds the files, or ``download = true``).

As PFLlib does, the official train and test sets are pooled before partitioning; every client then
gets its own train/test split (see :mod:`pflalign.data.partition`).
"""

from __future__ import annotations

import gzip
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from pflalign.process.caches import cached
from pflalign.settings.options import ConfigError
from pflalign.settings.schema import CHARACTERS, FEATURES, IGNORE_INDEX, IMAGE, TOKENS

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")

# Per-channel mean and std of the training images (the usual published constants).
_NORMALISATION = {
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "mnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
_IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}




@dataclass(frozen=True)
class Dataset:
    """A pooled classification dataset: uint8 inputs (images N x C x H x W, or N x L token
    indices) and int64 labels.

    A text dataset (``kind = tokens``) keeps its samples as windows over one stream of tokens:
    ``images[p]`` is the ``L`` tokens from position ``p`` and ``labels[p]`` the token after them
    (characters) or the ``L`` tokens from ``p + 1`` (a language model's), both views of the
    stream (nothing is copied until a client's rows are taken); ``samples`` lists the positions
    that are samples (a window inside one client's text), and ``groups[i]`` the natural client
    (a role) of ``samples[i]``, named by ``group_names``."""

    name: str
    images: np.ndarray
    labels: np.ndarray
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    kind: str = IMAGE
    samples: np.ndarray | None = None
    groups: np.ndarray | None = None
    group_names: tuple[str, ...] = ()
    #: the token stream the windows are views of (text datasets)
    tokens: np.ndarray | None = None
    #: each natural client's samples are in time order (text): its test split is its last
    #: samples; otherwise a stratified random split, as for the other partitions
    time_ordered: bool = False
    #: the name of each class (an image folder's class folders, a ClassLabel's names, the
    #: built-in datasets' classes); empty where the data names none
    class_names: tuple[str, ...] = ()
    #: the name of each feature (a table's feature columns, in the order the model takes them);
    #: empty where the data names none
    feature_names: tuple[str, ...] = ()
    #: each sample's split as the data gives it (0: train, 1: test; a split column or array,
    #: or per-client train/test folders), which partition = natural keeps; None: drawn
    split: np.ndarray | None = None
    #: some targets are :data:`IGNORE_INDEX` (instructions: a sample is a record of
    #: ``L`` tokens whose labels are its response's next tokens, the prompt and the padding
    #: left out), so a test counts the others
    masked_targets: bool = False

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.images.shape[1:])

    def __len__(self) -> int:
        return len(self.labels)

    def sample_ids(self) -> np.ndarray:
        """The rows of :attr:`images` that are samples: all of them, or :attr:`samples`."""
        return np.arange(len(self)) if self.samples is None else self.samples

    def normalizer(self) -> Normalizer | TokenIds | AsFloat:
        return input_transform(self.kind, self.mean, self.std)


class Normalizer:
    """Turns a uint8 image batch into a normalised float32 batch on the batch's device."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]):
        self.scale = torch.tensor([1.0 / (255.0 * s) for s in std]).view(1, -1, 1, 1)
        self.shift = torch.tensor([m / s for m, s in zip(mean, std, strict=True)]).view(1, -1, 1, 1)

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        if self.scale.device != batch.device:
            self.scale, self.shift = self.scale.to(batch.device), self.shift.to(batch.device)
        return batch.float().mul_(self.scale).sub_(self.shift)


class AsFloat:
    """Gives float32 feature vectors to the model as they are."""

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        return batch.float()


class TokenIds:
    """Turns a uint8 batch of token indices into the int64 indices an embedding takes."""

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        return batch.long()


def input_transform(kind: str, mean: tuple[float, ...], std: tuple[float, ...],
                    ) -> Normalizer | TokenIds | AsFloat:
    """What turns a stored batch of ``kind`` into the model's input: images without a mean and
    standard deviation are float images, used as given."""
    if kind == TOKENS:
        return TokenIds()
    return AsFloat() if kind == FEATURES or not mean else Normalizer(mean, std)


#: how to get a damaged dataset file back, for error messages
_REFETCH = ("download it again (Fashion-MNIST from Debian: `apt-get install --reinstall "
            "dataset-fashion-mnist`; otherwise set download = true, or copy the original file)")


def _read_idx(path: Path) -> np.ndarray:
    """Read an idx(.gz) file: a 4-byte magic whose last byte is the rank, then big-endian dims."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            raw = handle.read()
    except (EOFError, zlib.error, gzip.BadGzipFile) as err:  # a cut-off download, a bad copy
        raise ConfigError(f"Dataset file '{path}' is truncated or corrupt ({err}); delete it "
                          f"and {_REFETCH}.") from err
    except OSError as err:
        raise ConfigError(f"Dataset file '{path}' cannot be read ({err.strerror or err}).") from err
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ConfigError(f"Dataset file '{path}' is not an unsigned-byte idx file; replace it "
                          "with the original download.")
    rank = raw[3]
    dims = np.frombuffer(raw, dtype=">u4", count=rank, offset=4).astype(np.int64)
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * rank)
    if data.size != int(np.prod(dims)):
        raise ConfigError(f"Dataset file '{path}' is truncated ({data.size} of "
                          f"{int(np.prod(dims))} values); {_REFETCH}.")
    return data.reshape(tuple(dims))


def _find_idx_dir(candidates: list[Path]) -> Path | None:
    for directory in candidates:
        first = directory / _IDX_FILES["train"][0]
        if first.exists() or first.with_name(first.name + ".gz").exists():
            return directory
    return None


def _load_idx_pair(directory: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    arrays = []
    for stem in _IDX_FILES[split]:
        path = directory / stem
        if not path.exists():
            path = path.with_name(stem + ".gz")
        if not path.exists():
            raise ConfigError(f"Dataset file '{directory / stem}(.gz)' is missing; the directory "
                              "must hold all four idx files.")
        arrays.append(_read_idx(path))
    return arrays[0], arrays[1]


def _load_mnist_like(name: str, root: Path | None, download: bool) -> tuple[np.ndarray, np.ndarray]:
    folder = "FashionMNIST" if name == "fashion-mnist" else "MNIST"
    candidates = []
    if root is not None:
        candidates += [root, root / folder / "raw"]
    elif name == "fashion-mnist":
        candidates.append(DEBIAN_FASHION_MNIST)
    else:
        candidates += [Path("data"), Path("data") / folder / "raw"]
    directory = _find_idx_dir(candidates)
    if directory is None and download:
        import torchvision

        target = root or Path("data")
        cls = torchvision.datasets.FashionMNIST if folder == "FashionMNIST" else (
            torchvision.datasets.MNIST)
        for train in (True, False):
            cls(str(target), train=train, download=True)
        directory = _find_idx_dir([target / folder / "raw"])
    if directory is None:
        where = ", ".join(str(c) for c in candidates)
        if name == "fashion-mnist" and root is None:
            raise ConfigError(f"Fashion-MNIST was not found in {where}: install it with "
                              "`apt-get install dataset-fashion-mnist` (as root), or set "
                              "data-root to a directory holding its four idx files.")
        raise ConfigError(f"{name} was not found in {where}: set data-root to a directory "
                          f"holding its idx files (or {folder}/raw/), or set download = true.")
    train_x, train_y = _load_idx_pair(directory, "train")
    test_x, test_y = _load_idx_pair(directory, "test")
    images = np.concatenate([train_x, test_x])[:, None, :, :]
    return images, np.concatenate([train_y, test_y]).astype(np.int64)


#: torchvision's extracted CIFAR folders: the folder, the batch files (train, then test) and the
#: labels' key in each
_CIFAR_FILES = {
    "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"],
                b"labels"),
    "cifar100": ("cifar-100-python", ["train", "test"], b"fine_labels"),
}
_CLASSES = {"fashion-mnist": 10, "mnist": 10, "cifar10": 10, "cifar100": 100}
#: the built-in datasets' class names, in label order (as torchvision's ``classes``)
CLASS_NAMES = {
    "fashion-mnist": ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                      "Sneaker", "Bag", "Ankle boot"),
    "mnist": tuple(str(d) for d in range(10)),
    "cifar10": ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                "truck"),
}


def _read_cifar_batch(path: Path, labels_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR batch file (a pickled dict: ``data`` N x 3072 uint8 in channel-major order,
    and the labels), as N x 3 x 32 x 32 images and int64 labels."""
    import pickle

    if not path.is_file():
        raise ConfigError(f"CIFAR file '{path}' is missing; the folder must hold all of "
                          "torchvision's extracted batch files.")
    try:
        with open(path, "rb") as handle:
            batch = pickle.load(handle, encoding="bytes")
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        labels = np.asarray(batch[labels_key], dtype=np.int64)
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"CIFAR file '{path}' is truncated or not a CIFAR batch "
                          f"({type(err).__name__}: {err}); delete it and {_REFETCH}.") from err
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data):
        raise ConfigError(f"CIFAR file '{path}' holds data of shape {data.shape} and "
                          f"{len(labels)} labels; a batch is N x 3072 values with N labels.")
    return data.reshape(-1, 3, 32, 32), labels


def _load_cifar(name: str, root: Path | None, download: bool) -> tuple[np.ndarray, np.ndarray]:
    """CIFAR-10 or CIFAR-100 from torchvision's extracted files under ``root`` (default
    ``./data``), read directly (train batches, then test), or downloaded by torchvision first
    with ``download`` (which verifies the archive)."""
    folder, files, labels_key = _CIFAR_FILES[name]
    target = root or Path("data")
    directory = target / folder
    if not directory.is_dir() and download:
        import torchvision

        cls = torchvision.datasets.CIFAR10 if name == "cifar10" else torchvision.datasets.CIFAR100
        try:
            for train in (True, False):
                cls(str(target), train=train, download=True)
        except (RuntimeError, OSError) as err:
            raise ConfigError(f"{name} could not be downloaded into '{target}' ({err}); copy "
                              f"torchvision's extracted {folder}/ there instead.") from None
    if not directory.is_dir():
        raise ConfigError(f"{name} was not found: '{directory}' does not exist; set data-root to "
                          f"the directory holding torchvision's extracted {folder}/, or set "
                          "download = true on a machine with internet access.")
    parts = [_read_cifar_batch(directory / file, labels_key) for file in files]
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    classes = _CLASSES[name]
    if labels.min() < 0 or labels.max() >= classes:
        raise ConfigError(f"{name} under '{directory}' has labels outside 0..{classes - 1}; its "
                          "files are not this dataset's.")
    return np.ascontiguousarray(images), labels


@cached(maxsize=2)
def load_dataset(name: str, data_root: str = "", download: bool = False, tokenizer: str = "",
                 sequence_length: int = 80, image_size: int = 0,
                 columns: tuple[str, ...] = ("", "", "", ""), cache_dir: str = "",
                 task: str = "classification") -> Dataset:
    """Load a dataset once per process (cached): pooled train+test images as uint8, or a text
    dataset's token windows (``tokenizer``: ``characters`` or a language model's name;
    ``sequence_length`` tokens of context a sample). ``columns``: a Hugging Face dataset's or a
    table's input, label, client and split columns (:mod:`pflalign.data.hf_source`,
    :func:`pflalign.data.sources.load_table`; empty: found);
    ``cache_dir``: where decoded images are kept (the ``cache-dir`` key); ``task = regression``:
    float targets (npz and tables only)."""
    from pflalign.data import hf_source, sources

    if name.startswith(hf_source.HF):
        return Dataset(**hf_source.load_hf(name, tuple(columns)[:3], image_size, cache_dir))
    if sources.npz_path(name) is not None:
        return Dataset(**sources.load_npz(name, task))
    if sources.table_path(name) is not None:
        return Dataset(**sources.load_table(name, columns, task))
    if name.startswith(sources.IMAGEFOLDER):
        return Dataset(**sources.load_imagefolder(name, image_size, cache_dir))
    if name.startswith(sources.TEXT):
        texts = sources.read_texts(name)
        if tokenizer in ("", CHARACTERS):
            sources.check_characters(name, texts)
        return _text_dataset(name, texts, tokenizer, sequence_length)
    if name.startswith(sources.JSONL):
        from pflalign.data.instructions import load_instructions

        return Dataset(**load_instructions(name, tokenizer, sequence_length))
    sources.check_dataset_name(name)
    root = Path(data_root).expanduser() if data_root else None
    if name == "shakespeare":
        return _load_shakespeare(root, tokenizer, sequence_length)
    if name in ("fashion-mnist", "mnist"):
        images, labels = _load_mnist_like(name, root, download)
    else:
        images, labels = _load_cifar(name, root, download)
    if len(images) != len(labels):
        raise ConfigError(f"Dataset '{name}' has {len(images)} images but {len(labels)} labels; "
                          "its files are inconsistent.")
    images.setflags(write=False)
    labels.setflags(write=False)
    mean, std = _NORMALISATION[name]
    return Dataset(name=name, images=images, labels=labels,
                   num_classes=_CLASSES[name],
                   mean=mean, std=std, class_names=CLASS_NAMES.get(name, ()))


def _load_shakespeare(root: Path | None, tokenizer: str, length: int) -> Dataset:
    """Federated Shakespeare (:mod:`pflalign.data.shakespeare`): one stream of every role's tokens,
    windows of ``length`` tokens over it, and each window's role. With characters (LEAF's task)
    a sample is ``length`` characters and the next one, at every position; with a language
    model's tokenizer it is a window of ``length`` tokens and the same window one token on (the
    next token at every place), the windows ``length`` apart."""
    from pflalign.data import shakespeare

    roots = [root] if root is not None else shakespeare.default_roots()
    found = next((r for r in roots if r.exists()), None)
    if found is None:
        raise ConfigError(f"data-root: the Shakespeare texts were not found in "
                          f"{', '.join(str(r) for r in roots)}; {shakespeare.FETCH}.")
    roles = shakespeare.read_roles(found)
    return _text_dataset("shakespeare", [(f"{r.play}/{r.name}", r.text) for r in roles],
                         tokenizer, length)


def _text_dataset(name: str, texts: list[tuple[str, str]], tokenizer: str,
                  length: int) -> Dataset:
    """A text dataset of one natural client per (name, text): with characters, a sample is
    ``length`` characters of the 80-symbol vocabulary and the next one, at every position; with
    a language model's tokenizer, a window of ``length`` tokens and the same window one token on,
    the windows ``length`` apart. A window and its target lie inside one client's text."""
    from pflalign.data import shakespeare

    names = tuple(group for group, _ in texts)
    characters = tokenizer in ("", CHARACTERS)
    if characters:
        encoded = [shakespeare.encode(text) for _, text in texts]
        stride, vocabulary = 1, len(shakespeare.VOCABULARY)
    else:
        from pflalign.models.language import tokenizer_of

        tok = tokenizer_of(tokenizer)
        encoded = [np.asarray(ids, dtype=np.int32) for ids in
                   tok([text for _, text in texts], add_special_tokens=False)["input_ids"]]
        stride, vocabulary = length, len(tok)
    stream = np.concatenate(encoded)
    stream.setflags(write=False)
    starts = np.cumsum([0] + [len(e) for e in encoded[:-1]])
    # a window and its target must lie inside one role: positions p with p + length < end
    counts = np.array([max(-(-(len(e) - length) // stride), 0) for e in encoded])
    samples = np.concatenate([s + stride * np.arange(c)
                              for s, c in zip(starts, counts, strict=True)]).astype(np.int64)
    if not counts.any():
        raise ConfigError(f"dataset = {name!r}: no client's text is longer than "
                          f"sequence-length = {length} tokens; lower sequence-length.")
    groups = np.repeat(np.arange(len(texts), dtype=np.int32), counts)
    windows = np.lib.stride_tricks.sliding_window_view(stream, length)[:-1]
    if characters:  # the next character
        labels = stream[length:].astype(np.int64)
    else:  # the same window one token on
        labels = np.lib.stride_tricks.sliding_window_view(stream[1:].astype(np.int64), length)
    labels.setflags(write=False)
    return Dataset(name=name, images=windows, labels=labels, num_classes=vocabulary,
                   mean=(), std=(), kind=TOKENS, samples=samples, groups=groups,
                   group_names=names, tokens=stream, time_ordered=True)


@dataclass
class ClientData:
    """One client's train and test split as tensors (uint8 images, int64 labels) on a device;
    ``masked_targets``: some labels are :data:`IGNORE_INDEX` (instructions), left out of the
    loss and the scores."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    normalize: Normalizer | TokenIds | AsFloat
    masked_targets: bool = False

    @classmethod
    def from_indices(cls, dataset: Dataset, train_idx: np.ndarray, test_idx: np.ndarray,
                     device: torch.device | str = "cpu") -> ClientData:
        def take(idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.from_numpy(dataset.images[idx]).to(device)
            y = torch.from_numpy(dataset.labels[idx]).to(device)
            return x, y

        train_x, train_y = take(train_idx)
        test_x, test_y = take(test_idx)
        return cls(train_x, train_y, test_x, test_y, dataset.normalizer(),
                   dataset.masked_targets)

    def rotated(self, degrees: float) -> ClientData:
        """The same samples with every image rotated by ``degrees`` counter-clockwise about its
        centre (exact for multiples of 90; bilinear otherwise, corners filled with 0)."""
        return replace(self, train_x=rotate_images(self.train_x, degrees),
                       test_x=rotate_images(self.test_x, degrees))

    def to(self, device: torch.device | str) -> ClientData:
        return replace(self, train_x=self.train_x.to(device), train_y=self.train_y.to(device),
                       test_x=self.test_x.to(device), test_y=self.test_y.to(device))

    @property
    def num_train(self) -> int:
        return len(self.train_y)

    @property
    def num_test(self) -> int:
        """What a test scores: samples, or a language model's tokens (each window predicts
        one per place; of an instruction, its response's tokens)."""
        if self.masked_targets:
            return int((self.test_y != IGNORE_INDEX).sum())
        return self.test_y.numel()


def rotate_images(images: torch.Tensor, degrees: float) -> torch.Tensor:
    """Rotate uint8 NCHW images by ``degrees`` counter-clockwise (multiples of 90 exactly)."""
    quarter = degrees / 90.0
    if quarter == int(quarter):
        return torch.rot90(images, int(quarter) % 4, dims=(2, 3)).contiguous()
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2.functional import rotate

    return rotate(images, degrees, interpolation=InterpolationMode.BILINEAR)
