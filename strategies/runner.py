"""Run a list of methods one after another on the same partition, seed and clients.

Used by the ServerApp in both modes: ``flwr run .`` (settings from the run config) and
``simulate.py`` (settings resolved from the command line). Results are written after every method,
so a later failure never loses an earlier method's results.
"""

from __future__ import annotations

import time

from flwr.serverapp import Grid

from pflalign.config import Settings
from pflalign.federation import federated_dataset
from pflalign.methods import METHODS, method_overrides
from pflalign.models import build_model
from pflalign.results import Reporter, comparison_table, new_results, write_results


def initial_state(settings: Settings) -> tuple[dict, tuple[str, ...]]:
    """The run's initial model (seeded) as NumPy arrays, and the names of its trainable entries."""
    dataset = federated_dataset(settings).dataset
    model = build_model(str(settings["model"]), dataset.input_shape, dataset.num_classes,
                        seed=int(settings["seed"]))
    state = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    return state, tuple(name for name, p in model.named_parameters() if p.requires_grad)


def run_methods(grid: Grid, settings: Settings, reporter: Reporter | None = None) -> dict:
    """Run every method in ``settings.methods``; return (and write) the results dictionary."""
    reporter = reporter or Reporter()
    started = time.perf_counter()
    federation = federated_dataset(settings)
    results = new_results(settings.to_dict(), federation.summary())
    for choice in settings.method_choices:
        spec = METHODS[choice.name]
        overrides = method_overrides(spec, settings, dict(choice.overrides))
        # the entry's own settings: its overrides, and 'methods' naming just this entry
        method_settings = (settings.replace({**overrides, "methods": choice.label})
                           if overrides else settings)
        if method_settings["model"] != settings["model"] and "model" not in dict(choice.overrides):
            reporter.info(f"[{choice.label}] runs on model {method_settings['model']} (the "
                          "method needs batch norm).")
        state, trainable = initial_state(method_settings)
        strategy = spec.load_strategy()(method_settings, spec, state, reporter,
                                        trainable=trainable, label=choice.label)
        results["methods"][choice.label] = {**strategy.start(grid), "method": spec.name,
                                            "overrides": overrides}
        results["seconds"] = time.perf_counter() - started
        path = write_results(str(settings["out-dir"]), results)
    reporter.result("\n" + comparison_table(results["methods"]))
    reporter.result(f"\nResults written to {path.resolve()}")
    return results
