"""Seeded fault injection for robustness studies: failing, silent and malicious clients.

Everything here runs on the client side, inside :func:`pflalign.engines.host.handle`, so an
injected fault travels through the real engine and meets the server's real checks, exactly as a
broken or hostile client would. Every draw is seeded by (seed, round, client), so a run is
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
from pflalign.process.caches import cached
from pflalign.settings.schema import Settings
from pflalign.wire.messages import Upload
from pflalign.wire.protocol import CORRECT_COUNTS, LOSSES, NUM_EXAMPLES, NUM_TEST, TRAIN

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
                    received: Mapping[str, torch.Tensor] | None, upload: Upload) -> Upload:
    """The upload a malicious client sends in place of ``upload`` (model and count attacks)."""
    attack, scale = attack_of(settings, client_id), settings.run.attack_scale
    metrics = dict(upload.metrics)
    if attack == "inflate-count" and NUM_EXAMPLES in metrics:
        metrics[NUM_EXAMPLES] = metrics[NUM_EXAMPLES] * scale
    model = upload.model
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
    return replace(upload, model=model, metrics=metrics)


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


def _norm(state: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((v * v).sum()) for v in state.values()))
