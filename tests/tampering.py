"""A tampering client, as an outsider would write one: it runs the project's own handlers and then
changes their replies (or drops them). Used by tests/test_probe.py.

:func:`tamper` changes one reply given as plain dicts (metrics; array records as NumPy state
dicts), so that the same case runs under Flower (:func:`tampering_app`, a ClientApp wrapping the
project's ClientApp handlers and rewriting their reply messages) and in the sequential engine
(:func:`tampering_handle`, wrapping :func:`pflalign.engines.host.handle`). ``cases`` maps a
client id to its case; a case named ``drop-train`` or ``drop-eval`` makes that client fail the
action's reply empty instead, which the server drops (the reference: the run with that client's
replies dropped; the client keeps the state its handler saved, as a tampering one does).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

import clients.app as project
from pflalign.wire.protocol import (
    CLIENT_STATE,
    EVALUATE,
    METRICS,
    MODEL,
    PARTITION_ID,
    STATE,
    TRAIN,
)

#: each case: the action whose reply it changes
CASES = {
    "scale": TRAIN,  # the update times 1000
    "signflip": TRAIN,  # the update reversed: an honest norm, within every bound
    "missing-loss": TRAIN,  # no train-loss
    "absurd-loss": TRAIN,  # train-loss = 1e300
    "list-loss": TRAIN,  # train-loss a list of 100,000 floats
    "extra-keys": TRAIN,  # 1,000 metrics nobody declared
    "nan": TRAIN,  # one NaN in the model
    "renamed": TRAIN,  # a model entry under another name
    "inflate": TRAIN,  # num-examples times a million
    "other-id": TRAIN,  # claims to be client 0
    "perfect-eval": EVALUATE,  # every test sample correct, zero losses
    "nan-eval-loss": EVALUATE,  # a NaN personal loss: what a diverged personal model reports
    "bad-state": STATE,  # a saved state with a path-like key, inf values and a stray dtype
}
#: the reference run's counterpart of each case: the replies the client drops (a bad saved
#: state fails both audits: the training one asks for the state before training, the evaluation
#: one after)
DROPPED = {case: {TRAIN: "drop-train", EVALUATE: "drop-eval", STATE: "drop-all"}[action]
           for case, action in CASES.items()}


def tamper(case: str, action: str, received: Mapping[str, Mapping[str, np.ndarray]],
           metrics: dict, arrays: dict[str, dict[str, np.ndarray]]) -> tuple[dict, dict]:
    """The reply ``case`` sends in place of (``metrics``, ``arrays``) for ``action``."""
    if case == f"drop-{'eval' if action == EVALUATE else action}" or (
            case == "drop-all" and action in (TRAIN, EVALUATE)):
        return {}, {}
    if CASES.get(case) != action and not (case == "bad-state" and action == STATE):
        return metrics, arrays
    metrics, arrays = dict(metrics), {k: dict(v) for k, v in arrays.items()}
    model = arrays.get(MODEL, {})
    if case in ("scale", "signflip"):
        glob, factor = received[MODEL], 1000 if case == "scale" else -1
        arrays[MODEL] = {k: (glob[k] + factor * (v - glob[k])).astype(v.dtype)
                         if v.dtype.kind == "f" else v for k, v in model.items()}
    elif case == "missing-loss":
        del metrics["train-loss"]
    elif case == "absurd-loss":
        metrics["train-loss"] = 1e300
    elif case == "list-loss":
        metrics["train-loss"] = [0.5] * 100_000
    elif case == "extra-keys":
        metrics.update({f"extra-{i}": float(i) for i in range(1000)})
    elif case == "nan":
        key = next(k for k, v in model.items() if v.dtype.kind == "f")
        value = model[key].copy()
        value.flat[0] = np.nan
        arrays[MODEL] = {**model, key: value}
    elif case == "renamed":
        key = next(iter(model))
        arrays[MODEL] = {(f"{key}.renamed" if k == key else k): v for k, v in model.items()}
    elif case == "inflate":
        metrics["num-examples"] = metrics["num-examples"] * 1_000_000
    elif case == "other-id":
        metrics[PARTITION_ID] = 0
    elif case == "perfect-eval":
        metrics.update({k: metrics["num-test"] for k in metrics if k.endswith("-correct")})
        metrics.update({k: 0.0 for k in metrics if k.endswith("-loss")})
    elif case == "nan-eval-loss":
        metrics["personal-loss"] = float("nan")
    elif case == "bad-state":
        state = arrays.get(CLIENT_STATE, {})
        arrays[CLIENT_STATE] = {**state, "evil/../../key": np.full(3, np.inf),
                                **{k: np.full_like(v, np.inf) for k, v in state.items()
                                   if v.dtype.kind == "f"}}
    return metrics, arrays


# --- under Flower -----------------------------------------------------------------------------
def _tampered_message(cases: Mapping[int, str], action: str, msg: Message, context: Context,
                      handler: Callable[[Message, Context], Message]) -> Message:
    reply = handler(msg, context)
    case = cases.get(project.client_id_of(context))
    if case is None:
        return reply
    received = {name: {k: a.numpy() for k, a in record.items()}
                for name, record in msg.content.array_records.items()}
    metrics = dict(reply.content.metric_records[METRICS])
    arrays = {name: {k: a.numpy() for k, a in record.items()}
              for name, record in reply.content.array_records.items()}
    metrics, arrays = tamper(case, action, received, metrics, arrays)
    content = RecordDict({METRICS: MetricRecord(metrics)})
    for name, values in arrays.items():
        content[name] = ArrayRecord({k: Array(np.ascontiguousarray(v))
                                     for k, v in values.items()})
    return Message(content, reply_to=msg)


def tampering_app(cases: Mapping[int, str]) -> ClientApp:
    """A ClientApp that serves the project's handlers and tampers with the replies of the
    clients in ``cases`` (client id -> case)."""
    app = ClientApp()
    cases = dict(cases)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return project.query(msg, context)  # discovery stays honest

    @app.query(STATE)
    def state_query(msg: Message, context: Context) -> Message:
        return _tampered_message(cases, STATE, msg, context, project.state_query)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return _tampered_message(cases, TRAIN, msg, context, project.train)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return _tampered_message(cases, EVALUATE, msg, context, project.evaluate)

    return app


# --- in the sequential engine -----------------------------------------------------------------
def tampering_handle(cases: Mapping[int, str], handle: Callable) -> Callable:
    """:func:`pflalign.engines.host.handle`, tampering with the replies of the clients in
    ``cases``."""

    def tampered(action, settings, client_id, config, arrays, saved, node=None):
        metrics, reply, state = handle(action, settings, client_id, config, arrays, saved,
                                       node=node)
        case = cases.get(client_id)
        if case is None:
            return metrics, reply, state
        received = {name: {k: v.numpy() for k, v in record.items()}
                    for name, record in arrays.items()}
        plain = {name: {k: v.detach().cpu().numpy() for k, v in record.items()}
                 for name, record in reply.items()}
        metrics, plain = tamper(case, action, received, metrics, plain)
        return metrics, {name: {k: torch.from_numpy(np.ascontiguousarray(v))
                                for k, v in record.items()}
                         for name, record in plain.items()}, state

    return tampered
