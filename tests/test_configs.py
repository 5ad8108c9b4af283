"""Every shipped config file must be valid and say what its header promises."""

import re

import pytest
from conftest import ROOT

from pflalign.config import resolve

CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_are_valid(path):
    resolve(path)


def test_default_config_is_the_documented_setting():
    s = resolve(ROOT / "configs" / "default.toml")
    assert (s["dataset"], s["num-clients"], s["partition"], s["dirichlet-alpha"], s["model"]) == (
        "fashion-mnist", 20, "dirichlet", 0.1, "cnn")
    assert s.methods == ["fedavg", "fedavg-ft", "local", "pflalign"]


def test_pfllib_config_matches_pfllibs_benchmark():
    s = resolve(ROOT / "configs" / "pfllib-fmnist.toml")
    assert (s["num-clients"], s["dirichlet-alpha"], s["test-fraction"], s["model"],
            s["batch-size"], s["local-epochs"], s["lr"], s["rounds"], s["fraction-train"]) == (
        20, 0.1, 0.25, "cnn", 10, 1, 0.005, 2000, 1.0)


def test_readme_lists_every_method_with_its_paper_and_its_own_keys():
    from pflalign.methods import _TRAIN_KEYS, METHODS

    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Methods"):text.index("### pFLAlign")]
    rows = {cells[1].strip(): cells for line in table.splitlines() if line.startswith("| `")
            for cells in [re.split(r"(?<!\\)\|", line)]}
    for name, spec in METHODS.items():
        if spec.variant_of is not None:
            continue
        assert f"`{name}`" in rows, name
        row = rows[f"`{name}`"]
        assert len(row) == 6 and row[2].strip() and row[3].strip(), name  # summary, paper
        row = row[4]
        for key in set(spec.keys) - set(_TRAIN_KEYS):
            prefix = key.split("-")[0]
            assert f"`{key}`" in row or f"`{prefix}-*`" in row, (name, key)
