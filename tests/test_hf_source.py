"""Hugging Face datasets (``dataset = hf:NAME_OR_PATH``) and flwr-datasets' partitioners
(``partition = flwr:<Partitioner>``), on data written here with ``save_to_disk`` (offline).

One short run goes through the sequential and batched engines, which must agree bit for bit
(:func:`harness.three_engines`; a Flower node reads the data through the same loader, which
test_tables' CSV runs on Flower); the rest are unit tests without a
run: the columns found or named, what is read against what was written, bad data in one
sentence before anything runs, and a partitioner's clients being exactly the ones it gives
itself. flwr-datasets cannot be installed beside this project's ``huggingface_hub`` 2
(:mod:`pflalign.data.flwr_partitioners`), so the adapter is tested on a stand-in partitioner
module with flwr-datasets' interface, and on the real library where it is installed.
"""

from __future__ import annotations

import re
import sys
import tomllib
import types
from collections import Counter

import datasets
import numpy as np
import pytest
from conftest import ROOT
from harness import three_engines

from pflalign.data.datasets import load_dataset
from pflalign.data.federated import federated_dataset
from pflalign.data.partition import make_partition
from pflalign.data.sources import dataset_kind, has_natural_clients
from pflalign.run.config import build_settings
from pflalign.settings.options import ConfigError

RUN = {"num-clients": 4, "rounds": 2, "eval-every": 1, "fraction-train": 1.0, "seed": 2,
       "local-epochs": 1, "batch-size": 16, "min-samples-per-client": 5}
CLIENTS = ("ana", "bo", "cy", "dee", "ed")


@pytest.fixture(autouse=True)
def _quiet():
    """No progress bars from save_to_disk in the test output."""
    datasets.disable_progress_bars()
    yield
    datasets.enable_progress_bars()


def square_images(n: int, side: int = 8, classes: int = 3, seed: int = 0,
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Greyscale images whose class is a bright square in one of ``classes`` places, on noise."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    images = rng.integers(0, 80, (n, side, side), dtype=np.uint8)
    for k in range(classes):
        images[labels == k, 2 * k:2 * k + 3, 2:5] = 250
    return images, labels


def write_images(folder, n: int = 120) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A DatasetDict (train and test splits) of 8 x 8 PNG images, a ClassLabel and each
    sample's client (a string column named client)."""
    images, labels = square_images(n)
    clients = np.random.default_rng(1).choice(np.array(CLIENTS), n)
    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=["a", "b", "c"]),
                                  "client": datasets.Value("string")})
    whole = datasets.Dataset.from_dict({"image": list(images), "label": labels,
                                        "client": clients.tolist()}, features=features)
    cut = n * 3 // 4
    datasets.DatasetDict({"train": whole.select(range(cut)),
                          "test": whole.select(range(cut, n))}).save_to_disk(str(folder))
    return images, labels, clients


def save(folder, columns: dict, features: dict | None = None) -> str:
    """A Dataset of ``columns`` written to ``folder``; its dataset value."""
    table = datasets.Dataset.from_dict(
        columns, features=None if features is None else datasets.Features(features))
    table.save_to_disk(str(folder))
    return f"hf:{folder}"


def test_images_with_a_client_column_run_on_every_engine(tmp_path):
    folder = tmp_path / "squares"
    images, labels, clients = write_images(folder)
    cache = tmp_path / "cache"
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    results = three_engines({**RUN, "dataset": f"hf:{folder}", "model": "mlp",
                             "methods": "fedavg,pflalign", "partition": "natural",
                             "cache-dir": str(cache)}, tmp_path, compared_at_least=40,
                            flower=False)
    sizes = Counter(clients.tolist())
    run_clients = results["partition"]["clients"]
    assert len(run_clients) == 4
    for c in run_clients:  # each client is one of the data's, with all of its samples
        assert c["num-train"] + c["num-test"] == sizes[c["name"]]
    # what the run read is what was written: the splits pooled in order, decoded as written
    dataset = load_dataset(f"hf:{folder}", cache_dir=str(cache))
    assert np.array_equal(dataset.images[:, 0], images) and np.array_equal(dataset.labels, labels)
    assert dataset.input_shape == (1, 8, 8) and dataset.num_classes == 3
    assert np.allclose(dataset.mean, [images.mean() / 255], rtol=1e-9)
    # decoded once: the array kept in cache-dir, not in the data folder, is what a load reads
    (cached,) = (cache / "images").glob("hf-*.npy")
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before
    assert np.array_equal(np.load(cached), dataset.images)


def test_columns_are_found_by_name_and_type(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3)).astype(np.float32)
    y = np.arange(40) % 4
    # numeric columns: every one but the label's is a feature, in the columns' order
    name = save(tmp_path / "numbers", {"b": x[:, 0], "a": x[:, 1], "label": y, "c": x[:, 2],
                                       "note": ["p", "q"] * 20})
    assert dataset_kind(name) == "features" and not has_natural_clients(name)
    read = load_dataset(name)
    assert np.array_equal(read.images, x) and read.num_classes == 4 and read.mean == ()
    # named: two of them as the inputs, and a column of strings as the clients
    named = ("c,a", "", "note")
    assert has_natural_clients(name, named)
    read = load_dataset(name, columns=named)
    assert np.array_equal(read.images, x[:, [2, 1]]) and read.group_names == ("p", "q")
    # a column of number lists; the one ClassLabel column; a client_id column
    name = save(tmp_path / "vectors", {"vec": x.tolist(), "digit": y, "client_id": y % 2},
                {"vec": datasets.List(datasets.Value("float32")),
                 "digit": datasets.ClassLabel(num_classes=5), "client_id": datasets.Value("int8")})
    assert has_natural_clients(name)
    read = load_dataset(name)
    assert np.array_equal(read.images, x) and read.num_classes == 5  # the ClassLabel's names
    assert read.group_names == ("0", "1") and np.array_equal(read.groups, y % 2)
    # uint8 arrays channels last, turned channels first and resized by image-size
    pixels = rng.integers(0, 255, (12, 6, 6, 3), dtype=np.uint8)
    name = save(tmp_path / "arrays", {"img": list(pixels), "label": np.arange(12) % 2},
                {"img": datasets.Array3D((6, 6, 3), "uint8"), "label": datasets.Value("int64")})
    assert dataset_kind(name) == "image"
    assert np.array_equal(load_dataset(name).images, pixels.transpose(0, 3, 1, 2))
    assert load_dataset(name, image_size=4).input_shape == (3, 4, 4)


def test_images_of_several_sizes_need_image_size(tmp_path):
    small, _ = square_images(6, side=8)
    large, _ = square_images(6, side=10)
    name = save(tmp_path / "mixed", {"image": list(small) + list(large),
                                     "label": np.arange(12) % 2},
                {"image": datasets.Image(), "label": datasets.Value("int64")})
    with pytest.raises(ConfigError, match="the images have 2 sizes .* set image-size = N"):
        load_dataset(name)
    assert load_dataset(name, image_size=8).input_shape == (1, 8, 8)


def test_a_relative_folder_is_the_same_for_every_process(tmp_path, monkeypatch):
    write_images(tmp_path / "squares", n=40)
    monkeypatch.chdir(tmp_path)
    settings = build_settings({"dataset": "hf:squares", "model": "mlp"})
    assert settings["dataset"] == f"hf:{tmp_path / 'squares'}"


@pytest.mark.parametrize("columns, keys, words", [
    ({"x": [0.5] * 6, "label": ["cat", "dog"] * 3}, {},
     "the label column 'label' holds Value('string'); labels must be integers 0..K-1, a "
     "ClassLabel or an integer column: dataset.class_encode_column('label') makes one"),
    ({"x": [0.5] * 6, "label": [0.0, 1.0] * 3}, {},
     "the label column 'label' holds Value('float64'); labels must be integers"),
    ({"x": [0.5] * 6, "label": [0, 1, -1, 0, 1, 0]}, {},
     "the label column 'label' holds -1; labels must be 0..K-1."),
    ({"x": [0.5] * 6, "label": [0] * 6}, {}, "the labels hold one class"),
    ({"x": [0.5] * 6, "y": [0, 1] * 3}, {},
     "has no 'label' or 'labels' column and no ClassLabel columns; name the labels with "
     "label-column (its columns are x, y)"),
    ({"x": [0.5] * 6, "label": [0, 1] * 3}, {"label-column": "target"},
     "has no column 'target' (label-column); its columns are x, label"),
    ({"x": [0.5] * 6, "label": [0, 1] * 3}, {"input-column": "label"},
     "input-column names 'label', the label or client column"),
    ({"text": ["a b"] * 6, "label": [0, 1] * 3}, {},
     "has no Image column, no 'image' or 'img' column, and no numeric columns besides the "
     "labels; name the inputs with input-column"),
    ({"text": ["a b"] * 6, "label": [0, 1] * 3}, {"input-column": "text"},
     "column 'text' holds Value('string'); inputs must be images"),
    ({"x": [0.5] * 6, "label": [0, 1] * 3, "client": [0.5] * 6}, {},
     "the client column 'client' holds Value('float64'); give each sample's client as an "
     "integer or a string"),
])
def test_bad_data_is_one_sentence_before_anything_runs(tmp_path, columns, keys, words):
    name = save(tmp_path / "bad", columns)
    with pytest.raises(ConfigError, match=re.escape(words)):
        build_settings({"dataset": name, "model": "mlp", **keys})


def test_bad_folders_keys_and_a_missing_library(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="the folder does not exist; write one with "
                       "Dataset.save_to_disk"):
        build_settings({"dataset": f"hf:{tmp_path / 'none'}"})
    (tmp_path / "plain").mkdir()
    with pytest.raises(ConfigError, match="the folder was not written by save_to_disk"):
        build_settings({"dataset": f"hf:{tmp_path / 'plain'}"})
    with pytest.raises(ConfigError, match="there is no folder 'nobody/nothing' here, and the "
                       "Hugging Face hub did not give that dataset"):
        build_settings({"dataset": "hf:nobody/nothing"})  # offline: HF_HUB_OFFLINE (conftest)
    with pytest.raises(ConfigError, match="label-column = 'y' names a column of a Hugging Face "
                       "dataset or a table, and dataset = 'fashion-mnist' is neither"):
        build_settings({"label-column": "y"})
    name = save(tmp_path / "plain-features", {"x": [0.5, 0.2] * 10, "label": [0, 1] * 10})
    with pytest.raises(ConfigError, match="partition = 'natural' needs a dataset with its own "
                       "clients"):
        build_settings({"dataset": name, "model": "mlp", "partition": "natural"})
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(ConfigError, match=re.escape('not installed: pip install "pflalign[hf]"')):
        build_settings({"dataset": f"hf:{tmp_path / 'other'}"})


def test_the_page_example_writes_a_dataset_its_config_reads(tmp_path, monkeypatch):
    """docs/data.md's Hugging Face example, its Python as written and its config read (the
    run itself is the engine test's above)."""
    page = (ROOT / "docs" / "data.md").read_text()
    section = page.split("\n### Hugging Face datasets", 1)[1].split("\n## ", 1)[0]
    (script,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    (config,) = re.findall(r"```toml\n(.*?)```", section, flags=re.S)
    monkeypatch.chdir(tmp_path)
    exec(compile(script, "docs/data.md", "exec"), {})
    settings = build_settings(tomllib.loads(config))
    dataset = load_dataset(settings["dataset"])
    assert len(dataset) == 300 and dataset.input_shape == (1, 12, 12)
    assert dataset.num_classes == 3


# --- flwr-datasets' partitioners ----------------------------------------------------------------
class _StandIn:
    """What pflalign uses of flwr-datasets' ``Partitioner``: ``dataset`` set once, then
    ``num_partitions`` and ``load_partition(i)`` (a ``datasets.Dataset`` of partition i's
    rows)."""

    made: list = []

    def __init__(self):
        self._dataset = None
        _StandIn.made.append(self)

    @property
    def dataset(self):
        return self._dataset

    @dataset.setter
    def dataset(self, value):
        self._dataset = value


class DrawPartitioner(_StandIn):
    """Each row to a client drawn from the seed, then moved ``shift`` clients on."""

    def __init__(self, num_partitions: int, partition_by: str, shift: int = 0,
                 seed: int | None = 42):
        super().__init__()
        if shift < 0:
            raise ValueError("shift must be >= 0")
        self.count, self.by, self.shift, self.seed = num_partitions, partition_by, shift, seed

    @property
    def num_partitions(self) -> int:
        return self.count

    def owners(self) -> np.ndarray:
        rows = len(self.dataset)
        return (np.random.default_rng(self.seed).integers(0, self.count, rows)
                + self.shift) % self.count

    def load_partition(self, partition_id: int):
        return self.dataset.select(np.flatnonzero(self.owners() == partition_id))


class FixedPartitioner(_StandIn):
    """Three partitions, whatever num-clients says, and a required argument."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    num_partitions = 3


@pytest.fixture
def stand_in(monkeypatch):
    """flwr_datasets.partitioner as the stand-in module (made and reset for each test)."""
    module = types.ModuleType("flwr_datasets.partitioner")
    module.Partitioner = _StandIn
    module.DrawPartitioner = DrawPartitioner
    module.FixedPartitioner = FixedPartitioner
    package = types.ModuleType("flwr_datasets")
    package.partitioner = module
    monkeypatch.setitem(sys.modules, "flwr_datasets", package)
    monkeypatch.setitem(sys.modules, "flwr_datasets.partitioner", module)
    _StandIn.made = []
    return module


def test_a_partitioner_gives_the_clients_it_gives_itself(tmp_path, stand_in):
    name = save(tmp_path / "features", {"x": np.arange(200, dtype=np.float32) / 200,
                                        "label": np.arange(200) % 4})
    settings = build_settings({"dataset": name, "model": "mlp", "num-clients": 3,
                               "num-unseen-clients": 1, "seed": 7,
                               "partition": "flwr:DrawPartitioner",
                               "partition-args": "shift=2"})
    federation = federated_dataset(settings)
    partitioner = _StandIn.made[-1]
    assert (partitioner.count, partitioner.by, partitioner.seed, partitioner.shift) == (
        4, "label", 7, 2)  # num-clients + unseen, the labels, the run's seed, the user's
    assert np.array_equal(np.asarray(partitioner.dataset["label"][:]), np.arange(200) % 4)
    partition = federation.partition
    assert partition.num_clients == 4 and partition.num_train_clients == 3
    for i in range(4):  # client i's samples: partition i's rows, split into train and test
        own = np.flatnonzero(partitioner.owners() == i)
        got = np.sort(np.concatenate([partition.train[i], partition.test[i]]))
        assert np.array_equal(federation.pool[got], own)
        assert len(partition.test[i]) == len(own) // 4  # test-fraction 0.25, stratified


def test_a_partition_is_the_seeds(stand_in):
    labels = np.arange(300) % 5
    build = dict(scheme="flwr:DrawPartitioner", num_clients=4, min_samples=5,
                 partition_args="shift=1")
    first = make_partition(labels, 5, seed=3, **build)
    again = make_partition(labels, 5, seed=3, **build)
    other = make_partition(labels, 5, seed=4, **build)
    assert all(np.array_equal(a, b) for a, b in zip(first.train, again.train, strict=True))
    assert all(np.array_equal(a, b) for a, b in zip(first.test, again.test, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first.train, other.train, strict=True))


@pytest.mark.parametrize("partition, args, words", [
    ("flwr:NoSuchPartitioner", "",
     "flwr-datasets has no partitioner 'NoSuchPartitioner'; choose one of DrawPartitioner, "
     "FixedPartitioner"),
    ("flwr:", "", "partition = 'flwr:' needs a partitioner's class name"),
    ("flwr:DrawPartitioner", "alpha=0.5",
     "DrawPartitioner takes no argument 'alpha'; it takes shift"),
    ("flwr:DrawPartitioner", "seed=3", "partition-args gives seed, which pflalign gives "
     "DrawPartitioner itself \\(the run's seed\\); leave it out"),
    ("flwr:DrawPartitioner", "shift=-1", "partition = 'flwr:DrawPartitioner' refuses "
     "partition-args = 'shift=-1' \\(ValueError: shift must be >= 0\\); change partition-args"),
    ("flwr:DrawPartitioner", "shift", "'shift' is not name=value"),
    ("flwr:DrawPartitioner", "shift=1,shift=2", "gives 'shift' twice"),
    ("flwr:FixedPartitioner", "", "partition = 'flwr:FixedPartitioner' needs size: give it in "
     "partition-args"),
    ("dirichlet", "alpha=1", "partition-args = 'alpha=1' is for partition = "
     "flwr:<Partitioner>, and partition = 'dirichlet': clear partition-args"),
])
def test_bad_partitioners_and_arguments_are_one_sentence(stand_in, partition, args, words):
    with pytest.raises(ConfigError, match=words):
        build_settings({"partition": partition, "partition-args": args})


def test_partitions_the_run_cannot_use_are_one_sentence(stand_in, monkeypatch):
    labels = np.arange(60) % 3
    with pytest.raises(ConfigError, match="makes 3 partitions and the run has 4 clients"):
        make_partition(labels, 3, scheme="flwr:FixedPartitioner", num_clients=4,
                       partition_args="size=2")
    with pytest.raises(ConfigError, match="leaves client . with .* samples, below "
                       "min-samples-per-client = 30"):
        make_partition(labels, 3, scheme="flwr:DrawPartitioner", num_clients=4, min_samples=30)
    monkeypatch.setitem(sys.modules, "flwr_datasets", None)  # not installed
    monkeypatch.setitem(sys.modules, "flwr_datasets.partitioner", None)
    with pytest.raises(ConfigError, match=re.escape(
            'uses flwr-datasets, which is not installed: pip install '
            '"pflalign[flwr-partitioners]"')):
        build_settings({"partition": "flwr:DirichletPartitioner"})


def test_flwr_datasets_own_partitioners():
    """The real library, where it is installed (not beside this project's huggingface_hub 2):
    a client's samples are what the partitioner itself gives for it, by the run's seed."""
    partitioner = pytest.importorskip("flwr_datasets.partitioner")
    from pflalign.data.hf_source import column_values

    labels = np.random.default_rng(0).integers(0, 5, 400)
    table = datasets.Dataset.from_dict({"label": labels, "row": np.arange(400)})
    for scheme, args, own in (
            ("flwr:DirichletPartitioner", "alpha=0.5,min_partition_size=5",
             partitioner.DirichletPartitioner(num_partitions=5, partition_by="label", alpha=0.5,
                                              min_partition_size=5, seed=11)),
            ("flwr:IidPartitioner", "", partitioner.IidPartitioner(num_partitions=5)),
            ("flwr:PathologicalPartitioner", "num_classes_per_partition=2",
             partitioner.PathologicalPartitioner(num_partitions=5, partition_by="label",
                                                 num_classes_per_partition=2, seed=11))):
        own.dataset = table
        partition = make_partition(labels, 5, scheme=scheme, num_clients=4, num_unseen=1,
                                   seed=11, min_samples=2, partition_args=args)
        for i in range(5):  # the same rows of the pool
            got = np.sort(np.concatenate([partition.train[i], partition.test[i]]))
            assert np.array_equal(got, np.sort(column_values(own.load_partition(i), "row")))
        again = make_partition(labels, 5, scheme=scheme, num_clients=4, num_unseen=1, seed=11,
                               min_samples=2, partition_args=args)
        assert all(np.array_equal(a, b) for a, b in zip(partition.train, again.train,
                                                        strict=True))
    with pytest.raises(ConfigError, match="refuses partition-args = 'alpha=-1'"):
        build_settings({"partition": "flwr:DirichletPartitioner", "partition-args": "alpha=-1"})
