"""The experiment driver: a config's method entries run one after another on its engine.

:func:`simulate` is the one entry point from settings to results: it looks the run's ``engine``
up in the engine registry (:data:`pflalign.engines.base.ENGINE_RUNS`, which each engine's
module fills when imported; the Flower engine's, of the app layer, only when a run uses it:
:func:`flower_engine`), opens that engine's session (:mod:`pflalign.engines.base`) and runs
:func:`run_methods` over it. Three engines exist:

- ``flower``: Flower messages through a Grid, in a simulation on Ray or a real deployment
  (``strategies/`` and ``clients/``, the only code that imports flwr);
- ``sequential``: the clients' rules called one after another in this process
  (:mod:`pflalign.engines.sequential`), for tests, benchmarks and machines without Ray;
- ``batched``: the sequential engine whose ``vmap`` backend runs a cohort's local runs together,
  stacked (:mod:`pflalign.engines.batched`, :mod:`pflalign.training.vectorised`), in this
  process or on Ray actors (:mod:`pflalign.engines.workers`).

All three run the same methods through the same round loop and the same client-side handler
(:mod:`pflalign.engines.host`), so they give the same metrics. :func:`run_methods` runs a
config's method entries one after another over whichever engine it is given, checkpointing each
(:mod:`pflalign.round.checkpoint`) and, with ``resume``, continuing a killed run where it stopped.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

import pflalign.engines.sequential  # noqa: F401  (registers engine = sequential)
import pflalign.engines.workers  # noqa: F401  (registers engine = batched)
from pflalign.data.federated import FederatedDataset, federated_dataset
from pflalign.engines.base import ENGINE_RUNS, Engine, EngineFactory
from pflalign.methods.registry import METHODS, method_overrides
from pflalign.models.language import LoraSpec, is_language_model, run_summary
from pflalign.models.registry import MODELS, batch_norm_keys, head_of, model_template
from pflalign.models.user import is_user_model
from pflalign.outputs.results import Reporter, comparison_table, new_results, write_results
from pflalign.process.interrupt import Interrupted, check_stop
from pflalign.round.checkpoint import Checkpoint
from pflalign.round.loop import RoundLoop
from pflalign.run.config import MethodChoice, method_choices
from pflalign.server.runtime import ServerRuntime
from pflalign.settings.fingerprint import comparable
from pflalign.settings.options import ConfigError
from pflalign.settings.schema import Settings
from pflalign.wire.state import State


def initial_model(settings: Settings) -> tuple[State, tuple[str, ...]]:
    """The run's initial model (seeded) as NumPy arrays, and the names of its trainable entries."""
    dataset = federated_dataset(settings).dataset
    model = model_template(settings.run.model, dataset.input_shape, dataset.num_classes,
                           settings.run.seed, LoraSpec.of(settings.run)).new()
    state = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    return state, tuple(name for name, p in model.named_parameters() if p.requires_grad)


def template_model(settings: Settings) -> Callable[[], object]:
    """A builder of fresh (unseeded) models of the run, for looking up layers."""
    dataset = federated_dataset(settings).dataset
    template = model_template(settings.run.model, dataset.input_shape, dataset.num_classes,
                              settings.run.seed, LoraSpec.of(settings.run))
    return template.new


def check_resources(settings: Settings, ray_address: str | None = None) -> None:
    """Fail before any engine starts when the requested client resources cannot exist here
    (with ``ray_address``, the cluster's nodes decide; only an engine that cannot run there is
    refused)."""
    if ray_address:
        if settings.run.engine == "sequential":
            raise ConfigError("--ray-address runs the clients on a Ray cluster, which needs "
                              "engine = 'flower' or 'batched' (this run has engine = "
                              "'sequential').")
        return
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


def previous_results(settings: Settings) -> dict | None:
    """The ``results.json`` a run of ``settings`` wrote in its ``out-dir`` (None when there is
    none); a :class:`~pflalign.run.config.ConfigError` when it cannot be read or was written with
    another config (``checkpoint-every`` and ``out-dir`` aside)."""
    path = Path(settings.run.out_dir) / "results.json"
    if not path.exists():
        return None
    try:
        previous = json.loads(path.read_text())
        config, methods = previous["config"], previous["methods"]
        if not isinstance(config, Mapping) or not isinstance(methods, Mapping) or not all(
                isinstance(entry, Mapping) for entry in methods.values()):
            raise TypeError("'config', 'methods' and every method entry must be objects")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"Cannot resume from '{path}': it cannot be read as a results file "
                          f"({err}).") from err
    theirs, ours = comparable(config), comparable(settings.to_dict())
    if theirs != ours:
        key = sorted(k for k in {*theirs, *ours} if theirs.get(k, None) != ours.get(k, None))[0]
        there = repr(theirs[key]) if key in theirs else "absent"
        here = repr(ours[key]) if key in ours else "absent"
        raise ConfigError(f"Cannot resume from '{path}': it was written with another config "
                          f"('{key}' is {there} there and {here} here); resume with the same "
                          "config, or start afresh in another directory or with --overwrite.")
    return previous


def flower_engine() -> None:
    """Register the Flower engine: its module is the app layer's (``strategies/simulation.py``,
    over Flower and Ray), imported here only when a run uses it, so that the library loads
    neither otherwise. The one import up from the library, named in tests/test_imports.py."""
    import strategies.simulation  # noqa: F401  (registers engine = flower)


def simulate(settings: Settings, reporter: Reporter | None = None, *, resume: bool = False,
             ray_address: str | None = None, verbose: bool = False,
             client_app: object | None = None) -> dict:
    """Run every method entry of ``settings`` on its engine (``engine``) and return the results.

    The data and partition are built first, so that their errors come before any engine starts,
    and this machine's resources are checked unless the clients run on the Ray cluster at
    ``ray_address``. ``resume``: continue a killed run in ``out-dir`` (:func:`run_methods`).
    ``verbose`` (Flower's own log lines) and ``client_app`` (a ClientApp serving the clients in
    place of the project's, for a test) concern the Flower engine only."""
    reporter = reporter or Reporter()
    if settings.run.engine == "flower" and "flower" not in ENGINE_RUNS:
        flower_engine()  # registers it
    engine = ENGINE_RUNS[settings.run.engine]
    if engine.runner is not None:
        return engine.runner(settings, reporter, resume=resume, ray_address=ray_address,
                             verbose=verbose, client_app=client_app)
    federated_dataset(settings)  # data and partition errors surface here, before any training
    check_resources(settings, ray_address)
    with engine.session(settings, reporter, ray_address) as make_engine:
        return run_methods(settings, make_engine, reporter, resume=resume)


def preflight(settings: Settings) -> None:
    """Load the run's data and partition and build its model (a user's is then checked on a
    batch, and for the parts every method entry needs), so that their errors come before the
    command writes anything. Both are cached per process: the run reads neither again."""
    federation = federated_dataset(settings)
    model = template_model(settings)()
    if settings.run.model in MODELS and isinstance(federation, FederatedDataset):
        check_model_takes(settings.run.model, model, federation)
    check_model_parts(settings)


def check_model_takes(name: str, model, federation: FederatedDataset) -> None:
    """A registered model gives outputs for two of the data's samples, or the run is refused in
    one sentence (a CNN's kernels larger than small images, say)."""
    dataset = federation.dataset
    rows = federation.pool[:2]
    batch = dataset.normalizer()(torch.from_numpy(np.ascontiguousarray(dataset.images[rows])))
    try:
        with torch.no_grad():
            model.eval()(batch)
    except RuntimeError as err:
        raise ConfigError(f"model = {name!r} cannot take this data's samples "
                          f"({' x '.join(map(str, dataset.input_shape))}): "
                          f"{str(err).splitlines()[0]}; choose another model (docs/data.md) or "
                          "larger inputs (image-size).") from None


def check_model_parts(settings: Settings) -> None:
    """A user's model (``model = py:...``) has the parts every method entry needs, a linear head
    or batch norm, or the run is refused in one sentence before any entry runs (the registered
    models' parts are known with the config; a user's only once it is built)."""
    if not is_user_model(settings.run.model):
        return
    for choice in method_choices(settings):
        spec = METHODS[choice.name]
        method_settings = settings.replace(method_overrides(spec, settings.run.model,
                                                            dict(choice.overrides)))
        model = template_model(method_settings)()
        try:
            if spec.method.needs_head or spec.method.feature_head:
                head_of(model)
            if spec.method.needs_batch_norm and not batch_norm_keys(model):
                raise ConfigError(f"{spec.name} needs a model with batch norm; model = "
                                  f"{method_settings.run.model!r} has none.")
        except ConfigError as err:
            raise ConfigError(f"Method entry '{choice.label}': {err}") from None


def entry_settings(settings: Settings, choice: MethodChoice) -> tuple[dict, Settings]:
    """A method entry's overrides, and its own settings: the overrides applied, and 'methods'
    naming just this entry."""
    overrides = method_overrides(METHODS[choice.name], settings.run.model,
                                 dict(choice.overrides))
    return overrides, (settings.replace({**overrides, "methods": choice.label}) if overrides
                       else settings)


def entry_loop(settings: Settings, label: str, name: str, engine: Engine,
               reporter: Reporter | None = None) -> tuple[RoundLoop, State]:
    """The round loop of the method entry ``label`` (method ``name``, its own ``settings``) over
    ``engine``, and its initial model: what the driver runs, and what a Flower strategy of the
    method (:mod:`strategies.methods`) drives between its exchanges."""
    model, trainable = initial_model(settings)
    server = ServerRuntime(settings, label, model, trainable, template_model(settings),
                           federated_dataset(settings).dataset.num_classes)
    return RoundLoop(server, METHODS[name].build(settings), engine, reporter), model


def run_methods(settings: Settings, make_engine: EngineFactory,
                reporter: Reporter | None = None, resume: bool = False) -> dict:
    """Run every method entry of ``settings`` on the same partition, seed and clients, each over
    ``make_engine(its settings)``; write ``results.json`` after each and return the results.

    Every ``checkpoint-every`` rounds an entry's state is written to its checkpoint
    (:mod:`pflalign.round.checkpoint`), which is removed once the entry's results are written. With
    ``resume``, the entries already finished in ``out-dir``'s ``results.json`` (which must have
    been written with the same config, :func:`previous_results`) are kept, not run again; the
    others run, each from its checkpoint when it has one, and ``results.json`` ends up as an
    uninterrupted run would have written it. Without ``resume``, checkpoints left by an earlier
    run are removed and every entry runs from round 1.

    When the run is asked to stop (:mod:`pflalign.process.interrupt`), the finished entries are
    written with ``"interrupted": true``, the labels of the entries that did not finish under
    ``"unfinished"``, and the finished rounds of the one that was running under ``"partial"``; then
    :class:`~pflalign.process.interrupt.Interrupted` propagates, carrying where they were written.
    """
    reporter = reporter or Reporter()
    started = time.perf_counter()
    check_stop()
    federation_data = federated_dataset(settings)
    check_model_parts(settings)
    results = new_results(settings.to_dict(), federation_data.summary())
    choices = method_choices(settings)
    previous = previous_results(settings) if resume else None
    kept = {c.label: previous["methods"][c.label] for c in choices
            if previous is not None and c.label in previous["methods"]
            and previous["methods"][c.label].get("method") == c.name}
    results["methods"] = dict(kept)
    earlier_seconds = float(previous.get("seconds", 0.0)) if previous is not None else 0.0
    if resume and previous is None:
        reporter.info(f"Resuming in {settings.run.out_dir}: no results.json there yet; every "
                      "method entry runs, from its checkpoint where it has one.")
    running: tuple[str, str, dict, RoundLoop | None] | None = None
    path = None
    try:
        for choice in choices:
            check_stop()
            spec = METHODS[choice.name]
            overrides, method_settings = entry_settings(settings, choice)
            running = (choice.label, spec.name, overrides, None)
            checkpoint = Checkpoint.for_entry(settings.run.out_dir, choice.label,
                                              method_settings)
            if choice.label in kept:
                reporter.info(f"[{choice.label}] finished earlier: kept from results.json.")
                checkpoint.remove()  # left when a run was killed right after writing results
                continue
            if not resume:
                checkpoint.remove()  # an earlier run's: this one starts from round 1
            if (method_settings.run.model != settings.run.model
                    and "model" not in dict(choice.overrides)):
                reporter.info(f"[{choice.label}] runs on model {method_settings.run.model} (the "
                              "method needs batch norm).")
            loop, model = entry_loop(method_settings, choice.label, spec.name,
                                     make_engine(method_settings), reporter)
            running = (choice.label, spec.name, overrides, loop)
            entry = named_clients({**loop.run(model, checkpoint), "method": spec.name,
                                   "overrides": overrides}, results["partition"])
            note = loop.engine.memory_note()
            if note:
                reporter.info(f"[{choice.label}] {note}.")
            loop.engine.close()  # what the engine keeps on disk (spilled client state) goes now
            done = {**results["methods"], choice.label: entry}
            results["methods"] = {c.label: done[c.label] for c in choices if c.label in done}
            if is_language_model(method_settings.run.model):
                results["language-model"] = run_summary(method_settings.run.model,
                                                        template_model(method_settings)())
            running = None
            results["seconds"] = earlier_seconds + time.perf_counter() - started
            path = write_results(settings.run.out_dir, results)
            if not settings.run.keep_checkpoints:
                checkpoint.remove()
        if path is None:  # resumed with every entry finished already
            results["seconds"] = earlier_seconds + time.perf_counter() - started
            path = write_results(settings.run.out_dir, results)
    except Interrupted as stop:
        _write_interrupted(settings, results, choices, running, started - earlier_seconds, stop)
        raise
    reporter.result("\n" + comparison_table(results["methods"]))
    reporter.result(f"\nResults written to {path.resolve()}")
    return results


def named_clients(entry: dict, partition: Mapping) -> dict:
    """``entry`` with each per-client record carrying its client's name, where the data names
    its clients (client folders, a client column or array, text files)."""
    names = {c["id"]: c["name"] for c in partition.get("clients", []) if "name" in c}
    if names:
        entry["clients"] = [{**record, "name": names[record["id"]]} if record["id"] in names
                            else record for record in entry.get("clients", [])]
    return entry


def _write_interrupted(settings: Settings, results: dict, choices: list,
                       running: tuple[str, str, dict, RoundLoop | None] | None,
                       started: float, stop: Interrupted) -> None:
    """Write the finished entries of an interrupted run, and record where in ``stop``."""
    finished = list(results["methods"])
    results["interrupted"] = True
    results["unfinished"] = [c.label for c in choices if c.label not in results["methods"]]
    if running is not None and running[3] is not None and running[3].rounds:
        label, name, overrides, loop = running
        results["partial"] = {"label": label, "method": name, "overrides": overrides,
                              "rounds": list(loop.rounds)}
        stop.partial_rounds = len(loop.rounds)
    results["seconds"] = time.perf_counter() - started
    stop.results_path = write_results(settings.run.out_dir, results).resolve()
    stop.finished, stop.unfinished = finished, results["unfinished"]
