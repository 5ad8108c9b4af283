"""Seeded fault injection for robustness studies: failing, silent and malicious clients.

Everything here runs on the client side, around the client handler
(:func:`pflalign.engines.host.handle`) as a Flower mod runs around a ClientApp: :func:`with_faults`
wraps a handler, and an engine that runs the handler in halves (the batched one) calls
:func:`before_handler` and :func:`after_handler` around them. The handler itself knows nothing of
faults, so the server's audit, which calls it directly, recomputes what an honest client replies.
An injected fault travels through the real engine and meets the server's real checks, exactly as
a broken or hostile client would. Every draw is seeded by (seed, round, client), so a run is
reproducible and every method of a comparison meets the same faults.

- ``client-failure-rate``: the training call raises (:class:`InjectedFailure`).
- ``client-dropout-rate``: the client does not reply to training before ``round-timeout``
  (:class:`ClientDropout`; the engine turns it into a missing reply).
- ``malicious-clients`` clients (chosen by seed among the training clients) run ``attack``:

  ========================  ==================================================================
  ``signflip``              upload ``g - (m - g)``: the update reversed
  ``scale``                 upload ``g + s (m - g)``
  ``noise``                 upload ``g + s |m - g| z / |z|``, ``z`` standard normal
  ``labelflip``             train on labels ``c -> C - 1 - c``
  ``inflate-count``         report ``s`` times the true num-examples
  ``fake-eval``             report ``s`` times the true num-test, every sample correct
  ``perfect-eval``          report every test sample correct (true num-test) and zero losses
  ``hang``                  never reply (to training or evaluation)
  ========================  ==================================================================

  where ``g`` is the model the client received, ``m`` the model it trained and ``s`` is
  ``attack-scale``. Model attacks touch floating-point entries only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import torch

from pflalign.data.datasets import ClientData
from pflalign.data.node import NodeData, pooled_node_data
from pflalign.engines.host import Handler, Metrics, ReplyArrays
from pflalign.process.caches import cached
from pflalign.settings.options import Value
from pflalign.settings.schema import Settings
from pflalign.wire.protocol import (
    CORRECT_COUNTS,
    EVALUATE,
    LOSSES,
    MODEL,
    NUM_EXAMPLES,
    NUM_TEST,
    ROUND,
    STATE,
    TRAIN,
)
from pflalign.wire.state import State

#: seed streams, apart from those of training (pflalign.training.loops)
_STREAM_MALICIOUS, _STREAM_FAULT, _STREAM_NOISE = 7001, 7002, 7003

MODEL_ATTACKS = ("signflip", "scale", "noise")


class InjectedFailure(RuntimeError):
    """The failure ``client-failure-rate`` injects."""


class ClientDropout(Exception):
    """The client stays silent for this message: an engine sends no reply."""


@cached(maxsize=32)
def _malicious(seed: int, num_clients: int, count: int) -> frozenset[int]:
    rng = np.random.default_rng([seed, _STREAM_MALICIOUS])
    return frozenset(int(c) for c in rng.choice(num_clients, size=count, replace=False))


def malicious_clients(settings: Settings) -> frozenset[int]:
    """The training clients that run ``attack`` (drawn once from the seed)."""
    run = settings.run
    if run.malicious_clients == 0:
        return frozenset()
    return _malicious(run.seed, run.num_clients, run.malicious_clients)


def injected_fault(settings: Settings, client_id: int, server_round: int) -> str | None:
    """``"failure"``, ``"dropout"`` or None for this client's training call in this round."""
    run = settings.run
    if run.client_failure_rate == 0 and run.client_dropout_rate == 0:
        return None
    draw = np.random.default_rng([run.seed, _STREAM_FAULT, server_round, client_id]).random()
    if draw < run.client_failure_rate:
        return "failure"
    if draw < run.client_failure_rate + run.client_dropout_rate:
        return "dropout"
    return None


def attack_of(settings: Settings, client_id: int) -> str | None:
    """The attack ``client_id`` runs, None for an honest client."""
    return settings.run.attack if client_id in malicious_clients(settings) else None


def before_action(settings: Settings, client_id: int, action: str, server_round: int) -> None:
    """Raise the injected fault of this call, if any (hang: every call of a hanging client;
    failures and dropouts: training calls only)."""
    if attack_of(settings, client_id) == "hang":
        raise ClientDropout(f"client {client_id} hangs (attack = hang)")
    if action != TRAIN:
        return
    fault = injected_fault(settings, client_id, server_round)
    if fault == "failure":
        raise InjectedFailure(f"injected failure (client-failure-rate, round {server_round})")
    if fault == "dropout":
        raise ClientDropout(f"client {client_id} drops out (client-dropout-rate)")


def flipped_labels(data: ClientData, num_classes: int) -> ClientData:
    """``data`` with its training labels mapped ``c -> C - 1 - c`` (test labels untouched)."""
    return replace(data, train_y=num_classes - 1 - data.train_y)


def attacked_upload(settings: Settings, client_id: int, server_round: int,
                    received: Mapping[str, torch.Tensor] | None,
                    model: Mapping[str, torch.Tensor] | None, metrics: Metrics,
                    ) -> tuple[Mapping[str, torch.Tensor] | None, Metrics]:
    """The model and metrics a malicious client sends in place of ``model`` and ``metrics``
    (model and count attacks)."""
    attack, scale = attack_of(settings, client_id), settings.run.attack_scale
    metrics = dict(metrics)
    if attack == "inflate-count" and NUM_EXAMPLES in metrics:
        metrics[NUM_EXAMPLES] = metrics[NUM_EXAMPLES] * scale
    if attack in MODEL_ATTACKS and model is not None and received is not None:
        keys = [k for k, v in model.items()
                if k in received and torch.is_floating_point(v)]
        update = {k: model[k].detach().double() - received[k].double() for k in keys}
        if attack == "noise":
            gen = torch.Generator().manual_seed(
                int(np.random.default_rng([settings.run.seed, _STREAM_NOISE, server_round,
                                           client_id]).integers(2**62)))
            noise = {k: torch.randn(update[k].shape, generator=gen, dtype=torch.float64)
                     for k in keys}
            length = scale * _norm(update) / max(_norm(noise), 1e-300)
            update = {k: length * noise[k] for k in keys}
        else:
            factor = -1.0 if attack == "signflip" else scale
            update = {k: factor * u for k, u in update.items()}
        model = {**model, **{k: (received[k].double() + update[k]).to(model[k].dtype)
                             for k in keys}}
    return model, metrics


def attacked_evaluation(settings: Settings, client_id: int,
                        metrics: dict[str, float | int]) -> dict[str, float | int]:
    """The evaluation metrics a malicious client reports (fake-eval, perfect-eval: everything
    correct)."""
    attack = attack_of(settings, client_id)
    if attack == "perfect-eval" and NUM_TEST in metrics:
        return {**metrics, **{key: metrics[NUM_TEST] for key in CORRECT_COUNTS if key in metrics},
                **{key: 0.0 for key in LOSSES if key in metrics}}
    if attack != "fake-eval" or NUM_TEST not in metrics:
        return metrics
    claimed = metrics[NUM_TEST] * settings.run.attack_scale
    return {**metrics, NUM_TEST: claimed,
            **{key: claimed for key in CORRECT_COUNTS if key in metrics}}


def before_handler(action: str, settings: Settings, client_id: int, config: Mapping[str, Value],
                   node: NodeData | None) -> NodeData | None:
    """What is injected before a client's handler runs: the fault of this call (raised), and
    the data a ``labelflip`` attacker trains on (its node data with flipped training labels; else
    ``node`` as given). A state query meets no fault."""
    if action == STATE:
        return node
    before_action(settings, client_id, action, int(config[ROUND]))
    if action == TRAIN and attack_of(settings, client_id) == "labelflip":
        node = node if node is not None else pooled_node_data(settings, client_id)
        return replace(node, data=flipped_labels(node.data, node.num_classes))
    return node


def after_handler(action: str, settings: Settings, client_id: int, config: Mapping[str, Value],
                  arrays: Mapping[str, Mapping[str, torch.Tensor]], metrics: Metrics,
                  reply: ReplyArrays) -> tuple[Metrics, ReplyArrays]:
    """The reply a malicious client sends in place of its handler's (``arrays``: what it
    received)."""
    if action == EVALUATE:
        return attacked_evaluation(settings, client_id, metrics), reply
    if action != TRAIN:
        return metrics, reply
    model, metrics = attacked_upload(settings, client_id, int(config[ROUND]), arrays.get(MODEL),
                                     reply.get(MODEL), metrics)
    return metrics, ({**reply, MODEL: model} if model is not None else reply)


def with_faults(handler: Handler) -> Handler:
    """``handler`` with the run's fault injection around it (:func:`before_handler`,
    :func:`after_handler`)."""

    def faulty(action: str, settings: Settings, client_id: int, config: Mapping[str, Value],
               arrays: Mapping[str, Mapping[str, torch.Tensor]], saved: State | None,
               node: NodeData | None = None) -> tuple[Metrics, ReplyArrays, State | None]:
        node = before_handler(action, settings, client_id, config, node)
        metrics, reply, state = handler(action, settings, client_id, config, arrays, saved,
                                        node=node)
        return (*after_handler(action, settings, client_id, config, arrays, metrics, reply),
                state)

    return faulty


def _norm(state: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((v * v).sum()) for v in state.values()))
