"""local-optimizer (sgd, adam, genie) for the methods that take one, and pflalign-genie."""

import pytest
import torch
from conftest import needs_fashion_mnist
from flwr.app import RecordDict

from clients.base import ClientState, RoundInput
from clients.fedavg import FedAvgClient
from clients.pflalign import OPTIMIZER, PFLAlignClient
from pflalign.config import ConfigError, Settings
from pflalign.optim import GENIE
from pflalign.train import make_local_optimizer

SMALL = {"num-clients": 2, "max-samples": 400, "local-steps": 4, "batch-size": 16, "seed": 1,
         "methods": "fedavg"}


def test_make_local_optimizer_reads_its_own_keys():
    params = [torch.zeros(3, requires_grad=True)]
    sgd = make_local_optimizer(params, Settings({"lr": 0.2, "momentum": 0.5}))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.5
    adam = make_local_optimizer(params, Settings({**SMALL, "local-optimizer": "adam",
                                                  "adam-lr": 0.003}))
    assert isinstance(adam, torch.optim.Adam) and adam.param_groups[0]["lr"] == 0.003
    genie = make_local_optimizer(params, Settings({**SMALL, "local-optimizer": "genie",
                                                   "genie-lr": 0.02, "genie-p": 0.3,
                                                   "genie-noise": False}))
    group = genie.param_groups[0]
    assert isinstance(genie, GENIE) and (group["lr"], group["p"], group["noise"]) == (
        0.02, 0.3, False)


def test_methods_with_their_own_rule_refuse_another_local_optimizer():
    with pytest.raises(ConfigError, match="scaffold, pflalign"):
        Settings({"methods": "fedavg,scaffold,pflalign", "local-optimizer": "genie"})
    Settings({"methods": "fedavg(local-optimizer=genie),scaffold,pflalign-genie"})


def _client(cls, records=None, namespace="m", **changes):
    return cls(Settings({**SMALL, **changes}), 0,
               ClientState(RecordDict() if records is None else records, namespace),
               torch.device("cpu"))


@needs_fashion_mnist
def test_genie_local_training_is_seeded_and_differs_from_sgd():
    theta = _client(FedAvgClient).new_model().state_dict()
    runs = [_client(FedAvgClient, **{"local-optimizer": "genie"}).fit(
        RoundInput(1, {"arrays": theta})).state for _ in range(2)]
    sgd = _client(FedAvgClient).fit(RoundInput(1, {"arrays": theta})).state
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in theta)
    assert not torch.equal(runs[0]["fc.weight"], sgd["fc.weight"])
    other_round = _client(FedAvgClient, **{"local-optimizer": "genie"}).fit(
        RoundInput(2, {"arrays": theta})).state
    assert not torch.equal(other_round["fc.weight"], runs[0]["fc.weight"])


@needs_fashion_mnist
def test_pflalign_genie_keeps_genie_state_per_client_across_rounds():
    records = RecordDict()
    kwargs = {"methods": "pflalign-genie", "pflalign-local-update": "genie"}
    client = _client(PFLAlignClient, records, "pflalign-genie", **kwargs)
    theta = client.new_model().state_dict()
    out = client.fit(RoundInput(1, {"arrays": theta}))
    saved = client.state.get_arrays(OPTIMIZER)
    assert int(saved["fc.weight.step"]) == 4 and "fc.weight.P" not in saved
    assert "mean-P" not in out.metrics
    client = _client(PFLAlignClient, records, "pflalign-genie", **kwargs)
    client.fit(RoundInput(2, {"arrays": theta}))
    again = client.state.get_arrays(OPTIMIZER)
    assert int(again["fc.weight.step"]) == 8
    assert not torch.equal(again["fc.weight.m"], saved["fc.weight.m"])
