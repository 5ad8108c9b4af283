"""Engines run methods; they hold no learning logic.

An engine is how a :class:`~pflalign.server.Federation` reaches its clients
(:class:`~pflalign.server.Engine`: discover them, exchange one round of messages). Two exist:

- ``flower``: Flower messages through a Grid, in a simulation on Ray or a real deployment
  (``strategies/`` and ``clients/``, the only code that imports flwr);
- ``sequential``: the clients' rules called one after another in this process
  (:mod:`pflalign.engines.sequential`), for tests, benchmarks and machines without Ray.

Both run the same methods through the same round loop and the same client-side handler
(:mod:`pflalign.engines.host`), so they give the same metrics. :func:`run_methods` runs a
config's method entries one after another over whichever engine it is given.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from pflalign.annealing import AnnealedWarmStart
from pflalign.config import ConfigError, Settings
from pflalign.federation import federated_dataset
from pflalign.interrupt import Interrupted, check_stop
from pflalign.methods import METHODS, method_overrides
from pflalign.models import build_model
from pflalign.results import Reporter, comparison_table, new_results, write_results
from pflalign.server import Engine, Federation, ServerRuntime
from pflalign.state import State


def initial_model(settings: Settings) -> tuple[State, tuple[str, ...]]:
    """The run's initial model (seeded) as NumPy arrays, and the names of its trainable entries."""
    dataset = federated_dataset(settings).dataset
    model = build_model(settings.run.model, dataset.input_shape, dataset.num_classes,
                        seed=settings.run.seed)
    state = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    return state, tuple(name for name, p in model.named_parameters() if p.requires_grad)


def template_model(settings: Settings) -> Callable[[], object]:
    """A builder of fresh (unseeded) models of the run, for looking up layers."""
    dataset = federated_dataset(settings).dataset
    return lambda: build_model(settings.run.model, dataset.input_shape, dataset.num_classes)


def check_resources(settings: Settings) -> None:
    """Fail before any engine starts when the requested client resources cannot exist here."""
    cpus, gpus = settings.run.client_resources_num_cpus, settings.run.client_resources_num_gpus
    if cpus > (os.cpu_count() or 1):
        raise ConfigError(f"client-resources-num-cpus = {cpus:g} exceeds this machine's "
                          f"{os.cpu_count()} CPU cores; no client could be scheduled.")
    if gpus > 0 and not torch.cuda.is_available():
        raise ConfigError(f"client-resources-num-gpus = {gpus:g} but no GPU is visible to "
                          "PyTorch here; set it to 0 to train on the CPU.")
    if gpus > torch.cuda.device_count():
        raise ConfigError(f"client-resources-num-gpus = {gpus:g} exceeds the "
                          f"{torch.cuda.device_count()} GPU(s) here; use a fraction of one "
                          "(e.g. 0.25) to share a GPU between clients.")


def run_methods(settings: Settings, make_engine: Callable[[Settings], Engine],
                reporter: Reporter | None = None) -> dict:
    """Run every method entry of ``settings`` on the same partition, seed and clients, each over
    ``make_engine(its settings)``; write ``results.json`` after each and return the results.

    When the run is asked to stop (:mod:`pflalign.interrupt`), the finished entries are written
    with ``"interrupted": true``, the labels of the entries that did not finish under
    ``"unfinished"``, and the finished rounds of the one that was running under ``"partial"``;
    then :class:`~pflalign.interrupt.Interrupted` propagates, carrying where they were written.
    """
    reporter = reporter or Reporter()
    started = time.perf_counter()
    check_stop()
    federation_data = federated_dataset(settings)
    results = new_results(settings.to_dict(), federation_data.summary())
    choices = list(settings.method_choices)
    running: tuple[str, str, dict, Federation | None] | None = None
    path = None
    try:
        for choice in choices:
            check_stop()
            spec = METHODS[choice.name]
            overrides = method_overrides(spec, settings, dict(choice.overrides))
            running = (choice.label, spec.name, overrides, None)
            # the entry's own settings: its overrides, and 'methods' naming just this entry
            method_settings = (settings.replace({**overrides, "methods": choice.label})
                               if overrides else settings)
            if (method_settings.run.model != settings.run.model
                    and "model" not in dict(choice.overrides)):
                reporter.info(f"[{choice.label}] runs on model {method_settings.run.model} (the "
                              "method needs batch norm).")
            model, trainable = initial_model(method_settings)
            server = ServerRuntime(method_settings, spec.build(method_settings), choice.label,
                                   model, trainable, template_model(method_settings))
            federation = Federation(server, make_engine(method_settings), reporter)
            running = (choice.label, spec.name, overrides, federation)
            if method_settings.gga.enabled:
                federation.hooks.append(AnnealedWarmStart(method_settings.gga, federation))
            results["methods"][choice.label] = {**federation.run(model), "method": spec.name,
                                                "overrides": overrides}
            running = None
            results["seconds"] = time.perf_counter() - started
            path = write_results(settings.run.out_dir, results)
    except Interrupted as stop:
        _write_interrupted(settings, results, choices, running, started, stop)
        raise
    reporter.result("\n" + comparison_table(results["methods"]))
    reporter.result(f"\nResults written to {path.resolve()}")
    return results


def _write_interrupted(settings: Settings, results: dict, choices: list,
                       running: tuple[str, str, dict, Federation | None] | None,
                       started: float, stop: Interrupted) -> None:
    """Write the finished entries of an interrupted run, and record where in ``stop``."""
    finished = list(results["methods"])
    results["interrupted"] = True
    results["unfinished"] = [c.label for c in choices if c.label not in results["methods"]]
    if running is not None and running[3] is not None and running[3].rounds:
        label, name, overrides, federation = running
        results["partial"] = {"label": label, "method": name, "overrides": overrides,
                              "rounds": list(federation.rounds)}
        stop.partial_rounds = len(federation.rounds)
    results["seconds"] = time.perf_counter() - started
    stop.results_path = write_results(settings.run.out_dir, results).resolve()
    stop.finished, stop.unfinished = finished, results["unfinished"]
