"""Test helpers: a method's client and server rules run by hand, state kept as the engines keep it.

A client's state goes through ``to_arrays`` / ``from_arrays`` between calls, exactly as the
engines persist it (:mod:`pflalign.engines.host`), so a test sees what survives between rounds;
a rule's local runs are executed on the client one after another, as every engine but the
batched one's vmap backend executes them (:func:`run_rule`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from pflalign.methods.base import Method
from pflalign.methods.registry import METHODS
from pflalign.run.config import build_settings
from pflalign.run.driver import initial_model, template_model
from pflalign.server.runtime import ServerRuntime
from pflalign.settings.schema import Settings
from pflalign.training.client import ClientRuntime
from pflalign.training.runs import Rule, complete
from pflalign.wire.messages import ClientInfo, Received, Upload
from pflalign.wire.state import ArrayState

CPU = torch.device("cpu")


def method_settings(name: str, base: Mapping[str, object], **changes: object) -> Settings:
    """``base`` with ``changes``, and the keys a registered variant fixes."""
    settings = build_settings({**base, **changes})
    overrides = dict(METHODS[name].overrides)
    return settings.replace(overrides) if overrides else settings


def build(name: str, base: Mapping[str, object], cid: int = 0, **changes: object,
          ) -> tuple[Method, ClientRuntime]:
    """The method ``name`` and client ``cid`` of a run configured by ``base`` and ``changes``."""
    settings = method_settings(name, base, **changes)
    return METHODS[name].build(settings), ClientRuntime(settings, cid, CPU)


def persist(state: ArrayState) -> ArrayState:
    """``state`` after a save and a load, as an engine keeps it between messages."""
    return type(state).from_arrays(state.to_arrays())


def run_rule(rule: Rule, client: ClientRuntime, server_round: int) -> object:
    """A client rule's result, its local runs executed on ``client``."""
    return complete(rule, lambda run: client.execute(run, server_round))


def train(method: Method, client: ClientRuntime, server_round: int,
          arrays: Mapping[str, Mapping[str, torch.Tensor]], state: ArrayState | None = None,
          config: Mapping[str, object] | None = None) -> tuple[Upload, ArrayState]:
    """One training action; ``state`` None is a client that has none yet. Returns the upload and
    the client's new state as it would be loaded for its next action."""
    state = method.ClientState() if state is None else persist(state)
    upload, new = run_rule(method.train(client, Received(server_round, dict(arrays),
                                                         dict(config or {})), state),
                           client, server_round)
    return upload, persist(new)


def evaluate(method: Method, client: ClientRuntime, server_round: int,
             arrays: Mapping[str, Mapping[str, torch.Tensor]], state: ArrayState | None = None,
             config: Mapping[str, object] | None = None) -> dict:
    """One evaluation action on ``state`` as given (None: a client without state)."""
    state = method.ClientState() if state is None else state
    return run_rule(method.evaluate(client, Received(server_round, dict(arrays),
                                                     dict(config or {})), state),
                    client, server_round)


def global_state(client: ClientRuntime, shift: float = 0.0) -> dict[str, torch.Tensor]:
    """The run's initial model, its floating entries shifted by ``shift``."""
    return {k: v + shift if v.is_floating_point() else v
            for k, v in client.new_model().state_dict().items()}


def server(name: str, settings: Settings, num_clients: int,
           initial: Mapping[str, np.ndarray] | None = None, trainable: tuple[str, ...] = (),
           num_train: Callable[[int], int] = lambda c: 10,
           ) -> tuple[Method, ServerRuntime, dict[str, np.ndarray]]:
    """The method ``name``, its server runtime with clients ``0..num_clients-1`` (``num_train(c)``
    train and 5 test samples each, none unseen) and the initial model: the run's, or ``initial``
    with the entries ``trainable``."""
    method = METHODS[name].build(settings)
    if initial is None:
        model, names = initial_model(settings)
        template = template_model(settings)
    else:
        model, names = dict(initial), tuple(trainable)
        template = lambda: None  # noqa: E731  (a hand-made model has no layers to look up)
    runtime = ServerRuntime(settings, name, model, names, template)
    runtime.keep_personal(method.personal_keys(runtime))
    runtime.clients = {c: ClientInfo(id=c, num_train=num_train(c), num_test=5, unseen=False)
                       for c in range(num_clients)}
    return method, runtime, model


def three_engines(values: Mapping[str, object], out, compared_at_least: int,
                  flower: bool = True) -> dict:
    """Run the config ``values`` on the sequential engine, the batched one and a real Flower
    simulation (a ``simulate.py`` process; not with ``flower`` false) under ``out``; assert all
    give the same metrics (at least ``compared_at_least`` values compared) and return the
    sequential results."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    from pflalign.run.driver import simulate
    from scripts.compare_results import compare

    sequential = simulate(build_settings({**values, "engine": "sequential",
                                                     "out-dir": str(out / "s")}))
    batched = simulate(build_settings({**values, "engine": "batched",
                                               "out-dir": str(out / "b")}))
    differences, compared = compare(sequential, batched)
    assert differences == [] and compared >= compared_at_least
    if not flower:
        return sequential
    flags = [arg for k, v in values.items()
             for arg in ("--set", f"{k}={json.dumps(v) if isinstance(v, str) else v}")]
    result = subprocess.run([sys.executable, str(ROOT / "simulate.py"), *flags, "--quiet",
                             "--set", "engine=flower", "--set", "report=false",
                             "--out", str(out / "f")],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    flower = json.loads((out / "f" / "results.json").read_text())
    differences, compared = compare(sequential, flower)
    assert differences == [] and compared >= compared_at_least
    return sequential


def train_metrics(cid: int, examples: int = 10, loss: float = 0.5, **extra: float) -> dict:
    """The metrics of an honest training reply of client ``cid`` (every key of
    :data:`pflalign.wire.protocol.TRAIN_METRICS`), with ``extra`` (a method's own)."""
    return {"partition-id": cid, "num-examples": examples, "train-loss": loss, "local-steps": 5,
            "client-seconds": 0.1, "had-state": 0, "kept-state": 0, **extra}
