"""Every shipped config file must be valid and say what its header promises."""

import pytest
from conftest import ROOT

from pflalign.run.config import method_labels, resolve

CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_are_valid(path):
    resolve(path)


def test_default_config_is_the_documented_setting():
    s = resolve(ROOT / "configs" / "default.toml")
    assert (s["dataset"], s["num-clients"], s["partition"], s["dirichlet-alpha"], s["model"]) == (
        "fashion-mnist", 20, "dirichlet", 0.1, "cnn")
    assert method_labels(s) == ["fedavg", "fedavg-ft", "local", "pflalign"]


def test_pfllib_config_matches_pfllibs_benchmark():
    s = resolve(ROOT / "configs" / "pfllib-fmnist.toml")
    assert (s["num-clients"], s["dirichlet-alpha"], s["test-fraction"], s["model"],
            s["batch-size"], s["local-epochs"], s["lr"], s["rounds"], s["fraction-train"]) == (
        20, 0.1, 0.25, "cnn", 10, 1, 0.005, 2000, 1.0)


def test_pfllib_cifar100_config_is_the_same_setting_on_cifar100():
    """Only the data differs from the Fashion-MNIST setting; the CNN then has PFLlib's
    FedAvgCNN(in_features=3, dim=1600) shape, with 100 classes."""
    from pflalign.models.registry import build_model

    fmnist = resolve(ROOT / "configs" / "pfllib-fmnist.toml")
    cifar = resolve(ROOT / "configs" / "pfllib-cifar100.toml")
    differing = {k for k in fmnist if fmnist[k] != cifar[k]}
    assert differing == {"dataset", "data-root", "out-dir"}
    assert cifar["dataset"] == "cifar100"
    model = build_model("cnn", (3, 32, 32), 100)
    assert model.fc1[1].in_features == 1600 and model.fc.out_features == 100


def test_generated_docs_are_current():
    from pflalign.run.docs import stale

    assert stale() == [], "run `python -m pflalign.run.docs`"


def test_methods_doc_has_every_method_its_paper_state_and_keys_and_config_doc_every_key():
    from pflalign.methods.registry import METHODS
    from pflalign.run.config import OPTIONS
    from pflalign.run.docs import render_config, render_methods

    methods = render_methods()
    for name, spec in METHODS.items():
        if spec.variant_of is not None:
            assert f"| `{name}` | " in methods, name  # in its method's variants table
            continue
        section = methods[methods.index(f"## `{name}`"):]
        section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
        assert spec.paper in section and "Client state:" in section, name
        for option in spec.method.Params.options():
            assert f"| `{option.key}` | " in section, (name, option.key)
    config = render_config()
    assert all(f"| `{o.key}` | " in config for o in OPTIONS)


def test_the_run_wide_keys_are_in_typed_sections_each_key_in_one():
    from pflalign.run.config import SECTION_CHECKS, build_settings
    from pflalign.settings.schema import SECTIONS, RunConfig

    keys = [key for section in SECTIONS.values() for key in section.keys().values()]
    assert len(keys) == len(set(keys))  # no key in two sections
    assert set(keys) == set(RunConfig.keys().values())  # and every run-wide key in one
    settings = build_settings({"dp": "central", "dataset": "synthetic", "partition": "natural",
                               "model": "mlp", "engine": "sequential", "rounds": 4})
    assert (settings.privacy.dp, settings.data.dataset, settings.engine.engine,
            settings.federation.rounds) == ("central", "synthetic", "sequential", 4)
    assert settings.privacy.dp_clip == settings.run.dp_clip
    assert len(SECTION_CHECKS) == 8
