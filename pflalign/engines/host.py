"""The client side of every engine: one message in, a method's client rule, one reply out.

:func:`handle` takes what an engine delivered to a client (the action, the message config, the array
records as NumPy state dicts, and the client's saved state as flat arrays), runs the method's rule
on a :class:`~pflalign.training.client.ClientRuntime` (its local runs one after another on that
client), and returns the reply's metrics and array records and the client's new saved state. The
Flower ClientApp and the sequential engine both call it, so a method behaves the same under each;
the batched engine calls its two halves, :func:`begin` and :func:`finish`, around rules it runs
together. Every training and evaluation reply carries the process metrics of the process that
ran it (:func:`~pflalign.wire.protocol.process_metrics`: a Ray worker's, a ClientApp's, or the
server's own under the in-process engines).

Two records serve checkpoints (:mod:`pflalign.round.checkpoint`): a
:data:`~pflalign.wire.protocol.STATE` action returns the client's saved state as it is, changing
nothing; and a message carrying a :data:`~pflalign.wire.protocol.RESTORE` record (the client's state
from a checkpoint, sent once after a resume) runs on that state in place of the saved one, which the
client then keeps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pflalign.data.federated import federated_dataset
from pflalign.data.node import NodeData
from pflalign.engines import secagg_client
from pflalign.methods.base import Method
from pflalign.methods.registry import METHODS
from pflalign.models.registry import ModelTemplate
from pflalign.process.caches import cached
from pflalign.server.privacy import run_noise_multiplier
from pflalign.settings.options import Value
from pflalign.settings.schema import RunConfig, Settings
from pflalign.training.client import ClientRuntime
from pflalign.training.gga_client import GGA_ACTION, client_answer
from pflalign.training.loops import configure_threads, pick_device
from pflalign.training.privacy import LOCAL_NOISE_STREAM, local_release, noise_rng
from pflalign.training.runs import Rule, complete
from pflalign.wire.messages import Received, Upload
from pflalign.wire.protocol import (
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
    SAVE_SCORED,
    SCORED,
    STATE,
    TRAIN,
    UNSEEN,
    process_metrics,
)
from pflalign.wire.state import ArrayState, State

Metrics = dict[str, float | int]
ReplyArrays = dict[str, Mapping[str, torch.Tensor]]
#: a client handler: (action, settings, client id, config, arrays, saved state, node) -> the
#: reply's metrics and arrays and the state to keep (:func:`handle`, or one wrapping it)
Handler = Callable[..., tuple[Metrics, ReplyArrays, "State | None"]]


@cached(maxsize=8)
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
    federation = federated_dataset(settings)
    partition = federation.partition
    if not 0 <= client_id < partition.num_clients:
        raise ValueError(f"partition-id {client_id} is outside this run's {partition.num_clients} "
                         "clients (num-clients + num-unseen-clients).")
    num_train, num_test = federation.sizes(client_id)
    return {PARTITION_ID: client_id, NUM_TRAIN: num_train, NUM_TEST: num_test,
            UNSEEN: int(partition.is_unseen(client_id))}


def to_torch(arrays: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, dict[str, torch.Tensor]]:
    """Received array records as torch state dicts (copies; empty records dropped)."""
    return {name: {k: torch.from_numpy(np.array(v, copy=True)) for k, v in record.items()}
            for name, record in arrays.items() if len(record)}


@dataclass
class Call:
    """One train or evaluate action of a client, ready to run: the method, the client's runtime,
    what it received and its state (:func:`begin`), and what :func:`finish` needs afterwards."""

    action: str
    method: Method
    client: ClientRuntime
    received: Received
    state: ArrayState
    saved: State | None
    restored: State | None
    started: float
    #: the round's SecAgg+ secrets the client holds (empty without secure aggregation)
    held: State = field(default_factory=dict)

    def rule(self) -> Rule:
        """The method's client rule for this action (a generator of local runs, or its
        result)."""
        rule = self.method.train if self.action == TRAIN else self.method.evaluate
        return rule(self.client, self.received, self.state)


def handle(action: str, settings: Settings, client_id: int,
           config: Mapping[str, Value], arrays: Mapping[str, Mapping[str, torch.Tensor]],
           saved: State | None, node: NodeData | None = None,
           ) -> tuple[Metrics, ReplyArrays, State | None]:
    """Run one action of the method named in ``config`` for ``client_id``.

    ``arrays`` are the received records as torch state dicts, ``saved`` the client's state as
    :meth:`~pflalign.wire.state.ArrayState.to_arrays` left it (None when it has none), ``node`` the
    client's data as its node holds it (None: from the pooled dataset). Returns the reply's
    metrics and array records and the new saved state (None: unchanged).

    A :data:`~pflalign.wire.protocol.STATE` action replies with ``saved`` as the record
    :data:`~pflalign.wire.protocol.CLIENT_STATE` (nothing changes). A
    :data:`~pflalign.wire.protocol.RESTORE` record in ``arrays`` replaces ``saved`` and is returned
    as the new saved state unless the action saves another (a resumed client keeps it). The method's
    rule runs to its end here, its local runs one after another on this client. This is what an
    honest client replies (the server's evaluation audit, :mod:`pflalign.round.features.audit`,
    calls it so); the engines wrap it with the run's fault injection
    (:mod:`pflalign.engines.faults`)."""
    call = begin(action, settings, client_id, config, arrays, saved, node)
    if not isinstance(call, Call):
        return call
    server_round = call.received.server_round
    return finish(call, complete(call.rule(), lambda run: call.client.execute(run,
                                                                             server_round)))


def handle_aside(action: str, settings: Settings, client_id: int,
                 config: Mapping[str, Value], arrays: Mapping[str, Mapping[str, torch.Tensor]],
                 saved: State | None, node: NodeData | None = None,
                 ) -> tuple[Metrics, ReplyArrays, State | None]:
    """:func:`handle`, run beside this process's own work (the server's audits, FLTrust's root
    set, a colluding attacker recomputing another's update): torch's random state and thread
    count are left as they were."""
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):
            return handle(action, settings, client_id, config, arrays, saved, node=node)
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def begin(action: str, settings: Settings, client_id: int, config: Mapping[str, Value],
          arrays: Mapping[str, Mapping[str, torch.Tensor]], saved: State | None,
          node: NodeData | None = None,
          ) -> Call | tuple[Metrics, ReplyArrays, State | None]:
    """Everything :func:`handle` does before the method's rule runs: the :class:`Call`, or,
    for an action that runs no rule (a state query, an annealing round), its reply."""
    if action == STATE:  # a round's SecAgg+ secrets never leave the client
        return ({PARTITION_ID: client_id},
                {CLIENT_STATE: {k: torch.from_numpy(np.array(v, order="C", copy=True))
                                for k, v in (secagg_client.split_saved(saved)[0] or {}).items()}},
                None)
    if action == QUERY and config.get(ACTION) in secagg_client.ACTIONS:
        metrics, reply, kept = secagg_client.stage(client_id, config, arrays, saved)
        return {PARTITION_ID: client_id, **metrics}, reply, kept
    saved, held = secagg_client.split_saved(saved)  # the round's SecAgg+ secrets, if any
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
    client = ClientRuntime(settings, client_id, device, node)
    if action == QUERY:
        if config.get(ACTION) != GGA_ACTION:
            raise ValueError(f"Unknown query action {config.get(ACTION)!r}.")
        metrics, reply = client_answer(client, received, settings.gga)
        return {PARTITION_ID: client_id, **metrics}, reply, restored
    if action not in (TRAIN, EVALUATE):
        raise ValueError(f"Unknown action {action!r}.")
    state = method.ClientState.from_arrays(saved or {})
    return Call(action, method, client, received, state, saved, restored, started, held)


def finish(call: Call, result: object) -> tuple[Metrics, ReplyArrays, State | None]:
    """The reply and the state to keep from a :class:`Call`'s rule result; its metrics end with
    the process metrics of the process that ran the rule (:func:`evaluation_reply`,
    :func:`train_reply`)."""
    client_id = call.client.client_id
    if call.action == EVALUATE:
        reply: ReplyArrays = {}
        if call.received.config.get(SAVE_SCORED) and call.client.scored is not None:
            scored = scored_arrays(call.method, call.client)
            reply = {SCORED: scored} if scored is not None else {}
        return evaluation_reply(client_id, result), reply, call.restored  # type: ignore[arg-type]
    upload, new_state = result  # type: ignore[misc]
    kept = state_to_keep(new_state, call.restored)
    upload = counted(upload, call.client.data.num_train)
    if call.client.run.dp == "local":
        upload = privatized(upload, call.received, call.client.run, client_id)
    metrics, reply = train_reply(client_id, upload, call.saved, kept,
                                 time.perf_counter() - call.started)
    if call.held:  # the round's SecAgg+ secrets stay with the state until it unmasks (the
        # masking itself comes after any fault injection: secagg_client.with_secure_upload)
        kept = {**(kept if kept is not None else (call.saved or {})), **call.held}
    return metrics, reply, kept


@cached(maxsize=8)
def saved_keys(method: Method, template: ModelTemplate, num_classes: int) -> tuple[str, ...]:
    """The entries of a saved client model of ``method`` on ``template``'s model
    (:meth:`~pflalign.methods.base.Method.saved_keys`), once per process."""
    return method.saved_keys(template.new(), num_classes)


def scored_arrays(method: Method, client: ClientRuntime) -> dict[str, torch.Tensor] | None:
    """The model that scored ``client`` in its latest evaluation (:attr:`ClientRuntime.scored`),
    as the entries a saved client model holds; None when it is not of the method's
    :meth:`~pflalign.methods.base.Method.scored_module` (the server then says the client's model
    is not saved: its metrics stand)."""
    scored = client.scored
    state = scored.state_dict() if isinstance(scored, torch.nn.Module) else scored
    keys = saved_keys(method, client.template, client.num_classes)
    if any(k not in state for k in keys):  # type: ignore[operator]
        return None
    return {k: state[k].detach() for k in keys}  # type: ignore[index]


def privatized(upload: Upload, received: Received, run: RunConfig, client_id: int) -> Upload:
    """``dp = local``: the upload as it leaves the client, its model's update over the model it
    received clipped to ``dp-clip`` and noised with ``dp-noise-multiplier x dp-clip``
    (:func:`~pflalign.training.privacy.local_release`), from the client's own generator for the
    round (the same on every engine). Nothing else of the upload may leave: a method that
    uploads other records cannot run under dp (:attr:`~pflalign.methods.base.Method.private`)."""
    if upload.model is None:
        return upload
    # dp-secure: the client's own key from the operating system, which nobody else can know
    rng = (np.random.default_rng() if run.dp_secure
           else noise_rng(run.seed, received.server_round, LOCAL_NOISE_STREAM, client_id))
    std = run_noise_multiplier(run) * run.dp_clip
    model = {k: v.detach().cpu().numpy() for k, v in upload.model.items()}
    base = {k: v.detach().cpu().numpy() for k, v in (received.model or {}).items()}
    released = local_release(model, base, run.dp_clip, std, rng)
    return replace(upload, model={k: torch.from_numpy(np.ascontiguousarray(v))
                                  for k, v in released.items()})


def state_to_keep(new_state: ArrayState, fallback: State | None) -> State | None:
    """The flat state a client saves after training: ``new_state``'s arrays, or ``fallback``
    when any of its floats is not finite (never save a broken state)."""
    kept = new_state.to_arrays()
    if not all(np.isfinite(v).all() for v in kept.values() if np.asarray(v).dtype.kind == "f"):
        return fallback
    return kept


def counted(upload: Upload, num_train: int) -> Upload:
    """``upload`` with the client's training-sample count first among its metrics."""
    return replace(upload, metrics={NUM_EXAMPLES: num_train, **upload.metrics})


def evaluation_reply(client_id: int, scores: Mapping[str, float | int]) -> Metrics:
    """An evaluation reply's metrics: the client's id, its rule's ``scores`` and this process's
    metrics (:func:`~pflalign.wire.protocol.process_metrics`)."""
    return {PARTITION_ID: client_id, **scores, **process_metrics()}


def train_reply(client_id: int, upload: Upload, saved: State | None, kept: State | None,
                seconds: float) -> tuple[Metrics, ReplyArrays]:
    """A training reply's metrics and array records (the model first) from a client's upload,
    the state it had (``saved``) and the state it keeps (``kept``; None: ``saved``); the
    metrics end with this process's (:func:`~pflalign.wire.protocol.process_metrics`)."""
    metrics = {PARTITION_ID: client_id, **upload.metrics,
               HAD_STATE: int(bool(saved)), KEPT_STATE: int(bool(saved if kept is None else kept)),
               CLIENT_SECONDS: seconds, **process_metrics()}
    reply = dict(upload.arrays)
    if upload.model is not None:
        reply = {MODEL: upload.model, **reply}
    return metrics, reply
