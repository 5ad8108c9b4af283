"""A Flower app of one's own (examples/own-flower-app): its ServerApp over the PFLAlign strategy
and its ClientApp over clients.answer with its own model and data loaders, run by `flwr run` in
simulation, gives the project's Flower engine's metrics on the same settings to the bit; and the
pieces of ``dataset = clients``: the loaders read, the model checked, the config's refusals."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from conftest import ROOT, flwr_run
from torch.utils.data import DataLoader, TensorDataset

from pflalign.data.clients import parse_input_shape
from pflalign.data.loaders import node_data_from_loaders, read_split
from pflalign.run.config import build_settings
from pflalign.settings.options import ConfigError

APP = os.path.join(ROOT, "examples", "own-flower-app")
sys.path.insert(0, APP)

from ownapp.server_app import APP_SETTINGS, strategy_config  # noqa: E402
from ownapp.task import Net, load_data  # noqa: E402

#: the example's run config (its pyproject's), as `flwr run` gives it to the ServerApp
RUN_CONFIG = {"num-server-rounds": 3, "num-clients": 6, "seed": 0, "local-epochs": 1,
              "batch-size": 16, "pflalign-lr": 1.0}


def _without_timings(entry):
    if isinstance(entry, dict):
        return {k: _without_timings(v) for k, v in entry.items()
                if not (k.endswith("seconds") or k == "seconds-per-round" or k == "processes")}
    if isinstance(entry, list):
        return [_without_timings(v) for v in entry]
    return entry


def _flwr_run(tmp_path) -> dict:
    out = tmp_path / "out"
    result = flwr_run(APP, tmp_path, ["--run-config", f"out-dir='{out}'", "--federation-config",
                                      "num-supernodes=6"], port=39391)
    assert (out / "results.json").exists(), result.stdout[-3000:] + result.stderr[-3000:]
    assert "pFLAlign after 3 rounds" in result.stdout, result.stdout[-3000:]
    return json.loads((out / "results.json").read_text())


def test_own_flower_app_under_flwr_run_equals_the_project_flower_engine(tmp_path):
    from ownapp.client_app import app as own_client_app

    from strategies.simulation import simulate

    own = _flwr_run(tmp_path)
    settings = build_settings({**strategy_config(RUN_CONFIG), "rounds": 3, "methods": "pflalign",
                               "out-dir": str(tmp_path / "project")})
    project = simulate(settings, client_app=own_client_app)["methods"]["pflalign"]
    assert [row["round"] for row in own["rounds"]] == [1, 2, 3]
    for key in ("rounds", "final", "clients"):
        assert _without_timings(own[key]) == _without_timings(project[key]), key
    # the clients' own data: six clients, each evaluated on its own test loader
    assert own["final"]["evaluated"] == 6
    assert [c["id"] for c in own["clients"]] == list(range(6))
    assert [c["num-train"] for c in own["clients"]] == [48, 64, 80, 48, 64, 80]
    assert own["final"]["personal-acc"] > 0.5  # 4 classes: well above chance after 3 rounds


def test_loaders_are_read_in_their_datasets_order_whatever_they_shuffle():
    x = torch.arange(40, dtype=torch.float32).reshape(20, 2)
    y = torch.arange(20) % 3
    shuffled = DataLoader(TensorDataset(x, y), batch_size=6, shuffle=True)
    got_x, got_y = read_split(shuffled)
    assert torch.equal(got_x, x) and torch.equal(got_y, y)
    as_dicts = [{"img": x[i:i + 5], "label": y[i:i + 5]} for i in range(0, 20, 5)]
    assert torch.equal(read_split(as_dicts)[0], x)
    assert torch.equal(read_split(as_dicts, ("img", "label"))[1], y)
    with pytest.raises(ValueError, match="batch_keys"):
        read_split([{"a": x, "b": x}])


def test_node_data_from_the_example_loaders_checks_them_against_the_run():
    train, test = load_data(2)
    node = node_data_from_loaders(2, train, test, num_classes=4, input_shape=(16,),
                                  num_clients=6, num_train_clients=5)
    assert (node.data.num_train, node.data.num_test) == (80, 20)  # 100 samples, 80/20
    assert node.discovery() == {"partition-id": 2, "num-train": 80, "num-test": 20, "unseen": 0}
    assert node_data_from_loaders(5, train, test, num_classes=4, input_shape=(16,),
                                  num_clients=6, num_train_clients=5).unseen
    with pytest.raises(ValueError, match="labels run 0..3, outside the run's num-classes = 3"):
        node_data_from_loaders(2, train, test, num_classes=3, input_shape=(16,), num_clients=6,
                               num_train_clients=6)
    with pytest.raises(ValueError, match=r"shape \(16,\), and the run's input-shape is 1,4,4"):
        node_data_from_loaders(2, train, test, num_classes=4, input_shape=(1, 4, 4),
                               num_clients=6, num_train_clients=6)
    with pytest.raises(ValueError, match="outside this run's 6 clients"):
        node_data_from_loaders(6, train, test, num_classes=4, input_shape=(16,), num_clients=6,
                               num_train_clients=6)


def test_a_client_model_other_than_the_runs_is_refused():
    from clients.answer import check_model

    settings = build_settings({**APP_SETTINGS, "num-clients": 6})
    check_model(settings, Net)  # the factory the run's model names
    check_model(settings, None)

    class Other(torch.nn.Module):
        pass

    with pytest.raises(ConfigError, match="must build the same model"):
        check_model(settings, Other)
    with pytest.raises(ConfigError, match="set model = 'py:.*Other' in the strategy's config"):
        check_model(settings.replace({"model": "mlp"}), Other)


@pytest.mark.parametrize("change, message", [
    ({"num-classes": 0}, "builds the model with num-classes = 0"),
    ({"input-shape": "16,a"}, "input-shape = '16,a': give one sample's shape"),
    ({"partition": "iid"}, r"needs partition = 'natural' \(the clients' own loaders"),
    ({"engine": "sequential"}, r"needs engine = 'flower' \(only a Flower ClientApp holds"),
    ({"eval-audit-fraction": 0.2}, r"needs eval-audit-fraction = 0.0 \(the audits .* the server "
                                   "holds none"),
    ({"evaluate-on": "validation"}, "needs evaluate-on = 'test'"),
    ({"dataset": "fashion-mnist"}, "num-classes = 4 describes the data the clients hold under "
                                   "dataset = 'clients', and dataset = 'fashion-mnist': remove "
                                   "it, or set dataset = 'clients'"),
])
def test_dataset_clients_refusals(change, message):
    with pytest.raises(ConfigError, match=message):
        build_settings({**APP_SETTINGS, **change})


def test_input_shapes():
    assert parse_input_shape("1,28,28") == (1, 28, 28)
    assert parse_input_shape("16") == (16,)
    settings = build_settings({**APP_SETTINGS, "model": "cnn", "input-shape": "1,28,28",
                               "num-classes": 10})
    assert settings.run.input_shape == "1,28,28"
    with pytest.raises(ConfigError, match="model = 'cnn', which takes images"):
        build_settings({**APP_SETTINGS, "model": "cnn"})
