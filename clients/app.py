"""The Flower ClientApp: one client serving every registered method, routed by action.

Each message carries the run's settings (``run-config``, parsed once per process and run) and
``config`` with the method, its label and the round; the client's stable id is ``partition-id``
from ``context.node_config`` (never Flower's random node id). The method's client rule runs in
:func:`pflalign.engines.host.handle`; its state lives in the node's ``context.state`` as one
ArrayRecord named by the method entry's label (a client serving a new method drops what earlier
methods left behind: less to carry per message). For checkpoints, a ``query.state`` message asks
for that state, and a train or evaluate message carrying a ``restore-state`` record (the state
from a checkpoint, after a resume) makes the node run on it and keep it.

A deployed SuperNode may also name, in its node config (:mod:`pflalign.data.node`):

- ``data-path``: its own partition file (``python -m pflalign.run.export_partitions``); the node
  then reads only that file, never the pooled dataset, and refuses one made for another config;
- ``state-dir``: a directory where its method state is saved atomically after every training
  action and read back when ``context.state`` has none (a restarted SuperNode resumes exactly);
- ``auth-key``: its SuperNode private key (the file given to ``flower-supernode
  --auth-supernode-private-key``), with which it proves at discovery that it holds the key its
  ``partition-id`` is bound to, when the run has ``node-keys`` (:mod:`pflalign.wire.binding`);
- ``cache-dir``: where a node without ``data-path`` caches its own partition after the first
  message, and where a node keeps a float32 copy of a language model's base, so that only its
  first message loads the model's files and the later ones map the copy
  (:func:`pflalign.models.language.use_node_copies`); default: ``state-dir``, else
  ``$XDG_CACHE_HOME/pflalign`` when every message runs in a new ``flwr-clientapp`` process;
  ``cache-dir=""`` turns both off.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from functools import partial
from logging import INFO
from pathlib import Path

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.logger import log

from pflalign.data.node import (
    NodeData,
    StateStore,
    cached_node_data,
    default_cache_dir,
    file_sha256,
    node_data_from_file,
)
from pflalign.engines.faults import ClientDropout, with_faults
from pflalign.engines.host import discovery, handle
from pflalign.engines.secagg_client import with_secure_upload
from pflalign.models.language import use_node_copies
from pflalign.outputs.models import save_node_model
from pflalign.process.caches import cached
from pflalign.run.config import build_settings
from pflalign.settings.schema import Settings
from pflalign.wire.binding import CHALLENGE, PROOF, sign
from pflalign.wire.protocol import (
    CONFIG,
    EVALUATE,
    LABEL,
    METHOD,
    METRICS,
    QUERY,
    ROUND,
    RUN_CONFIG,
    SAVED_ON_NODE,
    SCORED,
    STATE,
    TRAIN,
)

app = ClientApp()


#: the client handler with the run's fault injection around it, as the other engines run it, and
#: a training reply under secure aggregation masked as it leaves
client_handler = with_secure_upload(with_faults(handle))


@cached(maxsize=8)
def _settings(items: tuple) -> Settings:
    return build_settings(dict(items), source="the server's run-config")


def settings_of(msg: Message) -> Settings:
    """The run's settings from the message, parsed once per process and run."""
    return _settings(tuple(sorted(msg.content.config_records[RUN_CONFIG].items())))


def client_id_of(context: Context) -> int:
    """The node's ``partition-id``: an integer (its range is checked against the run at
    discovery, where an id outside 0..num-clients + num-unseen-clients - 1 is refused)."""
    if "partition-id" not in context.node_config:
        raise ValueError("This SuperNode has no 'partition-id' in its node config; start it with "
                         "--node-config \"partition-id=<i> num-partitions=<n>\".")
    value = context.node_config["partition-id"]
    if isinstance(value, bool) or not isinstance(value, int | str) or not str(value).lstrip(
            "-").isdigit():
        raise ValueError(f"This SuperNode's partition-id {value!r} is not an integer; start it "
                         "with --node-config \"partition-id=<i> ...\" (i from 0).")
    return int(value)


def _one_process_per_message() -> bool:
    """Whether this ClientApp runs in a ``flwr-clientapp`` process of a deployed SuperNode
    (Flower's default subprocess isolation starts one per message)."""
    return Path(sys.argv[0]).name == "flwr-clientapp"


def node_cache_dir(node_config: dict) -> Path | None:
    """Where a node caches its own partition (when it has no ``data-path``) and its float32 copy
    of a language model's base (None: no cache)."""
    if "cache-dir" in node_config:
        value = str(node_config["cache-dir"])
        return Path(value).expanduser() if value else None
    if node_config.get("state-dir"):
        return Path(str(node_config["state-dir"])).expanduser()
    return default_cache_dir() if _one_process_per_message() else None


def node_models_dir(node_config: dict, client_id: int) -> Path | None:
    """Where a deployed node saves its own personal model (save-models): ``models-dir`` from
    its node config, else its ``state-dir`` or cache folder, in a folder of its client
    (``node-<id>``, which ``pflalign.load_model`` reads as a run's out-dir); None when it has
    none of them (a simulated node sends its model to the server instead)."""
    value = node_config.get("models-dir") or node_config.get("state-dir")
    root = Path(str(value)).expanduser() if value else node_cache_dir(node_config)
    return None if root is None else root / f"node-{int(client_id)}"


def node_data_of(context: Context, settings: Settings) -> NodeData | None:
    """This node's data: its partition file (``data-path``), its cached partition, or None
    (the pooled dataset, read and partitioned once per process: simulations)."""
    cid = client_id_of(context)
    if context.node_config.get("data-path"):
        return node_data_from_file(str(context.node_config["data-path"]), settings, cid)
    cache_dir = node_cache_dir(dict(context.node_config))
    return cached_node_data(settings, cid, cache_dir) if cache_dir is not None else None


def state_store(context: Context, settings: Settings, label: str) -> StateStore | None:
    """The node's state file for this run and method entry (None without ``state-dir``)."""
    state_dir = context.node_config.get("state-dir")
    return (StateStore(str(state_dir), context.run_id, label, settings, client_id_of(context))
            if state_dir else None)


def _report(line: str) -> None:
    log(INFO, "%s", line)


def _reply(msg: Message, context: Context, action: str,
           node_of: Callable[[Settings], NodeData | None] | None = None) -> Message:
    """The reply to one action: the method state kept in ``context.state`` (and ``state-dir``),
    the client's data from ``node_of(settings)`` (default: :func:`node_data_of`), the handler,
    the new state kept."""
    use_node_copies(node_cache_dir(dict(context.node_config)), report=_report)
    config = dict(msg.content.config_records[CONFIG])
    label = str(config[LABEL])
    for key in [k for k in context.state if k != label]:
        del context.state[key]
    record = context.state.array_records.get(label)
    saved = {k: a.numpy() for k, a in record.items()} if record is not None else None
    arrays = {name: record.to_torch_state_dict()
              for name, record in msg.content.array_records.items() if len(record)}
    settings = settings_of(msg)
    store = state_store(context, settings, label)
    if saved is None and store is not None and (loaded := store.load()) is not None:
        saved, meta = loaded
        context.state[label] = ArrayRecord({k: Array(v) for k, v in saved.items()})
        log(INFO, "pflalign: client %s resumed the state of '%s' from %s (saved after round %s, "
            "sha256 %s)", client_id_of(context), label, store.path, meta["round"],
            file_sha256(store.path))
    try:
        node = None if action == STATE else (node_of or partial(node_data_of, context))(settings)
        metrics, reply_arrays, state = client_handler(action, settings, client_id_of(context),
                                                      config, arrays, saved, node=node)
    except ClientDropout as silent:  # injected: reply only after the server stopped waiting
        deadline = msg.metadata.created_at + settings.run.round_timeout + 1.0
        time.sleep(max(0.0, min(deadline - time.time(), settings.run.round_timeout + 1.0)))
        raise RuntimeError(f"{silent} (its reply comes after round-timeout)") from None
    if state is not None:
        context.state[label] = ArrayRecord({k: Array(v) for k, v in state.items()})
        if store is not None:
            store.save(state, int(config[ROUND]))
    root = node_models_dir(dict(context.node_config), client_id_of(context))
    if SCORED in reply_arrays and node is not None and root is not None:
        # a deployed node keeps its own personal model (save-models), and says so
        path = save_node_model(root, settings, label, str(config[METHOD]), node,
                               reply_arrays[SCORED], metrics, int(config[ROUND]))
        reply_arrays = {k: v for k, v in reply_arrays.items() if k != SCORED}
        metrics = {**metrics, SAVED_ON_NODE: 1}
        log(INFO, "pflalign: client %s saved its personal model of '%s' to %s",
            client_id_of(context), label, path)
    content = RecordDict({METRICS: MetricRecord(metrics)})
    for name, values in reply_arrays.items():
        content[name] = ArrayRecord({k: v.detach().cpu() for k, v in values.items()})
    return Message(content, reply_to=msg)


def _discovery(msg: Message, context: Context,
               node_of: Callable[[Settings], NodeData | None]) -> Message:
    """This node's stable client id and split sizes, and its proof of key when asked."""
    settings = settings_of(msg)
    cid = client_id_of(context)
    content = RecordDict({METRICS: MetricRecord(discovery(settings, cid, node_of(settings)))})
    challenge = msg.content.config_records.get(CHALLENGE)
    key = context.node_config.get("auth-key")
    if challenge is not None and key:  # the server checks which key this node holds
        content[PROOF] = ConfigRecord({PROOF: sign(str(key), bytes(challenge[CHALLENGE]), cid)})
    return Message(content, reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Discovery (this node's stable client id and split sizes), or, when the config names an
    action, that action (an annealing round of GGA's warm start)."""
    if CONFIG in msg.content.config_records:
        return _reply(msg, context, QUERY)
    return _discovery(msg, context, partial(node_data_of, context))


@app.query(STATE)
def state_query(msg: Message, context: Context) -> Message:
    """This node's saved method state for the message's method entry, for a checkpoint (it
    changes nothing)."""
    return _reply(msg, context, STATE)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _reply(msg, context, TRAIN)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _reply(msg, context, EVALUATE)
