import gzip
import struct

import numpy as np
import pytest

from pflalign.data.datasets import _read_idx, load_dataset
from pflalign.process import caches
from pflalign.run.config import ConfigError


def _write_idx(path, array: np.ndarray) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(
        f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def _write_mnist_like(directory, n_train=12, n_test=4, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n).astype(np.uint8)
        _write_idx(directory / f"{split}-images-idx3-ubyte.gz", images)
        _write_idx(directory / f"{split}-labels-idx1-ubyte.gz", labels)
        arrays[split] = (images, labels)
    return arrays


def test_idx_reader_round_trip(tmp_path):
    a = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    _write_idx(tmp_path / "x.gz", a)
    assert np.array_equal(_read_idx(tmp_path / "x.gz"), a)


def test_idx_reader_rejects_corrupt_files(tmp_path):
    path = tmp_path / "bad.gz"
    with gzip.open(path, "wb") as f:
        f.write(b"\x00\x00\x0d\x01" + struct.pack(">I", 3) + b"abc")
    with pytest.raises(ConfigError, match="not an unsigned-byte idx file"):
        _read_idx(path)
    with gzip.open(path, "wb") as f:
        f.write(b"\x00\x00\x08\x01" + struct.pack(">I", 10) + b"abc")
    with pytest.raises(ConfigError, match="truncated"):
        _read_idx(path)


def test_data_root_with_idx_files_is_read_and_pooled(tmp_path):
    written = _write_mnist_like(tmp_path)
    ds = load_dataset("fashion-mnist", str(tmp_path))
    assert ds.images.shape == (16, 1, 28, 28)
    assert np.array_equal(ds.images[:12, 0], written["train"][0])
    assert np.array_equal(ds.labels[12:], written["t10k"][1])


def test_torchvision_raw_layout_is_found(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    _write_mnist_like(raw, n_train=6, n_test=2)
    assert len(load_dataset("mnist", str(tmp_path))) == 8


def test_missing_dataset_names_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="set data-root"):
        load_dataset("mnist", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="set data-root|download = true"):
        load_dataset("cifar10", str(tmp_path / "empty"))


def test_missing_debian_fashion_mnist_says_apt_get(monkeypatch, tmp_path):
    import pflalign.data.datasets as data

    monkeypatch.setattr(data, "DEBIAN_FASHION_MNIST", tmp_path / "nowhere")
    caches.reset()
    try:
        with pytest.raises(ConfigError, match="apt-get install dataset-fashion-mnist"):
            data.load_dataset("fashion-mnist")
    finally:
        caches.reset()


def test_the_content_fingerprint_follows_the_data_not_its_name():
    from dataclasses import replace

    from pflalign.data.datasets import Dataset
    from pflalign.data.federated import FederatedDataset

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (40, 1, 4, 4), dtype=np.uint8)
    labels = rng.integers(0, 3, 40).astype(np.int64)
    data = Dataset("a", images, labels, 3, (0.5,), (0.25,))
    pool = np.arange(0, 40, 2)

    def fingerprint(dataset, rows=pool):
        return FederatedDataset(dataset=dataset, pool=rows, partition=None).fingerprint()

    first = fingerprint(data)
    assert len(first) == 16 and int(first, 16) >= 0
    assert fingerprint(replace(data, name="b", images=images.copy())) == first
    changed = labels.copy()
    changed[2] = (changed[2] + 1) % 3  # a label in use
    assert fingerprint(replace(data, labels=changed)) != first
    unused = labels.copy()
    unused[3] = (unused[3] + 1) % 3  # a row the pool leaves out
    assert fingerprint(replace(data, labels=unused)) == first
    assert fingerprint(data, pool[:-1]) != first
