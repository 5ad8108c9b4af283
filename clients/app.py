"""The ClientApp: one Flower client serving every registered method.

Every message carries the run's settings (``run-config``) and ``config`` with ``method`` and
``server-round``; the client's stable id is ``partition-id`` from ``context.node_config`` (never
Flower's random node id).
"""

from __future__ import annotations

import time
from functools import lru_cache

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

import clients  # noqa: F401  (sets the Flower environment before flwr is imported)
from clients.base import ClientMethod, ClientState, RoundInput
from pflalign.config import Settings
from pflalign.federation import federated_dataset
from pflalign.methods import METHODS
from pflalign.train import configure_threads, pick_device

ARRAYS, CONFIG, RUN_CONFIG, METRICS = "arrays", "config", "run-config", "metrics"

app = ClientApp()


@lru_cache(maxsize=8)
def _settings(items: tuple) -> Settings:
    return Settings(dict(items), source="the server's run-config")


def settings_of(msg: Message) -> Settings:
    return _settings(tuple(sorted(msg.content.config_records[RUN_CONFIG].items())))


def client_id_of(context: Context) -> int:
    if "partition-id" not in context.node_config:
        raise ValueError("This SuperNode has no 'partition-id' in its node config; start it with "
                         "--node-config \"partition-id=<i> num-partitions=<n>\".")
    return int(context.node_config["partition-id"])


def _build(msg: Message, context: Context) -> tuple[ClientMethod, RoundInput]:
    settings = settings_of(msg)
    config: ConfigRecord = msg.content.config_records[CONFIG]
    spec = METHODS[str(config["method"])]
    configure_threads(float(settings["client-resources-num-cpus"]))
    device = pick_device(float(settings["client-resources-num-gpus"]))
    state = ClientState(context.state, str(config.get("label", spec.name)))
    method = spec.load_client()(settings, client_id_of(context), state, device)
    records = {name: record.to_torch_state_dict()
               for name, record in msg.content.array_records.items() if len(record)}
    return method, RoundInput(int(config["server-round"]), records, dict(config))


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Report this node's stable client id and split sizes (the server's client discovery), or,
    when the config asks for ``action = gga``, answer an annealing round."""
    if CONFIG in msg.content.config_records:
        method, inputs = _build(msg, context)
        if inputs.config.get("action") != "gga":
            raise ValueError(f"Unknown query action {inputs.config.get('action')!r}.")
        losses, sketches = method.gga_statistics(inputs)
        metrics = MetricRecord({"partition-id": method.client_id,
                                "num-examples": method.data.num_train,
                                **{f"gga-loss-{k}": v for k, v in enumerate(losses)}})
        return Message(RecordDict({METRICS: metrics, "sketch": ArrayRecord(
            {"sketch": sketches})}), reply_to=msg)
    cid = client_id_of(context)
    partition = federated_dataset(settings_of(msg)).partition
    if cid >= partition.num_clients:
        raise ValueError(f"partition-id {cid} is outside this run's {partition.num_clients} "
                         "clients (num-clients + num-unseen-clients).")
    metrics = MetricRecord({"partition-id": cid, "num-train": len(partition.train[cid]),
                            "num-test": len(partition.test[cid]),
                            "unseen": int(partition.is_unseen(cid))})
    return Message(RecordDict({METRICS: metrics}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    started = time.perf_counter()
    method, inputs = _build(msg, context)
    result = method.fit(inputs)
    metrics = MetricRecord({"partition-id": method.client_id,
                            "num-examples": method.data.num_train, **result.metrics,
                            "client-seconds": time.perf_counter() - started})
    content = RecordDict({METRICS: metrics})
    if result.state is not None:
        content[ARRAYS] = ArrayRecord({k: v.detach().cpu() for k, v in result.state.items()})
    for name, record in result.records.items():
        content[name] = ArrayRecord({k: v.detach().cpu() for k, v in record.items()})
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    method, inputs = _build(msg, context)
    metrics = method.evaluate(inputs)
    metrics = MetricRecord({"partition-id": method.client_id, **metrics})
    return Message(RecordDict({METRICS: metrics}), reply_to=msg)
