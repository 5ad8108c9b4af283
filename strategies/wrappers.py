"""Strategy wrappers, in the style of Flower's DP wrappers: a method's strategy inside, one round
feature turned on around it.

    strategy = CentralDP(PFLAlign(config), noise_multiplier=1.0, clip=1.0, clipping="adaptive")
    strategy.start(grid=grid, initial_arrays=strategy.initial_arrays(), num_rounds=10)

    robust = UpdateClip(FedRep(config), multiple=1.0)

Flower's ``DifferentialPrivacyServerSideFixedClipping(strategy, noise_multiplier, clipping_norm,
num_sampled_clients)`` clips and noises in its own ``aggregate_train``. Here a wrapper sets the
wrapped strategy's settings (``dp = central`` and its keys; ``update-clip``), checked as a config
is, before its round loop is built, and passes every call through: the clipping, the noise and
the accountant are the round features that ``python simulate.py`` runs with those keys
(:mod:`pflalign.round.features.privacy`, :mod:`pflalign.round.features.robustness`), at their
place in the round (on the updates, before the method's aggregation; the epsilon spent in every
row). So a wrapped strategy gives what the project's engines give on the same settings
(``tests/test_strategies.py``). A wrapper's keys are checked with the rest of the run's, so a
combination the config refuses is refused here in the same sentence (the update clip is for runs
without dp, whose own clip bounds every update).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from logging import INFO

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from pflalign.settings.options import ConfigError, Value
from pflalign.settings.schema import Settings
from strategies.methods import MethodStrategy


class StrategyWrapper(Strategy):
    """A strategy around ``strategy`` (a method's, or another wrapper) whose settings it changes
    by ``changes`` before the run starts; every Strategy call goes to the method's strategy."""

    #: what the wrapper turns on, for its summary
    turns_on: str = ""

    def __init__(self, strategy: MethodStrategy | StrategyWrapper,
                 changes: Mapping[str, Value]):
        inner = strategy.method_strategy if isinstance(strategy, StrategyWrapper) else strategy
        if not isinstance(inner, MethodStrategy):
            raise TypeError(f"{type(self).__name__} wraps a method's strategy (strategies.PFLAlign"
                            f", ...), not a {type(strategy).__name__}.")
        if inner.loop is not None:
            raise ConfigError(f"{type(self).__name__} wraps a strategy before it starts; this one "
                              "has run.")
        inner.settings = inner.settings.replace(dict(changes), source=f"{type(self).__name__}")
        self.strategy = strategy
        #: the method's strategy, inside every wrapper
        self.method_strategy: MethodStrategy = inner

    @property
    def settings(self) -> Settings:
        return self.method_strategy.settings

    @property
    def results(self) -> dict | None:
        """The run's result once :meth:`start` has run (:attr:`MethodStrategy.results`)."""
        return self.method_strategy.results

    def initial_arrays(self) -> ArrayRecord:
        return self.method_strategy.initial_arrays()

    def summary(self) -> None:
        log(INFO, "\t├── %s: %s", type(self).__name__, self.turns_on)
        self.strategy.summary()

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
              ) -> Result:
        return self.method_strategy.start(grid=grid, initial_arrays=initial_arrays,
                                          num_rounds=num_rounds, timeout=timeout,
                                          train_config=train_config,
                                          evaluate_config=evaluate_config,
                                          evaluate_fn=evaluate_fn)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        return self.method_strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message],
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.method_strategy.aggregate_train(server_round, replies)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.method_strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message],
                           ) -> MetricRecord | None:
        return self.method_strategy.aggregate_evaluate(server_round, replies)


class CentralDP(StrategyWrapper):
    """User-level central differential privacy around a method's strategy (DP-FedAvg, McMahan
    et al. 2018; docs/privacy.md): each client's update clipped to ``clip``, Gaussian noise of
    ``noise_multiplier`` x ``clip`` added to their sum, and the epsilon spent reported each
    round. ``clipping = "adaptive"`` moves the clip towards the ``target_quantile`` of the update
    norms (Andrew et al. 2021). ``epsilon`` (> 0) sets the noise multiplier that reaches it
    after the run's rounds instead of ``noise_multiplier``. The run's keys ``dp-*`` are these."""

    turns_on = "central differential privacy"

    def __init__(self, strategy: MethodStrategy | StrategyWrapper, *,
                 noise_multiplier: float | None = None, clip: float | None = None,
                 clipping: str = "fixed", target_quantile: float | None = None,
                 epsilon: float | None = None, delta: float | None = None):
        changes: dict[str, Value] = {"dp": "central", "dp-clipping": clipping}
        for key, value in (("dp-noise-multiplier", noise_multiplier), ("dp-clip", clip),
                           ("dp-clip-quantile", target_quantile), ("dp-epsilon", epsilon),
                           ("dp-delta", delta)):
            if value is not None:
                changes[key] = value
        super().__init__(strategy, changes)


class UpdateClip(StrategyWrapper):
    """Norm bounding (Sun et al. 2019; docs/robustness.md): every client's update (its trained
    shared entries minus the global model) scaled down to at most ``multiple`` times the round's
    reference norm (the median update norm, as ``update-norm-bound`` takes it) before the method
    aggregates it, so that no one client moves the global model further than the others do: the
    run's ``update-clip``."""

    turns_on = "the update clip"

    def __init__(self, strategy: MethodStrategy | StrategyWrapper, multiple: float = 1.0):
        super().__init__(strategy, {"update-clip": multiple})
