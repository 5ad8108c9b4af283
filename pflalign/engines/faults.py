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
  ``backdoor``              train with a trigger on some relabelled samples, upload
                            ``g + gamma (m - g)`` (:func:`backdoor_boost`)
  ``free-rider``            upload ``g``
  ``replay``                upload ``g`` plus its previous update
  ``alie``, ``ipm``,        one update crafted from all the attackers' honest ones
  ``min-max``, ``min-sum``  (:mod:`pflalign.engines.collusion`)
  ========================  ==================================================================

  where ``g`` is the model the client received, ``m`` the model it trained and ``s`` is
  ``attack-scale``; ``attackers`` sets the malicious clients as a share instead. Model attacks
  touch floating-point entries only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import torch

from pflalign.data.datasets import ClientData
from pflalign.data.node import NodeData, pooled_node_data
from pflalign.engines.collusion import CHANNEL, crafted, honest_updates, run_key
from pflalign.engines.host import Handler, Metrics, ReplyArrays
from pflalign.engines.updates import flat_update, float_keys
from pflalign.process.caches import cached
from pflalign.settings.options import Value
from pflalign.settings.schema import COLLUDING_ATTACKS, Settings
from pflalign.training.backdoor import poisoned
from pflalign.wire.protocol import (
    CORRECT_COUNTS,
    EVALUATE,
    LABEL,
    LOSSES,
    METHOD,
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

#: the attacks on the uploaded model's update alone (backdoor's boost: once it trained poisoned)
MODEL_ATTACKS = ("signflip", "scale", "noise", "backdoor")


class InjectedFailure(RuntimeError):
    """The failure ``client-failure-rate`` injects."""


class ClientDropout(Exception):
    """The client stays silent for this message: an engine sends no reply."""


@cached(maxsize=32)
def _malicious(seed: int, num_clients: int, count: int) -> frozenset[int]:
    rng = np.random.default_rng([seed, _STREAM_MALICIOUS])
    return frozenset(int(c) for c in rng.choice(num_clients, size=count, replace=False))


def attacker_count(settings: Settings) -> int:
    """How many training clients attack: ``malicious-clients``, or ``round(attackers *
    num-clients)`` (at least one)."""
    run = settings.run
    if run.attackers > 0:
        return max(1, min(run.num_clients, round(run.attackers * run.num_clients)))
    return run.malicious_clients


def malicious_clients(settings: Settings) -> frozenset[int]:
    """The training clients that run ``attack`` (drawn once from the seed)."""
    count = attacker_count(settings)
    if count == 0:
        return frozenset()
    return _malicious(settings.run.seed, settings.run.num_clients, count)


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
        keys = float_keys(received, model)
        update = {k: model[k].detach().double() - received[k].double() for k in keys}
        if attack == "noise":
            gen = torch.Generator().manual_seed(
                int(np.random.default_rng([settings.run.seed, _STREAM_NOISE, server_round,
                                           client_id]).integers(2**62)))
            noise = {k: torch.randn(update[k].shape, generator=gen, dtype=torch.float64)
                     for k in keys}
            length = scale * _norm(update) / max(_norm(noise), 1e-300)
            update = {k: length * noise[k] for k in keys}
        else:  # the backdoor's model replacement boosts its update (Bagdasaryan et al. 2020)
            factor = {"signflip": -1.0, "backdoor": backdoor_boost(settings)}.get(attack, scale)
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
                   node: NodeData | None, saved: State | None = None) -> NodeData | None:
    """What is injected before a client's handler runs: the fault of this call (raised), and
    the data a ``labelflip`` attacker trains on (its node data with flipped training labels; else
    ``node`` as given). A state query meets no fault. A colluding attacker records the state
    it trains from (``saved``) for the others (:mod:`pflalign.engines.collusion`)."""
    if action == STATE:
        return node
    before_action(settings, client_id, action, int(config[ROUND]))
    attack = attack_of(settings, client_id) if action == TRAIN else None
    if attack in COLLUDING_ATTACKS:
        CHANNEL.record(run_key(settings, _label(config)), client_id, "state", int(config[ROUND]),
                       0, saved)
    if attack == "labelflip":
        node = node if node is not None else pooled_node_data(settings, client_id)
        return replace(node, data=flipped_labels(node.data, node.num_classes))
    if attack == "backdoor":
        node = node if node is not None else pooled_node_data(settings, client_id)
        run = settings.run
        if not 0 <= run.backdoor_target < node.num_classes:
            raise ValueError(f"backdoor-target = {run.backdoor_target} is not one of the "
                             f"{node.num_classes} classes.")
        return replace(node, data=poisoned(node.data, run.backdoor_fraction, run.backdoor_target,
                                           run.backdoor_patch, run.seed, client_id))
    return node


def after_handler(action: str, settings: Settings, client_id: int, config: Mapping[str, Value],
                  arrays: Mapping[str, Mapping[str, torch.Tensor]], metrics: Metrics,
                  reply: ReplyArrays, saved: State | None = None,
                  state: State | None = None) -> tuple[Metrics, ReplyArrays]:
    """The reply a malicious client sends in place of its handler's (``arrays``: what it
    received; ``saved`` and ``state``: its state before and after, None after: unchanged)."""
    attack = attack_of(settings, client_id)
    if attack in COLLUDING_ATTACKS and action in (TRAIN, EVALUATE):
        CHANNEL.record(run_key(settings, _label(config)), client_id, "state", int(config[ROUND]),
                       1 if action == TRAIN else 2, state if state is not None else saved)
    if action == EVALUATE:
        return attacked_evaluation(settings, client_id, metrics), reply
    if action != TRAIN:
        return metrics, reply
    if attack in COLLUDING_ATTACKS + ("free-rider", "replay") and MODEL in reply:
        return metrics, {**reply, MODEL: _crafted_upload(settings, client_id, config, arrays,
                                                         reply[MODEL])}
    model, metrics = attacked_upload(settings, client_id, int(config[ROUND]), arrays.get(MODEL),
                                     reply.get(MODEL), metrics)
    return metrics, ({**reply, MODEL: model} if model is not None else reply)


def backdoor_boost(settings: Settings) -> float:
    """The backdoor's model-replacement factor ``gamma = n / eta`` (Bagdasaryan et al. 2020,
    section 4; the server's learning rate eta is 1 here), with n the expected clients of a round,
    shared by the attackers expected among them: ``max(1, n / max(1, attackers * fraction))``."""
    run = settings.run
    per_round = max(1.0, run.fraction_train * run.num_clients)
    attackers = max(1.0, attacker_count(settings) * run.fraction_train)
    return max(1.0, per_round / attackers)


def _label(config: Mapping[str, Value]) -> str:
    return str(config.get(LABEL, config.get(METHOD, "")))


def _crafted_upload(settings: Settings, client_id: int, config: Mapping[str, Value],
                    arrays: Mapping[str, Mapping[str, torch.Tensor]],
                    model: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model a colluding, free-riding or replaying attacker uploads in place of ``model``
    (its honest one): the global model it received plus the crafted update."""
    attack, received = attack_of(settings, client_id), arrays[MODEL]
    keys = float_keys(received, model)
    own = flat_update(model, received, keys)
    run, server_round = run_key(settings, _label(config)), int(config[ROUND])
    if attack == "free-rider":
        update = np.zeros_like(own)
    elif attack == "replay":  # the update it sent last time (the global model back at first)
        previous = CHANNEL.latest(run, client_id, "update", server_round)
        update = previous["update"] if previous and len(previous["update"]) == len(own) else (
            np.zeros_like(own))
        CHANNEL.record(run, client_id, "update", server_round, 0, {"update": own})
    else:
        update = crafted(attack, honest_updates(settings, sorted(malicious_clients(settings)),
                                                run, config, arrays, keys, (client_id, own)),
                         settings)
    out, offset = dict(model), 0
    for key in keys:
        size = model[key].numel()
        part = torch.from_numpy(update[offset:offset + size].reshape(tuple(model[key].shape)))
        out[key] = (received[key].double() + part).to(model[key].dtype)
        offset += size
    return out


def with_faults(handler: Handler) -> Handler:
    """``handler`` with the run's fault injection around it (:func:`before_handler`,
    :func:`after_handler`)."""

    def faulty(action: str, settings: Settings, client_id: int, config: Mapping[str, Value],
               arrays: Mapping[str, Mapping[str, torch.Tensor]], saved: State | None,
               node: NodeData | None = None) -> tuple[Metrics, ReplyArrays, State | None]:
        node = before_handler(action, settings, client_id, config, node, saved)
        metrics, reply, state = handler(action, settings, client_id, config, arrays, saved,
                                        node=node)
        return (*after_handler(action, settings, client_id, config, arrays, metrics, reply,
                               saved, state), state)

    return faulty


def _norm(state: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((v * v).sum()) for v in state.values()))
