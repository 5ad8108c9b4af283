"""Every registered method as a Flower Message-API strategy.

``from strategies import PFLAlign`` gives a :class:`flwr.serverapp.strategy.Strategy` that a
ServerApp of your own runs as it would Flower's ``FedAvg``::

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = PFLAlign({"num-clients": 20, "pflalign-lr": 2.0})
        result = strategy.start(grid=grid, initial_arrays=strategy.initial_arrays(),
                                num_rounds=10)

A strategy is built from the method's settings (the keys of ``python simulate.py --help``) and
holds the method's round loop (:class:`~pflalign.round.loop.RoundLoop`, built as the project's
driver builds it: :func:`pflalign.run.driver.entry_loop`) over the Flower engine on the grid it is
given. ``configure_train`` is the synchronous scheduler's first half (the round features' steps
before training, the sampled clients' payloads from the method's server rule) as Flower
Messages; ``aggregate_train`` its second half on the replies (validation, the features' bounds
and releases, the method's aggregation); ``configure_evaluate`` and ``aggregate_evaluate`` are
the evaluation round, on the rounds ``eval-every`` names (none on the others). The project's own
ServerApp runs these same halves through the Flower engine, so a ServerApp of yours over a
strategy gives the project's metrics (``tests/test_strategies.py``).

What Flower hands between rounds is the global model; the method's other server state (SCAFFOLD's
control variate, pFLAlign's offsets held by the server) stays in the strategy. Arrays passed to
``configure_train`` other than those ``aggregate_train`` returned are taken as a new global model.
A strategy runs synchronous rounds (``mode = sync``) and writes no checkpoints (``simulate.py``
and the project's ServerApp do); after :meth:`MethodStrategy.start`, :attr:`MethodStrategy.results`
holds the run's rows, final metrics and per-client results as ``results.json`` has them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from logging import INFO
from typing import ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from pflalign.methods.registry import METHODS
from pflalign.outputs.results import Reporter
from pflalign.round.evaluation import (
    Evaluation,
    evaluate_at_start,
    evaluate_round,
    evaluation_round,
)
from pflalign.round.feature import TrainingRound
from pflalign.round.loop import Round, RoundLoop
from pflalign.run.config import build_settings, method_choices
from pflalign.run.driver import entry_loop, entry_settings
from pflalign.settings.options import ConfigError, Value
from pflalign.settings.schema import Settings
from pflalign.wire.messages import Outgoing
from pflalign.wire.protocol import EVALUATE, TRAIN
from pflalign.wire.state import State
from strategies.flower import FlowerEngine, to_record, to_state


def _metric_record(entries: Mapping[str, object]) -> MetricRecord:
    """A row's numbers as a MetricRecord (flags as 0/1)."""
    return MetricRecord({key: (int(value) if isinstance(value, bool | np.bool_) else value)
                         for key, value in entries.items()
                         if isinstance(value, int | float | bool | np.integer | np.floating)})


class MethodStrategy(Strategy):
    """A registered method (:attr:`method`) as a Flower strategy; see the module docstring.

    ``config``: the run's settings as config keys (``{"num-clients": 20, "lr": 0.05}``), or
    ``settings``: settings already built; ``label``: the method entry's name in logs and
    results (default: the method's)."""

    #: the registered method's name
    method: ClassVar[str] = ""

    def __init__(self, config: Mapping[str, Value] | None = None, *,
                 settings: Settings | None = None, label: str | None = None,
                 reporter: Reporter | None = None):
        if not self.method:
            raise TypeError("MethodStrategy is the base of the methods' strategies: use one of "
                            "them (strategies.PFLAlign, ...) or strategy_for(name).")
        if settings is None:
            settings = build_settings({**dict(config or {}), "methods": self.method},
                                      source=f"{type(self).__name__}(...)")
        choice = next((c for c in method_choices(settings) if c.name == self.method), None)
        if choice is None:
            raise ConfigError(f"{type(self).__name__} runs method {self.method!r}, and the "
                              f"settings' methods = {settings.run.methods!r} has no entry of it.")
        if settings.run.mode != "sync":
            raise ConfigError(f"mode = {settings.run.mode!r}: a Flower strategy runs synchronous "
                              "rounds; run FedBuff with `python simulate.py`.")
        self.label = label or choice.label
        self.overrides, self.settings = entry_settings(settings, choice)
        self.reporter = reporter or Reporter()
        self.loop: RoundLoop | None = None
        self.engine: FlowerEngine | None = None
        #: the run's result once :meth:`start` has run (as results.json holds a method entry)
        self.results: dict | None = None
        self._returned: ArrayRecord | None = None
        self._round: Round | None = None
        self._training: TrainingRound | None = None
        self._evaluation: Evaluation | None = None
        self._sent: tuple[list[Outgoing], dict[int, Message], list[int]] = ([], {}, [])
        self._last_eval: dict = {}

    # --- Flower's Strategy ---------------------------------------------------------------------
    def summary(self) -> None:
        run = self.settings.run
        log(INFO, "\t├── %s: %s (%s)", type(self).__name__, self.label,
            METHODS[self.method].summary)
        log(INFO, "\t├── %d clients (+%d unseen), fraction-train %g, model %s, seed %d",
            run.num_clients, run.num_unseen_clients, run.fraction_train, run.model, run.seed)
        log(INFO, "\t└── evaluation every %d rounds", run.eval_every)

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
              ) -> Result:
        """Flower's round loop over this strategy (``num_rounds`` replaces the settings'
        ``rounds``); afterwards :attr:`results` holds the run's result."""
        if self.loop is None and num_rounds != self.settings.run.rounds:
            self.settings = self.settings.replace({"rounds": num_rounds})
        result = super().start(grid=grid, initial_arrays=initial_arrays, num_rounds=num_rounds,
                               timeout=timeout, train_config=train_config,
                               evaluate_config=evaluate_config, evaluate_fn=evaluate_fn)
        self.results = {**self.loop.result(self._last_eval), "method": self.method,
                        "overrides": self.overrides}
        return result

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        loop = self._open(grid, arrays)
        self._round = loop.begin_round(server_round)
        self._training = loop.scheduler.configure(server_round)
        return self._send(TRAIN, self._training.messages)

    def aggregate_train(self, server_round: int, replies: Iterable[Message],
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        loop, training = self.loop, self._training
        if training.messages:
            entries, down, up = loop.scheduler.finish(training, self._received(replies))
        else:  # sampling = poisson drew nobody
            entries, down, up = loop.scheduler.empty(training), 0, 0
        loop.trained(self._round, entries, down, up)
        self._returned = to_record(loop.server.shared_model(loop.state))
        return self._returned, _metric_record(entries)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        loop = self.loop
        self._evaluation = None
        if not loop.server.is_eval_round(server_round):
            return []
        loop.scheduler.before_evaluation()
        self._evaluation = evaluation_round(loop, server_round)
        return self._send(EVALUATE, self._evaluation.messages)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message],
                           ) -> MetricRecord | None:
        loop, evaluation = self.loop, self._evaluation
        metrics = None
        if evaluation is not None:
            evaluation.exchange = self._received(replies)
            metrics, down, up = evaluate_round(loop, server_round, evaluation)
            self._last_eval = loop.evaluated(self._round, metrics, down, up)
        loop.end_round(self._round)
        return None if metrics is None else _metric_record(metrics)

    # --- the loop and the engine ---------------------------------------------------------------
    def initial_arrays(self) -> ArrayRecord:
        """The run's seeded initial global model (its exchanged entries), as the project's own
        runs start from."""
        loop, _ = self._build(None)
        return to_record(loop.server.shared_model(loop.method.init_server(
            loop.server, loop.server.initial)))

    def _build(self, grid: Grid | None) -> tuple[RoundLoop, State]:
        engine = FlowerEngine(grid, self.settings, self.reporter)
        loop, model = entry_loop(self.settings, self.label, self.method, engine, self.reporter)
        return loop, model

    def _open(self, grid: Grid, arrays: ArrayRecord) -> RoundLoop:
        """The round loop over ``grid``: built and opened (the clients discovered, the initial
        server state from ``arrays``) at the first call; later, ``arrays`` other than those last
        returned become the global model."""
        if self.loop is None:
            self.loop, model = self._build(grid)
            self.engine = self.loop.engine
            self.loop.open({**model, **to_state(arrays)})
            if self.settings.run.eval_at_start:
                self._last_eval = evaluate_at_start(self.loop)
        elif arrays is not self._returned:
            self.loop.state = self.loop.server.with_model(self.loop.state, to_state(arrays))
        return self.loop

    def _send(self, action: str, messages: list[Outgoing]) -> list[Message]:
        """``messages`` as Flower Messages to the clients' nodes (each carrying its reply limits
        and any restored state, as the loop's own exchanges do)."""
        prepared = self.loop.messaging.prepared(action, messages)
        outgoing, sizes = self.engine.outgoing(action, prepared)
        self._sent = (prepared, outgoing, sizes)
        return list(outgoing.values())

    def _received(self, replies: Iterable[Message]):
        """The replies to the messages last sent, as the loop's exchange (a client without a
        reply counts as timed out)."""
        prepared, outgoing, sizes = self._sent
        client_of = {message.metadata.message_id: cid for cid, message in outgoing.items()}
        by_client: dict[int, Message] = {}
        for reply in replies:
            cid = client_of.get(reply.metadata.reply_to_message_id)
            if cid is not None:
                by_client[cid] = reply
        silent = sorted(set(outgoing) - set(by_client))
        exchange = self.engine.collected(prepared, sizes, by_client, silent)
        self.loop.messaging.delivered(exchange.replies)
        return exchange


def _class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.replace("-", " ").split())


class FedAvg(MethodStrategy):
    """FedAvg (McMahan et al., 2017) as a Flower strategy."""

    method = "fedavg"


class FedAvgFT(MethodStrategy):
    method = "fedavg-ft"


class Local(MethodStrategy):
    method = "local"


class FedProx(MethodStrategy):
    method = "fedprox"


class Scaffold(MethodStrategy):
    method = "scaffold"


class Ditto(MethodStrategy):
    method = "ditto"


class FedPer(MethodStrategy):
    method = "fedper"


class FedRep(MethodStrategy):
    method = "fedrep"


class FedBN(MethodStrategy):
    method = "fedbn"


class APFL(MethodStrategy):
    method = "apfl"


class PerFedAvg(MethodStrategy):
    method = "perfedavg"


class PFedMe(MethodStrategy):
    method = "pfedme"


class FedALA(MethodStrategy):
    method = "fedala"


class FedDyn(MethodStrategy):
    method = "feddyn"


class FedCP(MethodStrategy):
    method = "fedcp"


class GPFL(MethodStrategy):
    method = "gpfl"


class FedDBE(MethodStrategy):
    method = "feddbe"


class PFLAlign(MethodStrategy):
    """pFLAlign (docs/algorithms.md 1) as a Flower strategy."""

    method = "pflalign"


#: the strategy of every registered method, its variants included, by method name
STRATEGIES: dict[str, type[MethodStrategy]] = {
    cls.method: cls for cls in (FedAvg, FedAvgFT, Local, FedProx, Scaffold, Ditto, FedPer, FedRep,
                                FedBN, APFL, PerFedAvg, PFedMe, FedALA, FedDyn, FedCP, GPFL,
                                FedDBE, PFLAlign)}
STRATEGIES.update({name: type(_class_name(name), (MethodStrategy,), {
    "method": name, "__doc__": f"{spec.summary} (a variant of {spec.variant_of}) as a Flower "
                               "strategy.", "__module__": __name__})
                   for name, spec in METHODS.items() if name not in STRATEGIES})


def strategy_for(name: str) -> type[MethodStrategy]:
    """The strategy class of the registered method ``name``."""
    if name not in STRATEGIES:
        raise ConfigError(f"Unknown method {name!r}; the registered methods are "
                          f"{', '.join(STRATEGIES)}.")
    return STRATEGIES[name]
