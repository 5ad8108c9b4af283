"""local-optimizer (sgd, adam, genie) for the methods that take one, and pflalign-genie."""

import pytest
import torch
from conftest import needs_fashion_mnist
from harness import build, train

from pflalign.run.config import ConfigError, build_settings
from pflalign.settings.schema import LocalTraining
from pflalign.training.optimizers import CohortOfOne, StackedGenie, local_optimizer
from pflalign.wire.protocol import MODEL

SMALL = {"num-clients": 2, "max-samples": 400, "local-steps": 4, "batch-size": 16, "seed": 1,
         "methods": "fedavg"}


def _optimizer(params, settings):
    return local_optimizer(LocalTraining.from_settings(settings), params)


def test_local_training_optimizer_reads_its_own_keys():
    params = [torch.zeros(3, requires_grad=True)]
    sgd = _optimizer(params, build_settings({"lr": 0.2, "momentum": 0.5}))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.5
    adam = _optimizer(params, build_settings({**SMALL, "local-optimizer": "adam",
                                              "adam-lr": 0.003}))
    assert isinstance(adam, torch.optim.Adam) and adam.param_groups[0]["lr"] == 0.003
    genie = _optimizer(params, build_settings({**SMALL, "local-optimizer": "genie",
                                               "genie-lr": 0.02,
                                         "genie-p": 0.3, "genie-noise": False}))
    # GENIE is stateful: a client's is its stacked form for a cohort of one
    assert isinstance(genie, CohortOfOne) and isinstance(genie.stacked, StackedGenie)
    options = genie.stacked.options
    assert (options["lr"], options["p"], options["noise"]) == (0.02, 0.3, False)


def test_methods_with_their_own_rule_refuse_another_local_optimizer():
    with pytest.raises(ConfigError, match="does not apply to scaffold"):
        build_settings({"methods": "fedavg,scaffold,pflalign", "local-optimizer": "genie"})
    build_settings({"methods": "fedavg(local-optimizer=genie),scaffold,pflalign-genie"})


def _train(name, server_round, theta, state=None, **changes):
    method, client = build(name, SMALL, **changes)
    return train(method, client, server_round, {MODEL: theta}, state)


@needs_fashion_mnist
def test_genie_local_training_is_seeded_and_differs_from_sgd():
    _, client = build("fedavg", SMALL)
    theta = client.new_model().state_dict()
    runs = [_train("fedavg", 1, theta, **{"local-optimizer": "genie"})[0].model
            for _ in range(2)]
    sgd = _train("fedavg", 1, theta)[0].model
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in theta)
    assert not torch.equal(runs[0]["fc.weight"], sgd["fc.weight"])
    other_round = _train("fedavg", 2, theta, **{"local-optimizer": "genie"})[0].model
    assert not torch.equal(other_round["fc.weight"], runs[0]["fc.weight"])


@needs_fashion_mnist
def test_pflalign_genie_keeps_genie_state_per_client_across_rounds():
    kwargs = {"methods": "pflalign-genie", "pflalign-local-update": "genie"}
    method, client = build("pflalign-genie", SMALL, **kwargs)
    assert method.genie
    theta = client.new_model().state_dict()
    out, state = train(method, client, 1, {MODEL: theta})
    saved = state.optimizer
    assert int(saved["fc.weight.step"]) == 4 and "fc.weight.P" not in saved
    assert "mean-P" not in out.metrics
    _, state = _train("pflalign-genie", 2, theta, state, **kwargs)
    again = state.optimizer
    assert int(again["fc.weight.step"]) == 8
    assert not torch.equal(again["fc.weight.m"], saved["fc.weight.m"])
