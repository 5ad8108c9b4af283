"""CIFAR-10 and CIFAR-100 from files in torchvision's extracted on-disk format (pickled batches
of N x 3072 uint8 rows, channel-major), written here with a few hundred images, so the loading
path runs without a download: the pooled arrays equal what was written (train batches, then
test), a CIFAR-10 run agrees on the sequential and batched engines, and a damaged batch
is one sentence."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from harness import three_engines
from test_sources import RUN

from pflalign.data.datasets import load_dataset
from pflalign.run.config import build_settings
from pflalign.settings.options import ConfigError


def write_cifar(root, name: str, per_file: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The batch files of ``name`` under ``root``; returns every image (N x 3 x 32 x 32) and
    label in the order the files pool them."""
    rng = np.random.default_rng(seed)
    if name == "cifar10":
        folder, files, key, classes = "cifar-10-batches-py", [
            f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"], b"labels", 10
    else:
        folder, files, key, classes = "cifar-100-python", ["train", "test"], b"fine_labels", 100
    (root / folder).mkdir(parents=True)
    images, labels = [], []
    for file in files:
        y = rng.integers(0, classes, per_file)
        x = rng.integers(0, 120, (per_file, 3, 32, 32), dtype=np.uint8)
        for k in range(classes):  # a class is a bright patch in a place of its own
            x[y == k, k % 3, 3 * (k % 10):3 * (k % 10) + 3, 3 * (k // 10):3 * (k // 10) + 3] = 255
        with open(root / folder / file, "wb") as handle:
            pickle.dump({b"data": x.reshape(per_file, -1), key: y.tolist(),
                         b"batch_label": file.encode()}, handle)
        images.append(x)
        labels.append(y)
    return np.concatenate(images), np.concatenate(labels)


def test_cifar10_files_load_and_run_on_every_engine(tmp_path):
    images, labels = write_cifar(tmp_path / "data", "cifar10", per_file=60)
    dataset = load_dataset("cifar10", str(tmp_path / "data"))
    assert np.array_equal(dataset.images, images) and np.array_equal(dataset.labels, labels)
    assert dataset.num_classes == 10 and dataset.input_shape == (3, 32, 32)
    results = three_engines({**RUN, "dataset": "cifar10", "data-root": str(tmp_path / "data"),
                             "model": "cnn", "methods": "fedavg,pflalign"}, tmp_path / "runs",
                            compared_at_least=40, flower=False)
    clients = results["partition"]["clients"]
    assert sum(c["num-train"] + c["num-test"] for c in clients) == len(labels)


def test_cifar100_files_load(tmp_path):
    images, labels = write_cifar(tmp_path, "cifar100", per_file=150)
    dataset = load_dataset("cifar100", str(tmp_path))
    assert np.array_equal(dataset.images, images) and np.array_equal(dataset.labels, labels)
    assert dataset.num_classes == 100
    settings = build_settings({"dataset": "cifar100", "data-root": str(tmp_path), "model": "cnn"})
    assert settings["dataset"] == "cifar100"


def test_missing_and_damaged_cifar_files_are_one_sentence(tmp_path):
    with pytest.raises(ConfigError, match="cifar10 was not found: .*cifar-10-batches-py' does not "
                       "exist; set data-root"):
        load_dataset("cifar10", str(tmp_path / "empty"))
    write_cifar(tmp_path, "cifar10", per_file=10)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(ConfigError, match="data_batch_3' is missing"):
        load_dataset("cifar10", str(tmp_path))
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    batch.write_bytes((tmp_path / "cifar-10-batches-py" / "data_batch_2").read_bytes()[:500])
    with pytest.raises(ConfigError, match="data_batch_3' is truncated or not a CIFAR batch"):
        load_dataset("cifar10", str(tmp_path))
