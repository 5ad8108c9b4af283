"""A researcher's own data (``dataset = npz:PATH``): written here, then run as a user runs it.

Each source runs a short simulation on the sequential and batched engines, which must agree bit
for bit (:func:`harness.three_engines`). A Flower engine's nodes read every source through the
same pooled loader; it runs on Flower in test_user_model.py (an npz file of images, under a
user's model), test_hf_source.py (a Hugging Face folder), test_tables.py (a CSV of features)
and test_shakespeare.py (text);
what the run read is checked against the file (per-channel moments, the natural clients and
their sizes). Bad files are one sentence each, raised before anything is written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from conftest import ROOT
from harness import three_engines

from pflalign.data.datasets import load_dataset
from pflalign.data.sources import dataset_kind
from pflalign.run.config import build_settings
from pflalign.settings.options import ConfigError

RUN = {"num-clients": 4, "rounds": 2, "eval-every": 1, "fraction-train": 1.0, "seed": 2,
       "local-epochs": 1, "batch-size": 16, "min-samples-per-client": 5}


def write_images(path, n: int = 480, classes: int = 3, side: int = 16, seed: int = 0) -> None:
    """Colour images whose class is a bright square in one of ``classes`` places, on noise."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    x = rng.integers(0, 80, (n, 3, side, side), dtype=np.uint8)
    for k in range(classes):
        x[y == k, k % 3, 4 * k:4 * k + 4, 4:8] = 250
    np.savez(path, x=x, y=y)


def write_features(path, n: int = 600, dim: int = 12, classes: int = 4, seed: int = 0) -> None:
    """Gaussian classes in ``dim`` dimensions, and six natural clients with their own skew."""
    rng = np.random.default_rng(seed)
    client = rng.choice(np.array(["ana", "bo", "cy", "dee", "ed", "flo"]), n)
    y = (rng.integers(0, classes, n) + (client == "ana")) % classes
    centres = rng.normal(0, 2, (classes, dim))
    x = (centres[y] + rng.normal(0, 1, (n, dim))).astype(np.float32)
    np.savez(path, x=x, y=y, client=client)


def test_images_from_an_npz_file(tmp_path):
    """What a run reads of an image file (on the sequential engine; the same images run on every
    engine, bit for bit, in test_user_model.py's run of a user's model on them)."""
    from pflalign.run.driver import simulate

    path = tmp_path / "images.npz"
    write_images(path)
    results = simulate(build_settings({**RUN, "dataset": f"npz:{path}", "model": "cnn",
                                       "methods": "fedavg", "partition": "dirichlet",
                                       "dirichlet-alpha": 0.5, "engine": "sequential",
                                       "out-dir": str(tmp_path / "out")}))
    # the run partitioned every sample of the file, by its labels
    with np.load(path) as data:
        x, y = data["x"], data["y"]
    clients = results["partition"]["clients"]
    counts = np.sum([np.add(c["train-labels"], c["test-labels"]) for c in clients], axis=0)
    assert counts.tolist() == np.bincount(y).tolist()
    # normalised by the file's own per-channel moments
    dataset = load_dataset(f"npz:{path}")
    scaled = x.astype(np.float64) / 255
    assert np.allclose(dataset.mean, scaled.mean(axis=(0, 2, 3)), rtol=1e-9)
    assert np.allclose(dataset.std, scaled.std(axis=(0, 2, 3)), rtol=1e-9)
    assert dataset.input_shape == (3, 16, 16) and dataset.num_classes == 3
    # a bright square is easy: the global model learns it in two rounds
    assert results["methods"]["fedavg"]["final"]["global-acc"] > 0.6


def test_feature_vectors_with_natural_clients(tmp_path):
    """The sequential and batched engines (an npz file read by the Flower engine's nodes is
    test_user_model's three-engine test; feature vectors on Flower, test_tables' CSV)."""
    path = tmp_path / "features.npz"
    write_features(path)
    assert dataset_kind(f"npz:{path}") == "features"
    results = three_engines({**RUN, "dataset": f"npz:{path}", "model": "mlp",
                             "methods": "fedavg,local", "partition": "natural"}, tmp_path,
                            compared_at_least=40, flower=False)
    with np.load(path) as data:
        sizes = Counter(data["client"].tolist())
    clients = results["partition"]["clients"]
    assert len(clients) == 4 and len({c["name"] for c in clients}) == 4
    for c in clients:  # each client is one of the file's, with all of its samples
        assert c["num-train"] + c["num-test"] == sizes[c["name"]]
    assert results["methods"]["local"]["final"]["personal-acc"] > 0.5


def test_a_relative_path_is_the_same_file_for_every_process(tmp_path, monkeypatch):
    write_images(tmp_path / "images.npz")
    monkeypatch.chdir(tmp_path)
    settings = build_settings({"dataset": "npz:images.npz"})
    assert settings["dataset"] == f"npz:{tmp_path / 'images.npz'}"


def _bad(tmp_path, name: str, **arrays) -> str:
    path = tmp_path / f"{name}.npz"
    np.savez(path, **arrays)
    return f"npz:{path}"


@pytest.mark.parametrize("arrays, words", [
    ({"x": np.zeros((5, 8, 8), np.uint8), "y": np.zeros(4, int)},
     "y has shape (4,) but x has 5 samples"),
    ({"x": np.zeros((5, 8, 8), np.uint8), "y": np.zeros(5, np.float32)},
     "y is float32; labels must be integers 0..K-1"),
    ({"x": np.zeros((5, 8, 8, 3), np.uint8), "y": np.zeros(5, int)},
     "channels last; images must be channels first: x.transpose(0, 3, 1, 2)"),
    ({"x": np.zeros((5, 8, 8), np.int32), "y": np.zeros(5, int)},
     "x is int32; give images as uint8 (0..255) or feature vectors as floats"),
    ({"x": np.zeros((5, 2, 2, 2, 2), np.float32), "y": np.zeros(5, int)},
     "give feature vectors N x D, or images N x H x W or N x C x H x W"),
    ({"images": np.zeros((5, 8, 8), np.uint8), "y": np.zeros(5, int)},
     "has no x array (it has images, y)"),
    ({"x": np.zeros((5, 8, 8), np.uint8), "y": np.zeros(5, int), "client": np.zeros(4, int)},
     "client has shape (4,); it must name one client per sample"),
])
def test_a_bad_file_is_one_sentence_before_anything_runs(tmp_path, arrays, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        build_settings({"dataset": _bad(tmp_path, "bad", **arrays)})


def test_bad_values_and_paths(tmp_path):
    with pytest.raises(ConfigError, match="the file does not exist"):
        build_settings({"dataset": f"npz:{tmp_path / 'missing.npz'}"})
    (tmp_path / "text.npz").write_text("not a zip")
    with pytest.raises(ConfigError, match="is not a readable .npz file"):
        build_settings({"dataset": f"npz:{tmp_path / 'text.npz'}"})
    with pytest.raises(ConfigError, match="Unknown dataset 'cifar'; choose one of: "
                       "fashion-mnist, mnist, cifar10, cifar100, shakespeare, synthetic, "
                       "clients, or npz:PATH"):
        build_settings({"dataset": "cifar"})
    no_clients = _bad(tmp_path, "plain", x=np.zeros((5, 4), np.float32), y=np.arange(5) % 2)
    with pytest.raises(ConfigError, match="partition = 'natural' needs a dataset with its own "
                       "clients"):
        build_settings({"dataset": no_clients, "partition": "natural", "model": "mlp"})
    with pytest.raises(ConfigError, match="which takes images, on dataset = .* which holds "
                       "feature vectors: set model to mlp"):
        build_settings({"dataset": no_clients, "model": "cnn"})
    with pytest.raises(ConfigError, match="'rotated' rotates images"):
        build_settings({"dataset": no_clients, "partition": "rotated", "model": "mlp"})
    negative = _bad(tmp_path, "negative", x=np.zeros((6, 4), np.float32),
                    y=np.array([0, 1, -1, 0, 1, 0]))
    with pytest.raises(ConfigError, match="y holds the label -1; labels must be 0..K-1"):
        load_dataset(negative)
    nan = _bad(tmp_path, "nan", x=np.full((6, 4), np.nan, np.float32), y=np.arange(6) % 2)
    with pytest.raises(ConfigError, match="x holds NaN or infinite values"):
        load_dataset(nan)


def test_a_bad_file_found_at_load_writes_nothing(tmp_path):
    """A value checked only when the data is read (a negative label) stops ``simulate.py`` with
    the sentence, exit status 2 and no results file."""
    bad = _bad(tmp_path, "negative", x=np.zeros((40, 4), np.float32),
               y=np.where(np.arange(40) == 7, -1, np.arange(40) % 2))
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, str(ROOT / "simulate.py"), "--set",
                             f"dataset={json.dumps(bad)}", "--set", "model=mlp", "--set",
                             "engine=sequential", "--out", str(out)],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "y holds the label -1; labels must be 0..K-1" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (out / "results.json").exists()


def write_image_folder(root, clients: tuple[str, ...] = (), per_class: int = 12,
                       sizes: tuple[int, ...] = (20, 24), seed: int = 0) -> None:
    """PNG images, three classes (a bright square in a place of its own), of mixed sizes:
    ``root/<class>/`` or, with ``clients``, ``root/<client>/<class>/``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for client in clients or ("",):
        for k, cls in enumerate(("cat", "dog", "eel")):
            folder = root / client / cls
            folder.mkdir(parents=True)
            for i in range(per_class + (k if client else 0)):
                side = sizes[i % len(sizes)]
                pixels = rng.integers(0, 90, (side, side, 3), dtype=np.uint8)
                pixels[5 * k:5 * k + 6, 4:10] = 255
                Image.fromarray(pixels).save(folder / f"{i:03d}.png")


def test_an_image_folder_with_client_folders_runs_on_every_engine(tmp_path):
    root = tmp_path / "pets"
    write_image_folder(root, clients=("north", "south", "east", "west", "up"))
    cache = tmp_path / "cache"
    results = three_engines({**RUN, "dataset": f"imagefolder:{root}", "image-size": 16,
                             "model": "cnn", "methods": "fedavg,local", "partition": "natural",
                             "cache-dir": str(cache)}, tmp_path, compared_at_least=40,
                            flower=False)
    clients = results["partition"]["clients"]
    assert {c["name"] for c in clients} <= {"north", "south", "east", "west", "up"}
    for c in clients:  # 12 + 13 + 14 images in every client folder
        assert c["num-train"] + c["num-test"] == 39
    # the names reach the per-client records, the CSV and the partition heatmap's axes
    assert results["partition"]["class-names"] == ["cat", "dog", "eel"]
    named = {c["id"]: c["name"] for c in clients}
    for label in ("fedavg", "local"):
        assert [r["name"] for r in results["methods"][label]["clients"]] == [
            named[r["id"]] for r in results["methods"][label]["clients"]]
    import csv

    from pflalign.outputs.report import write_csv

    rows = list(csv.DictReader(write_csv(tmp_path / "results.csv", results).open()))
    accuracy = {(r["method"], r["client-name"]): float(r["value"]) for r in rows
                if r["client"] and r["metric"] == "personal-acc"}
    assert accuracy == {(label, r["name"]): r["personal-acc"] for label in ("fedavg", "local")
                        for r in results["methods"][label]["clients"]}
    # decoded once: the array is kept in cache-dir, not in the data folder, and is what a later
    # load reads
    (cached,) = (cache / "images").glob("imagefolder-*.npy")
    assert sorted(p.name for p in root.iterdir()) == ["east", "north", "south", "up", "west"]
    dataset = load_dataset(f"imagefolder:{root}", image_size=16, cache_dir=str(cache))
    assert np.array_equal(np.load(cached), dataset.images)
    assert dataset.input_shape == (3, 16, 16) and dataset.num_classes == 3


def test_an_image_folder_of_classes(tmp_path):
    root = tmp_path / "flat"
    write_image_folder(root, sizes=(16,))
    dataset = load_dataset(f"imagefolder:{root}")
    assert dataset.input_shape == (3, 16, 16) and len(dataset) == 36
    assert dataset.labels.tolist() == [0] * 12 + [1] * 12 + [2] * 12  # classes sorted by name
    from PIL import Image

    first = np.asarray(Image.open(root / "cat" / "000.png")).transpose(2, 0, 1)
    assert np.array_equal(dataset.images[0], first)
    with pytest.raises(ConfigError, match="partition = 'natural' needs a dataset with its own "
                       "clients, .* has none: lay the images out one folder per client, "
                       "DIR/<client>/<class>/<image>, or choose another partition"):
        build_settings({"dataset": f"imagefolder:{root}", "partition": "natural"})


def test_bad_image_folders_are_one_sentence(tmp_path):
    mixed = tmp_path / "mixed"
    write_image_folder(mixed)
    with pytest.raises(ConfigError, match="the images have 2 sizes .* set image-size = N"):
        load_dataset(f"imagefolder:{mixed}")
    with pytest.raises(ConfigError, match="the folder does not exist"):
        build_settings({"dataset": f"imagefolder:{tmp_path / 'none'}"})
    empty = tmp_path / "empty"
    write_image_folder(empty, clients=("a", "b"), sizes=(16,))
    (empty / "c").mkdir()
    (empty / "c" / "cat").mkdir()
    with pytest.raises(ConfigError, match="client folder 'c' has no images"):
        build_settings({"dataset": f"imagefolder:{empty}"})


def test_text_files_one_client_each_run_on_every_engine(tmp_path):
    from test_shakespeare import PLAYS

    folder = tmp_path / "letters"
    folder.mkdir()
    for i, text in enumerate(PLAYS.values()):
        for j, half in enumerate((text[:len(text) // 2], text[len(text) // 2:])):
            (folder / f"writer-{i}{j}.txt").write_text(half, encoding="utf-8")
    results = three_engines({**RUN, "dataset": f"text:{folder}", "model": "char-lstm",
                             "sequence-length": 20, "partition": "natural", "batch-size": 32,
                             "local-steps": 3, "methods": "fedavg,local"}, tmp_path,
                            compared_at_least=40, flower=False)
    names = {c["name"] for c in results["partition"]["clients"]}
    assert len(names) == 4 and names <= {p.stem for p in folder.glob("*.txt")}
    (folder / "bad.txt").write_bytes(b"caf\xe9 au lait")
    with pytest.raises(ConfigError, match="bad.txt is not UTF-8 text"):
        load_dataset(f"text:{folder}", tokenizer="characters", sequence_length=20)


def test_image_folders_skip_hidden_entries_refuse_deep_images_and_reuse_the_cache(tmp_path,
                                                                                  monkeypatch):
    from PIL import Image

    from pflalign.data import sources

    root = tmp_path / "flat"
    write_image_folder(root, sizes=(16,))
    (root / "cat" / ".ipynb_checkpoints").mkdir()  # a notebook's, inside a class folder
    (root / "dog" / "._000.png").write_bytes(b"resource fork")  # macOS's
    first = load_dataset(f"imagefolder:{root}", image_size=8)
    assert len(first) == 36 and first.num_classes == 3
    # a later process reads the cache: decoding again would fail here
    load_dataset.cache_clear()
    monkeypatch.setattr(sources, "_decoded", lambda *a: (_ for _ in ()).throw(AssertionError()))
    assert np.array_equal(load_dataset(f"imagefolder:{root}", image_size=8).images, first.images)
    monkeypatch.undo()
    deep = tmp_path / "deep"
    write_image_folder(deep, sizes=(16,))
    Image.fromarray(np.full((16, 16), 40000, np.uint16)).save(deep / "eel" / "wide.png")
    with pytest.raises(ConfigError, match="some images are I;16 .* convert them to 8-bit"):
        load_dataset(f"imagefolder:{deep}")


def test_text_for_a_character_model_must_be_in_its_vocabulary(tmp_path):
    folder = tmp_path / "greek"
    folder.mkdir()
    for i in range(3):
        (folder / f"w{i}.txt").write_text("Καλημέρα κόσμε, τι κάνεις; " * 40, encoding="utf-8")
    with pytest.raises(ConfigError, match="of the text's characters are outside char-lstm's "
                       "80-symbol vocabulary .* use model = hf:<model>"):
        load_dataset(f"text:{folder}", tokenizer="characters", sequence_length=20)


def test_a_single_value_is_not_an_array_of_samples(tmp_path):
    with pytest.raises(ConfigError, match="x and y must be arrays of samples"):
        build_settings({"dataset": _bad(tmp_path, "scalar", x=np.float32(1), y=np.arange(2))})


def test_decoded_images_go_to_the_cache_folder_not_the_data(tmp_path, monkeypatch):
    from pflalign.data.sources import load_imagefolder

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = tmp_path / "flat"
    write_image_folder(root, sizes=(16,))
    first = load_imagefolder(f"imagefolder:{root}", 0)
    (cached,) = (tmp_path / "xdg" / "pflalign" / "images").glob("imagefolder-*.npy")
    assert np.array_equal(np.load(cached), first["images"])
    assert not [p for p in root.rglob("*") if p.name.startswith(".")]  # nothing in the data
    again = load_imagefolder(f"imagefolder:{root}", 0, cache_dir=str(tmp_path / "mine"))
    assert np.array_equal(again["images"], first["images"])
    assert len(list((tmp_path / "mine" / "images").glob("imagefolder-*.npy"))) == 1
