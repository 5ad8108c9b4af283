"""simulate.py refuses, in one line and before any data is read or Ray starts, to overwrite
earlier results or to write where it cannot; a damaged dataset file is one line too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT, needs_fashion_mnist

from pflalign.data.datasets import DEBIAN_FASHION_MNIST
from pflalign.outputs.results import prepare_output
from pflalign.settings.options import ConfigError

TINY = ["--set", "num-clients=3", "--set", "max-samples=600", "--set", "rounds=1",
        "--set", "engine=sequential", "--set", "local-steps=2", "--methods", "fedavg", "--quiet"]


def _simulate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "simulate.py"), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Ray" not in result.stdout + result.stderr.replace("--ray-address", "")
    return lines[0]


def test_prepare_output_creates_the_folder_and_guards_earlier_results(tmp_path):
    out = tmp_path / "a" / "b"
    assert prepare_output(out) == out / "results.json"
    assert out.is_dir() and list(out.iterdir()) == []  # the probe file is gone
    (out / "results.json").write_text("{}")
    with pytest.raises(ConfigError, match="already exists; pass --overwrite"):
        prepare_output(out)
    assert prepare_output(out, overwrite=True) == out / "results.json"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="Cannot write results to"):
        prepare_output(blocker / "sub")


def test_existing_results_are_not_overwritten_without_the_flag(tmp_path):
    (tmp_path / "results.json").write_text('{"earlier": true}')
    started = time.perf_counter()
    line = _one_line_error(_simulate(*TINY, "--out", str(tmp_path)))
    assert str(tmp_path / "results.json") in line and "--overwrite" in line
    assert time.perf_counter() - started < 60
    assert json.loads((tmp_path / "results.json").read_text()) == {"earlier": True}


@needs_fashion_mnist
def test_the_overwrite_flag_replaces_earlier_results(tmp_path):
    (tmp_path / "results.json").write_text('{"earlier": true}')
    result = _simulate(*TINY, "--out", str(tmp_path), "--overwrite")
    assert result.returncode == 0, result.stderr[-2000:]
    assert list(json.loads((tmp_path / "results.json").read_text())["methods"]) == ["fedavg"]


def test_an_unwritable_output_directory_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = _one_line_error(_simulate(*TINY, "--out", str(blocker / "out")))
    assert "Cannot write results to" in line and str(blocker / "out") in line


@needs_fashion_mnist
@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_a_damaged_dataset_file_is_one_line_naming_it(tmp_path, damage):
    data = tmp_path / "fashion-mnist"
    data.mkdir()
    for source in DEBIAN_FASHION_MNIST.glob("*.gz"):
        (data / source.name).symlink_to(source)
    name = "train-images-idx3-ubyte.gz"
    raw = (DEBIAN_FASHION_MNIST / name).read_bytes()
    (data / name).unlink()
    if damage == "truncated":  # a cut-off download
        (data / name).write_bytes(raw[:len(raw) // 3])
    else:  # the right length, but bytes changed in the middle of the compressed stream
        middle = len(raw) // 2
        (data / name).write_bytes(raw[:middle] + bytes(4096) + raw[middle + 4096:])
    line = _one_line_error(_simulate(*TINY, "--set", f"data-root={data}",
                                     "--out", str(tmp_path / "out")))
    assert str(data / name) in line and "truncated or corrupt" in line
    assert "apt-get install --reinstall dataset-fashion-mnist" in line


def test_bad_command_line_inputs_are_one_sentence_each(tmp_path):
    """A config file that is not UTF-8 or is a directory, an unknown key inside a method entry,
    and an empty --out: each one line naming the fix, and nothing is written."""
    latin = tmp_path / "latin.toml"
    latin.write_bytes('# Fédération\nrounds = 2\n'.encode("latin-1"))
    line = _one_line_error(_simulate("--config", str(latin)))
    assert f"Config file '{latin}' is not UTF-8 text" in line and "save it as UTF-8" in line
    line = _one_line_error(_simulate("--config", str(tmp_path)))
    assert f"Config file '{tmp_path}' is a directory" in line
    line = _one_line_error(_simulate(*TINY[:-3], "--methods", "pflalign(foo=1)"))
    assert "Unknown config key 'foo' in the method entry 'pflalign(foo=1)'" in line
    assert "--set" not in line
    line = _one_line_error(_simulate(*TINY, "--out", ""))
    assert "--out is empty" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latin.toml"]


@needs_fashion_mnist
def test_the_installed_pflalign_command_is_simulate_py(tmp_path):
    """``pip install -e .`` puts a ``pflalign`` command beside the interpreter: the same command
    line as ``python simulate.py``, usable from any folder, its default config the checkout's."""
    command = os.path.join(os.path.dirname(sys.executable), "pflalign")
    help_text = subprocess.run([command, "--help"], capture_output=True, text=True, timeout=120,
                               cwd=tmp_path)
    assert help_text.returncode == 0, help_text.stderr
    assert help_text.stdout.startswith("usage: pflalign ")
    assert "npz:PATH" in help_text.stdout  # the config keys' help, as simulate.py --help
    printed = subprocess.run([command, "--print-config"], capture_output=True, text=True,
                             timeout=120, cwd=tmp_path)
    assert 'out-dir = "results/default"' in printed.stdout  # configs/default.toml's
    out = tmp_path / "out"
    run = subprocess.run([command, *TINY, "--out", str(out)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["num-clients"] == 3 and set(results["methods"]) == {"fedavg"}
    assert "pflalign --set num-clients=3" in (out / "plan.json").read_text()


PLANTED = r'''
import json
from dataclasses import dataclass

from pflalign.methods.fedavg import FedAvg
from pflalign.methods.registry import METHODS, method
from pflalign.settings.options import ConfigError, OnlyWith
from pflalign.settings.params import Params, param


@dataclass(frozen=True)
class PlantedParams(Params):
    prefix = "planted"
    weight: float = param(0.0, "A planted key.", minimum=0.0,
                          only_with=OnlyWith("dp", ("central",), shown="g",
                                             why="weighs the noise, and dp = {other}",
                                             fix="set dp = 'central' or remove it"))


class Planted(FedAvg):
    name = "planted"
    summary = "FedAvg with a planted key."
    Params = PlantedParams


METHODS["planted"] = method(Planted)  # before the parser collects the schema

from pflalign.run.cli import _epilog  # noqa: E402
from pflalign.run.config import build_settings, format_settings  # noqa: E402
from pflalign.run.docs import render_config  # noqa: E402

out = {"help": _epilog(), "docs": render_config()}
try:
    build_settings({"methods": "planted", "planted-weight": 0.5})
except ConfigError as refused:
    out["refusal"] = str(refused)
settings = build_settings({"methods": "planted", "planted-weight": 0.5, "dp": "central",
                           "dp-noise-multiplier": 0.5})
out["accepted"] = settings["planted-weight"]
out["printed"] = format_settings(settings)
print(json.dumps(out))
'''


def test_a_planted_key_with_an_only_with_rule_shows_everywhere_with_no_other_edit(tmp_path):
    """A key declared with an "only with" rule, and nothing else: `--help`, the docs page and a
    printed config say when it applies, and a config that sets it without that is refused in
    the rule's sentence."""
    script = tmp_path / "planted.py"
    script.write_text(PLANTED)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert "planted-weight = 0.0" in out["help"]
    assert "A planted key. Only with dp = central." in " ".join(out["help"].split())
    assert "| `planted-weight` | `0.0` | >= 0 | method | A planted key. Only with dp = central. |" \
        in out["docs"]
    assert "# A planted key. Only with dp = central.\nplanted-weight = 0.5" in out["printed"]
    assert out["refusal"] == ("planted-weight = 0.5 weighs the noise, and dp = 'off': set dp = "
                              "'central' or remove it.")
    assert out["accepted"] == 0.5
