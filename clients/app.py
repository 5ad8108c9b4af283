"""The Flower ClientApp: one client serving every registered method, routed by action.

Each message carries the run's settings (``run-config``, parsed once per process and run) and
``config`` with the method, its label and the round; the client's stable id is ``partition-id``
from ``context.node_config`` (never Flower's random node id). The method's client rule runs in
:func:`pflalign.engines.host.handle`; its state lives in the node's ``context.state`` as one
ArrayRecord named by the method entry's label (a client serving a new method drops what earlier
methods left behind: less to carry per message).
"""

from __future__ import annotations

from functools import lru_cache

from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from pflalign.config import Settings
from pflalign.engines.host import discovery, handle
from pflalign.protocol import CONFIG, EVALUATE, LABEL, METRICS, QUERY, RUN_CONFIG, TRAIN

app = ClientApp()


@lru_cache(maxsize=8)
def _settings(items: tuple) -> Settings:
    return Settings(dict(items), source="the server's run-config")


def settings_of(msg: Message) -> Settings:
    """The run's settings from the message, parsed once per process and run."""
    return _settings(tuple(sorted(msg.content.config_records[RUN_CONFIG].items())))


def client_id_of(context: Context) -> int:
    if "partition-id" not in context.node_config:
        raise ValueError("This SuperNode has no 'partition-id' in its node config; start it with "
                         "--node-config \"partition-id=<i> num-partitions=<n>\".")
    return int(context.node_config["partition-id"])


def _reply(msg: Message, context: Context, action: str) -> Message:
    config = dict(msg.content.config_records[CONFIG])
    label = str(config[LABEL])
    for key in [k for k in context.state if k != label]:
        del context.state[key]
    record = context.state.array_records.get(label)
    saved = {k: a.numpy() for k, a in record.items()} if record is not None else None
    arrays = {name: record.to_torch_state_dict()
              for name, record in msg.content.array_records.items() if len(record)}
    metrics, reply_arrays, state = handle(action, settings_of(msg), client_id_of(context),
                                          config, arrays, saved)
    if state is not None:
        context.state[label] = ArrayRecord({k: Array(v) for k, v in state.items()})
    content = RecordDict({METRICS: MetricRecord(metrics)})
    for name, values in reply_arrays.items():
        content[name] = ArrayRecord({k: v.detach().cpu() for k, v in values.items()})
    return Message(content, reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Discovery (this node's stable client id and split sizes), or, when the config names an
    action, that action (an annealing round of GGA's warm start)."""
    if CONFIG in msg.content.config_records:
        return _reply(msg, context, QUERY)
    metrics = discovery(settings_of(msg), client_id_of(context))
    return Message(RecordDict({METRICS: MetricRecord(metrics)}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _reply(msg, context, TRAIN)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _reply(msg, context, EVALUATE)
