"""Every registered method as a Flower Message-API strategy (strategies.methods): a ServerApp of
one's own that runs ``strategy.start(grid=..., initial_arrays=..., num_rounds=...)`` as it would
Flower's FedAvg gives, bit for bit, the metrics of the project's own Flower engine."""

from __future__ import annotations

import pytest
from conftest import needs_fashion_mnist
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy
from test_checkpoint import comparable

import strategies
from pflalign.methods.registry import METHODS
from pflalign.outputs.results import Reporter
from pflalign.run.config import ConfigError, build_settings
from pflalign.run.driver import simulate as project_simulate
from strategies.simulation import simulate

TINY = {"num-clients": 4, "max-samples": 800, "rounds": 2, "eval-every": 1,
        "fraction-train": 0.5, "local-steps": 2, "round-timeout": 120.0}


def test_every_registered_method_has_a_flower_strategy():
    assert set(strategies.STRATEGIES) == set(METHODS)
    for name, cls in strategies.STRATEGIES.items():
        assert issubclass(cls, Strategy) and cls.method == name
        assert strategies.strategy_for(name) is cls
    assert strategies.PFLAlign.method == "pflalign" and strategies.FedRep.method == "fedrep"
    strategy = strategies.Ditto({"num-clients": 3, "lr": 0.1})
    assert strategy.label == "ditto" and strategy.settings.training.lr == 0.1
    with pytest.raises(ConfigError, match="Unknown method 'nope'"):
        strategies.strategy_for("nope")
    with pytest.raises(ConfigError, match="synchronous rounds"):
        strategies.FedAvg({"mode": "async", "device-profiles": "lognormal"})
    with pytest.raises(TypeError, match="use one of them"):
        strategies.MethodStrategy()


@needs_fashion_mnist
def test_initial_arrays_are_the_projects_seeded_initial_model():
    strategy = strategies.FedRep(TINY)
    arrays = strategy.initial_arrays()
    assert isinstance(arrays, ArrayRecord)
    again = strategies.FedRep(TINY).initial_arrays()
    assert all((arrays[k].numpy() == again[k].numpy()).all() for k in arrays)


def _central_dp(strategy):
    return strategies.CentralDP(strategy, noise_multiplier=0.02, clipping="adaptive")


@needs_fashion_mnist
@pytest.mark.parametrize("method, keys, wrap", [
    pytest.param("pflalign", {}, None, id="pflalign"),
    pytest.param("scaffold", {}, None, id="scaffold", marks=pytest.mark.slow),
    pytest.param("fedavg", {"dp": "central", "dp-clipping": "adaptive",
                            "dp-noise-multiplier": 0.02}, _central_dp, id="central-dp-wrapper"),
])
def test_a_users_serverapp_over_the_strategy_equals_the_projects_flower_engine(
        method, keys, wrap, tmp_path):
    """A ServerApp written as for Flower's FedAvg over the method's strategy (in a wrapper, for
    the wrapper's case: the project's run then has the wrapper's keys), on Ray with the
    project's ClientApp, and the project's own run: every row, final metric and per-client
    result equal (timings aside). The project's run is on the sequential engine, which gives
    its Flower engine's metrics bit for bit (test_baselines_simulation), so that one Ray start
    per case is spent on the user's app."""
    plain = build_settings({**TINY, "methods": method, "engine": "flower",
                            "out-dir": str(tmp_path / "project")})
    settings = plain.replace(keys)
    project = project_simulate(settings.replace({"engine": "sequential"}),
                               Reporter(quiet=True))["methods"][method]

    app = ServerApp()
    kept: dict = {}

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = strategies.strategy_for(method)(settings=plain, reporter=Reporter(quiet=True))
        if wrap is not None:
            strategy = wrap(strategy)
        result = strategy.start(grid=grid, initial_arrays=strategy.initial_arrays(),
                                num_rounds=settings.run.rounds, timeout=120.0)
        kept.update(results=strategy.results, flower=result)

    simulate(settings, Reporter(quiet=True), server_app=app)
    ours = kept["results"]
    assert ("dp-epsilon" in ours["rounds"][-1]) == (wrap is not None)  # the wrapper's DP ran
    assert comparable(ours["rounds"]) == comparable(project["rounds"])
    assert comparable(ours["final"]) == comparable(project["final"])
    assert ours["clients"] == project["clients"] and ours["usage"] == project["usage"]
    # Flower's Result: the final global model and each round's metrics as MetricRecords
    flower = kept["flower"]
    assert sorted(flower.train_metrics_clientapp) == [1, 2]
    assert flower.evaluate_metrics_clientapp[2]["personal-acc"] == project["final"][
        "personal-acc"]
    assert set(flower.arrays) <= set(strategies.strategy_for(method)(TINY).initial_arrays())


def test_wrappers_turn_on_the_round_features_and_refuse_what_the_config_refuses():
    inner = strategies.FedAvg({"num-clients": 4})
    wrapped = strategies.CentralDP(inner, noise_multiplier=0.5, clip=2.0)
    assert wrapped.method_strategy is inner and wrapped.settings is inner.settings
    run = wrapped.settings.run
    assert (run.dp, run.dp_clip, run.dp_noise_multiplier, run.dp_clipping) == (
        "central", 2.0, 0.5, "fixed")
    assert strategies.UpdateClip(strategies.FedRep({"num-clients": 4}),
                                 multiple=1.5).settings.run.update_clip == 1.5
    with pytest.raises(ConfigError, match="update-clip = 1 and dp = 'central' both clip"):
        strategies.UpdateClip(wrapped)
    with pytest.raises(ConfigError, match="dp-clip-quantile = 0.3 applies to dp-clipping = "
                                          "'adaptive', and dp-clipping = 'fixed'"):
        strategies.CentralDP(strategies.FedAvg({"num-clients": 4}), target_quantile=0.3)
    with pytest.raises(TypeError, match="wraps a method's strategy"):
        strategies.UpdateClip(object())
