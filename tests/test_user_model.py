"""A researcher's own model (``model = py:...:factory``), written here and run as a user runs it.

The file's model declares its head (``pflalign_head``) ahead of its body, so a method that
splits the two must find it by the declaration, not by position. It runs on the sequential and
batched engines and in a real Flower simulation (each Ray worker imports the file), which must
agree bit for bit. A bad factory is one sentence each.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import ROOT
from harness import three_engines
from test_sources import RUN, write_images

from pflalign.models.registry import build_model, head_keys
from pflalign.run.config import build_settings
from pflalign.settings.options import ConfigError

MODEL_FILE = textwrap.dedent('''
    import torch
    from torch import nn

    class Net(nn.Module):
        pflalign_head = "classifier"

        def __init__(self, channels, classes):
            super().__init__()
            self.classifier = nn.Linear(16, classes)  # registered first, used last
            self.body = nn.Sequential(nn.Conv2d(channels, 8, 3, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 16),
                                      nn.ReLU())

        def forward(self, x):
            return self.classifier(self.body(x))

    def build(input_shape, num_classes):
        return Net(input_shape[0], num_classes)

    def conv_last(input_shape, num_classes):
        return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0] * 256, 8),
                             nn.Unflatten(1, (8, 1, 1)),
                             nn.Conv2d(8, num_classes, 1), nn.Flatten())

    class Undeclared(Net):
        pflalign_head = None  # the classifier is registered first: not the last layer

    def undeclared(input_shape, num_classes):
        return Undeclared(input_shape[0], num_classes)

    def with_norm(input_shape, num_classes):
        side = input_shape[1] - 2
        return nn.Sequential(nn.Conv2d(input_shape[0], 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                             nn.Flatten(), nn.Linear(4 * side * side, num_classes))

    def wrong_output(input_shape, num_classes):
        return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0] * 256, num_classes + 1))

    def not_a_module(input_shape, num_classes):
        return "a string"

    def raises(input_shape, num_classes):
        raise ValueError("no model for you")
''')


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(MODEL_FILE)
    return path


def test_a_model_from_a_file_runs_on_every_engine(tmp_path, model_file):
    data = tmp_path / "images.npz"
    write_images(data)
    results = three_engines({**RUN, "dataset": f"npz:{data}", "model": f"py:{model_file}:build",
                             "methods": "fedavg,fedper,feddbe"}, tmp_path, compared_at_least=50)
    assert set(results["methods"]) == {"fedavg", "fedper", "feddbe"}
    # the declared head is the head, though it is not the last layer registered
    model = build_model(f"py:{model_file}:build", (3, 16, 16), 3, seed=0)
    assert head_keys(model) == ("classifier.weight", "classifier.bias")
    assert head_keys(model, 2)[:2] == ("body.4.weight", "body.4.bias")


def test_a_module_on_the_path(tmp_path, model_file, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_model("py:my_model:build", (1, 16, 16), 5, seed=1)
    assert model(torch.zeros(3, 1, 16, 16)).shape == (3, 5)
    again = build_model("py:my_model:build", (1, 16, 16), 5, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 again.state_dict().values(), strict=True))


def test_a_relative_file_is_made_absolute(tmp_path, model_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = build_settings({"model": "py:my_model.py:build"})
    assert settings["model"] == f"py:{model_file}:build"


@pytest.mark.parametrize("factory, words", [
    ("wrong_output", "on a batch of 2 samples the model returns (2, 4); it must return (2, 3) "
                     "logits"),
    ("not_a_module", "the factory returned a str, not a torch.nn.Module"),
    ("raises", "the factory raised ValueError: no model for you (called with "
               "input_shape=(1, 16, 16), num_classes=3)"),
])
def test_a_bad_model_is_one_sentence(model_file, factory, words):
    with pytest.raises(ConfigError) as caught:
        build_model(f"py:{model_file}:{factory}", (1, 16, 16), 3)
    assert words in str(caught.value)


def test_bad_names_are_refused_with_the_config(tmp_path, model_file):
    for value, words in [
        (f"py:{tmp_path / 'nothere.py'}:build", "the file"),
        ("py:no_such_package_here.models:build", "the module 'no_such_package_here.models' "
                                                 "cannot be imported (ModuleNotFoundError"),
        (f"py:{model_file}:absent", "has no callable 'absent'"),
        (f"py:{model_file}", "name a factory as py:package.module:function"),
    ]:
        with pytest.raises(ConfigError) as caught:
            build_settings({"model": value})
        assert words in str(caught.value), str(caught.value)


def test_a_method_that_needs_a_linear_head_says_so(tmp_path, model_file, capsys):
    """A model whose last layer is a convolution, without a declared head: a run with FedPer
    among its entries is refused with the sentence before any entry runs (exit status 2,
    nothing written); FedAvg alone runs on it."""
    data = tmp_path / "images.npz"
    write_images(data)
    model = build_model(f"py:{model_file}:conv_last", (3, 16, 16), 3)
    with pytest.raises(ConfigError, match="the model's last layer with parameters, '3', is a "
                       "Conv2d: set pflalign_head"):
        head_keys(model)
    flags = ["--set", f"dataset={json.dumps(f'npz:{data}')}", "--set",
             f"model={json.dumps(f'py:{model_file}:conv_last')}", "--set", "engine=sequential",
             "--set", "rounds=1", "--set", "num-clients=3"]
    for methods, status in (("fedavg,fedper", 2), ("fedavg", 0)):
        out = tmp_path / methods
        result = subprocess.run([sys.executable, str(ROOT / "simulate.py"), *flags, "--methods",
                                 methods, "--out", str(out), "--quiet"],
                                capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert result.returncode == status, result.stdout + result.stderr
        assert (out / "results.json").exists() == (status == 0)
        # refused before fedavg, the entry before it, runs: nothing is written, not even the
        # output folder or its plan.json
        assert out.exists() == (status == 0)
        assert ("Method entry 'fedper': This method splits the model" in result.stderr) \
            == (status == 2)
    # a model that fails on its first batch, found when the model loads: nothing written either
    # (the command's main, in this process)
    from pflalign.run.cli import main

    out = tmp_path / "wrong"
    flags[flags.index(f"model={json.dumps(f'py:{model_file}:conv_last')}")] = \
        f"model={json.dumps(f'py:{model_file}:wrong_output')}"
    assert main([*flags, "--methods", "fedavg", "--out", str(out), "--quiet"]) == 2
    assert "it must return (2, 3) logits" in capsys.readouterr().err
    assert not out.exists()


def test_a_head_found_by_position_must_give_the_output(model_file):
    """Without a declaration, the last layer registered is the head only if the model's output
    is its output: a classifier registered before its body is refused, not mistaken."""
    model = build_model(f"py:{model_file}:undeclared", (3, 16, 16), 3)
    with pytest.raises(ConfigError, match="is not the one that gives its output: set "
                       "pflalign_head"):
        head_keys(model)
    assert head_keys(build_model(f"py:{model_file}:build", (3, 16, 16), 3)) == (
        "classifier.weight", "classifier.bias")


def test_fedbn_runs_on_a_users_model_with_batch_norm(tmp_path, model_file):
    """FedBN needs batch norm, which a user's model may have: it runs on one (its batch-norm
    entries stay on the clients) and refuses one without, in one sentence, when built."""
    data = tmp_path / "images.npz"
    write_images(data)
    flags = ["--set", f"dataset={json.dumps(f'npz:{data}')}", "--set", "engine=sequential",
             "--set", "rounds=1", "--set", "num-clients=3", "--methods", "fedbn", "--quiet"]
    for factory, status in (("with_norm", 0), ("build", 2)):
        out = tmp_path / factory
        result = subprocess.run([sys.executable, str(ROOT / "simulate.py"), *flags, "--set",
                                 f"model={json.dumps(f'py:{model_file}:{factory}')}", "--out",
                                 str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert result.returncode == status, result.stdout[-2000:] + result.stderr[-2000:]
        assert ("fedbn needs a model with batch norm" in result.stderr) == (status == 2)
