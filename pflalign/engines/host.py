"""The client side of every engine: one message in, a method's client rule, one reply out.

:func:`handle` takes what an engine delivered to a client (the action, the message config, the
array records as NumPy state dicts, and the client's saved state as flat arrays), runs the
method's rule on a :class:`~pflalign.client.ClientRuntime`, and returns the reply's metrics and
array records and the client's new saved state. The Flower ClientApp and the sequential engine
both call it, so a method behaves the same under each.

Two records serve checkpoints (:mod:`pflalign.checkpoint`): a :data:`~pflalign.protocol.STATE`
action returns the client's saved state as it is, changing nothing; and a message carrying a
:data:`~pflalign.protocol.RESTORE` record (the client's state from a checkpoint, sent once after a
resume) runs on that state in place of the saved one, which the client then keeps.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from functools import lru_cache

import numpy as np
import torch

from pflalign import faults
from pflalign.annealing import GGA_ACTION, client_answer
from pflalign.client import ClientRuntime, Received, Upload
from pflalign.config import Settings
from pflalign.federation import federated_dataset
from pflalign.method import Method
from pflalign.methods import METHODS
from pflalign.node import NodeData
from pflalign.options import Value
from pflalign.protocol import (
    ACTION,
    CLIENT_SECONDS,
    CLIENT_STATE,
    EVALUATE,
    HAD_STATE,
    KEPT_STATE,
    METHOD,
    MODEL,
    NUM_EXAMPLES,
    NUM_TEST,
    NUM_TRAIN,
    PARTITION_ID,
    QUERY,
    RESTORE,
    ROUND,
    STATE,
    TRAIN,
    UNSEEN,
)
from pflalign.state import Arrays, ArrayState
from pflalign.train import configure_threads, pick_device

Metrics = dict[str, float | int]
ReplyArrays = dict[str, Mapping[str, torch.Tensor]]


@lru_cache(maxsize=8)
def method_of(settings: Settings, name: str) -> Method:
    """The registered method ``name`` with its Params read from ``settings`` (cached per run)."""
    return METHODS[name].build(settings)


def discovery(settings: Settings, client_id: int, node: NodeData | None = None) -> Metrics:
    """A client's answer to discovery: its stable id and split sizes (from ``node``, the node's
    own partition file, when given; else from the pooled partition). An id outside the run's
    clients is an error naming the fix."""
    if node is not None:
        if node.client_id != client_id:
            raise ValueError(f"partition-id {client_id} does not match the node's partition file "
                             f"(client {node.client_id}).")
        return node.discovery()
    partition = federated_dataset(settings).partition
    if not 0 <= client_id < partition.num_clients:
        raise ValueError(f"partition-id {client_id} is outside this run's {partition.num_clients} "
                         "clients (num-clients + num-unseen-clients).")
    return {PARTITION_ID: client_id, NUM_TRAIN: len(partition.train[client_id]),
            NUM_TEST: len(partition.test[client_id]), UNSEEN: int(partition.is_unseen(client_id))}


def to_torch(arrays: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, dict[str, torch.Tensor]]:
    """Received array records as torch state dicts (copies; empty records dropped)."""
    return {name: {k: torch.from_numpy(np.array(v, copy=True)) for k, v in record.items()}
            for name, record in arrays.items() if len(record)}


def handle(action: str, settings: Settings, client_id: int,
           config: Mapping[str, Value], arrays: Mapping[str, Mapping[str, torch.Tensor]],
           saved: Arrays | None, node: NodeData | None = None,
           ) -> tuple[Metrics, ReplyArrays, Arrays | None]:
    """Run one action of the method named in ``config`` for ``client_id``.

    ``arrays`` are the received records as torch state dicts, ``saved`` the client's state as
    :meth:`~pflalign.state.ArrayState.to_arrays` left it (None when it has none), ``node`` the
    client's data as its node holds it (None: from the pooled dataset). Returns the reply's
    metrics and array records and the new saved state (None: unchanged).

    A :data:`~pflalign.protocol.STATE` action replies with ``saved`` as the record
    :data:`~pflalign.protocol.CLIENT_STATE` (no fault is injected, nothing changes). A
    :data:`~pflalign.protocol.RESTORE` record in ``arrays`` replaces ``saved`` and is returned as
    the new saved state unless the action saves another (a resumed client keeps it)."""
    if action == STATE:
        return ({PARTITION_ID: client_id},
                {CLIENT_STATE: {k: torch.from_numpy(np.array(v, order="C", copy=True))
                                for k, v in (saved or {}).items()}}, None)
    restored = None
    if RESTORE in arrays:
        restored = {k: np.array(v.detach().cpu().numpy(), copy=True)
                    for k, v in arrays[RESTORE].items()}
        arrays = {name: record for name, record in arrays.items() if name != RESTORE}
        saved = restored
    started = time.perf_counter()
    method = method_of(settings, str(config[METHOD]))
    configure_threads(settings.run.client_resources_num_cpus)
    device = pick_device(settings.run.client_resources_num_gpus)
    received = Received(int(config[ROUND]), dict(arrays), dict(config))
    faults.before_action(settings, client_id, action, received.server_round)
    client = ClientRuntime(settings, client_id, device, node)
    if action == TRAIN and faults.attack_of(settings, client_id) == "labelflip":
        client.data = faults.flipped_labels(client.data, client.num_classes)
    if action == QUERY:
        if config.get(ACTION) != GGA_ACTION:
            raise ValueError(f"Unknown query action {config.get(ACTION)!r}.")
        metrics, reply = client_answer(client, received, settings.gga)
        return {PARTITION_ID: client_id, **metrics}, reply, restored
    state = method.ClientState.from_arrays(saved or {})
    if action == EVALUATE:
        metrics = {PARTITION_ID: client_id, **method.evaluate(client, received, state)}
        return faults.attacked_evaluation(settings, client_id, metrics), {}, restored
    if action != TRAIN:
        raise ValueError(f"Unknown action {action!r}.")
    upload, new_state = method.train(client, received, state)
    kept = state_to_keep(new_state, restored)
    upload = faults.attacked_upload(settings, client_id, received.server_round, received.model,
                                    counted(upload, client.data.num_train))
    metrics, reply = train_reply(client_id, upload, saved, kept, time.perf_counter() - started)
    return metrics, reply, kept


def state_to_keep(new_state: ArrayState, fallback: Arrays | None) -> Arrays | None:
    """The flat state a client saves after training: ``new_state``'s arrays, or ``fallback``
    when any of its floats is not finite (never save a broken state)."""
    kept = new_state.to_arrays()
    if not all(np.isfinite(v).all() for v in kept.values() if np.asarray(v).dtype.kind == "f"):
        return fallback
    return kept


def counted(upload: Upload, num_train: int) -> Upload:
    """``upload`` with the client's training-sample count first among its metrics."""
    return replace(upload, metrics={NUM_EXAMPLES: num_train, **upload.metrics})


def train_reply(client_id: int, upload: Upload, saved: Arrays | None, kept: Arrays | None,
                seconds: float) -> tuple[Metrics, ReplyArrays]:
    """A training reply's metrics and array records (the model first) from a client's upload,
    the state it had (``saved``) and the state it keeps (``kept``; None: ``saved``)."""
    metrics = {PARTITION_ID: client_id, **upload.metrics,
               HAD_STATE: int(bool(saved)), KEPT_STATE: int(bool(saved if kept is None else kept)),
               CLIENT_SECONDS: seconds}
    reply = dict(upload.arrays)
    if upload.model is not None:
        reply = {MODEL: upload.model, **reply}
    return metrics, reply
