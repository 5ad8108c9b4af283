import subprocess
import sys
import time
import tomllib

import pytest
from conftest import ROOT

from pflalign.methods.registry import METHODS
from pflalign.run.config import (
    OPTIONS,
    ConfigError,
    build_settings,
    defaults,
    format_settings,
    method_choices,
    method_labels,
    parse_override,
    resolve,
)
from pflalign.settings.params import param
from pflalign.settings.schema import DATA_KEYS, NON_RUN_KEYS, RUN_WIDE_KEYS


def test_defaults_are_valid_and_complete():
    settings = build_settings()
    assert settings.to_dict() == defaults()
    assert len(settings) == len(OPTIONS)


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError, match="Unknown config key 'dirichlet-alfa'.*dirichlet-alpha"):
        build_settings({"dirichlet-alfa": 0.5})


@pytest.mark.parametrize("key,value,match", [
    ("rounds", "ten", "expects an integer"),
    ("rounds", 2.5, "expects an integer"),
    ("rounds", True, "expects an integer"),
    ("lr", "fast", "expects a number"),
    ("download", 1, "expects true or false"),
    ("dataset", 3, "expects a string"),
    ("dataset", "imagenet", "Unknown dataset .imagenet.; choose one of: fashion-mnist"),
    ("partition", "shards", "is not one of"),
    ("model", "vgg", "is not a model: choose one of cnn"),
    ("dirichlet-alpha", 0.0, "out of range.*> 0"),
    ("dirichlet-alpha", -1.0, "out of range"),
    ("test-fraction", 1.0, "out of range"),
    ("fraction-train", 0.0, "out of range"),
    ("num-clients", 0, "out of range"),
    ("lr", float("nan"), "finite"),
    ("methods", "fedavg,fedprox2", "Unknown method 'fedprox2'"),
    ("methods", "fedavg,fedavg", "twice"),
])
def test_bad_values_raise_clear_errors(key, value, match):
    with pytest.raises(ConfigError, match=match):
        build_settings({key: value})


def test_int_is_accepted_for_float_keys():
    lr = build_settings({"lr": 1})["lr"]
    assert lr == 1.0 and isinstance(lr, float)


def test_overrides_parse_toml_literals_and_raw_strings():
    assert parse_override("rounds=3") == ("rounds", 3)
    assert parse_override("lr=0.5") == ("lr", 0.5)
    assert parse_override("download=true") == ("download", True)
    assert parse_override("methods=fedavg,local") == ("methods", "fedavg,local")
    assert parse_override('data-root="/tmp/x y"') == ("data-root", "/tmp/x y")
    with pytest.raises(ConfigError, match="not of the form"):
        parse_override("rounds")
    with pytest.raises(ConfigError, match="expects an integer"):
        parse_override("rounds=abc")


def test_resolve_layers_file_then_overrides_then_extra(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('rounds = 7\nlr = 0.2\nmethods = "local"\n')
    s = resolve(cfg, ["lr=0.3"], {"out-dir": "/tmp/o"})
    assert (s["rounds"], s["lr"], s["methods"], s["out-dir"]) == (7, 0.3, "local", "/tmp/o")
    assert s["seed"] == defaults()["seed"]


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        resolve(bad)
    nested = tmp_path / "nested.toml"
    nested.write_text("[section]\nrounds = 3\n")
    with pytest.raises(ConfigError, match="flat"):
        resolve(nested)


def test_all_methods_expand_to_the_registry_without_ablation_variants():
    names = method_labels(build_settings({"methods": "all"}))
    assert names == [n for n, spec in METHODS.items() if spec.variant_of is None]
    assert "pflalign" in names and "pflalign-sgd" not in names


@pytest.mark.parametrize("methods", ["all", "fedavg,pflalign(lr=0.05)"])
def test_each_method_entry_is_checked_once(monkeypatch, methods):
    from pflalign.run import config
    checked = []
    real = config._check_entry

    def counting(choice, merged, settings=None):
        checked.append(choice.label)
        return real(choice, merged, settings)

    monkeypatch.setattr(config, "_check_entry", counting)
    labels = method_labels(build_settings({"methods": methods}))
    assert sorted(checked) == sorted(set(checked))  # no entry twice
    assert set(labels) <= set(checked)


def test_format_settings_round_trips_through_toml():
    s = build_settings({"rounds": 3, "data-root": 'a "quoted" dir', "download": True})
    assert build_settings(tomllib.loads(format_settings(s))) == s


def test_pyproject_app_config_matches_the_schema_defaults():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    app_config = pyproject["tool"]["flwr"]["app"]["config"]
    assert app_config == defaults(), "run `python -m pflalign.run.docs`"


def _simulate(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "simulate.py"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_print_config_shows_every_key_with_resolved_values():
    out = _simulate("--print-config", "--set", "rounds=4", "--methods", "local").stdout
    parsed = tomllib.loads(out)
    assert set(parsed) == set(defaults())
    assert parsed["rounds"] == 4 and parsed["methods"] == "local"


def test_help_documents_every_option_and_key():
    out = _simulate("--help").stdout
    for flag in ("--config", "--set", "--methods", "--out", "--print-config"):
        assert flag in out
    for opt in OPTIONS:
        assert f"{opt.key} = " in out


def test_the_partition_and_model_follow_the_data_unless_chosen(tmp_path):
    """A dataset that defines its clients gets partition = natural, and samples the model
    cannot take get the model that takes them, each said in a note; whatever the user set in
    the layer that set the dataset (or a later one) is kept (and refused if it cannot run), and
    a chosen partition that pools a dataset's clients is said too."""
    import numpy as np

    synthetic = build_settings({"dataset": "synthetic"})
    assert (synthetic["partition"], synthetic["model"]) == ("natural", "mlp")
    assert synthetic.notes == (
        "partition = natural: dataset = 'synthetic' defines its clients.",
        "model = mlp: dataset = 'synthetic' holds feature vectors, which model = 'cnn' does not "
        "take.")
    # the default config's partition and model were chosen for Fashion-MNIST: a new dataset on
    # the command line brings its own
    changed = resolve(ROOT / "configs" / "default.toml", ["dataset=synthetic"])
    assert (changed["partition"], changed["model"]) == ("natural", "mlp")
    assert changed.notes == synthetic.notes
    assert resolve(ROOT / "configs" / "default.toml", ["rounds=2"]).notes == ()
    with pytest.raises(ConfigError, match="set model to mlp"):  # a model the user set stays
        resolve(ROOT / "configs" / "default.toml", ["dataset=synthetic", "model=cnn"])
    text = build_settings({"dataset": "shakespeare"})
    assert (text["partition"], text["model"], text["tokenizer"]) == ("natural", "char-lstm",
                                                                     "characters")
    rng = np.random.default_rng(0)
    path = tmp_path / "table.npz"
    np.savez(path, x=rng.normal(size=(60, 4)).astype(np.float32), y=rng.integers(0, 2, 60),
             client=np.repeat(np.arange(6), 10))
    own = build_settings({"dataset": f"npz:{path}", "num-clients": 6})
    assert (own["partition"], own["model"]) == ("natural", "mlp")
    pooled = build_settings({"dataset": f"npz:{path}", "partition": "iid", "model": "mlp"})
    assert pooled["partition"] == "iid" and pooled.notes == (
        f"dataset = 'npz:{path}' defines its clients, and partition = 'iid' pools them and "
        "splits the pool (set partition = natural to keep them).",)
    assert build_settings({"dataset": "fashion-mnist"}).notes == ()


def test_help_ends_with_examples_that_each_parse(tmp_path, monkeypatch, capsys):
    """Every example ``--help`` ends with is a command line the parser and the config checks
    accept (its own data and model written here, as a user would)."""
    import shlex

    import numpy as np

    from pflalign.run.cli import EXAMPLES, make_plan, parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("  python simulate.py --set engine=flower")
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    np.savez("my_data.npz", x=rng.normal(size=(60, 5)).astype(np.float32),
             y=rng.integers(0, 3, 60), client=np.repeat(np.arange(6), 10))
    (tmp_path / "my_model.py").write_text(
        "from torch import nn\n\n\ndef build(input_shape, num_classes):\n"
        "    return nn.Linear(input_shape[0], num_classes)\n")
    for comment, command in EXAMPLES:
        assert f"  # {comment}" in out
        plan = make_plan(parse_args(shlex.split(command.split(" && ")[0])))
        for name in plan.scenarios:
            plan.settings(name)


@pytest.mark.parametrize("args,match", [
    (["--set", "no-such-key=1"], "Unknown config key 'no-such-key'"),
    (["--set", "rounds=two"], "expects an integer"),
    (["--set", "dirichlet-alpha=0"], "must be > 0"),
    (["--set", "num-clients=100000"], "lower num-clients"),
    (["--methods", "fedavg,nope"], "Unknown method 'nope'"),
    (["--set", "client-resources-num-cpus=100000"], "exceeds this machine's"),
])
def test_cli_config_errors_fail_fast_before_ray(args, match, tmp_path):
    started = time.perf_counter()
    # an out-dir of its own: the checkout's results/default (written by `make run`) must not
    # answer first with "already exists"
    result = _simulate(*args, "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert match in result.stderr
    assert "Traceback" not in result.stderr
    assert "Ray" not in result.stdout + result.stderr
    assert time.perf_counter() - started < 30


def test_asking_for_a_gpu_without_one_fails_before_ray():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = _simulate("--set", "client-resources-num-gpus=0.5")
    assert result.returncode == 2 and "no GPU is visible" in result.stderr


def test_method_entries_carry_their_own_overrides():
    choices = method_choices(build_settings({
        "methods": "fedavg, pflalign(pflalign-lr=2, pflalign-gamma=one),"
                   "pflalign(pflalign-lr=0.5)"}))
    assert [c.name for c in choices] == ["fedavg", "pflalign", "pflalign"]
    assert choices[1].overrides == (("pflalign-lr", 2.0), ("pflalign-gamma", "one"))
    assert choices[1].label == 'pflalign(pflalign-lr=2.0,pflalign-gamma="one")'
    assert choices[0].label == "fedavg" and choices[0].overrides == ()


@pytest.mark.parametrize("methods,match", [
    ("pflalign(pflalign-lr=2", "unclosed"),
    ("pflalign)", "unmatched"),
    ("pflalign(pflalign-lr=fast)", "expects a number"),
    ("pflalign(no-such=1)", "Unknown config key 'no-such'"),
    ("pflalign(seed=3)", "shared by all methods"),
    ("pflalign(pflalign-lr=2),pflalign(pflalign-lr=2)", "twice"),
])
def test_bad_method_entries_are_clear_errors(methods, match):
    with pytest.raises(ConfigError, match=match):
        build_settings({"methods": methods})


def test_key_scopes_are_declared_and_the_key_tuples_derived_from_them():
    scope = {o.key: o.scope for o in OPTIONS}
    assert set(RUN_WIDE_KEYS) == {k for k, s in scope.items() if s != "method"}
    assert set(DATA_KEYS) == {k for k, s in scope.items() if s in ("data", "data-location")}
    # keys that change nothing a run computes (a resume may change them)
    assert set(NON_RUN_KEYS) == {"out-dir", "checkpoint-every", "memory-budget-gb",
                                 "batched-workers", "tracking", "tracking-dir", "report",
                                 "record-uploads", "audit-secret", "save-models",
                                 "keep-checkpoints"}
    assert {"seed", "dataset", "num-clients", "data-root"} <= set(DATA_KEYS)
    assert {"engine", "attack", "round-timeout"} <= set(RUN_WIDE_KEYS)
    assert not {"lr", "rounds", "aggregation", "model"} & set(RUN_WIDE_KEYS)
    assert all(o.scope == "method" for spec in METHODS.values()
               for o in spec.method.Params.options())
    with pytest.raises(ConfigError, match="shared by all methods"):
        build_settings({"methods": "fedavg(checkpoint-every=2)"})
    with pytest.raises(ValueError, match="scope"):
        param(1, "a key", scope="everywhere")
