"""The server half every method shares: discovery, sampling, messages, validation, metrics.

A method's strategy subclasses :class:`PFLStrategy` and overrides only what differs: which
records a client receives (:meth:`train_records`, :meth:`eval_records`, :meth:`train_config`),
whether clients upload a model (:attr:`uploads_model`), and how updates are combined
(:meth:`aggregate`).

Clients are identified by the stable ``partition-id`` each node reports in a QUERY round at start
(never by Flower's random node ids). Replies are processed in client-id order, so aggregation is
deterministic whatever order Ray returns them in.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

import strategies  # noqa: F401  (sets the Flower environment before flwr is imported)
from pflalign.aggregation import FlatSpec, State, fedavg, mean_cosine
from pflalign.config import Settings
from pflalign.federation import federated_dataset
from pflalign.methods import MethodSpec
from pflalign.metrics import accuracy_summary
from pflalign.models import build_model
from pflalign.results import Reporter, round_line
from pflalign.sampling import sample_clients
from strategies.annealing import AnnealedWarmStart

ARRAYS, CONFIG, RUN_CONFIG, METRICS = "arrays", "config", "run-config", "metrics"


@dataclass(frozen=True)
class ClientInfo:
    """A client as discovered at start: its stable id, its node, and its split sizes."""

    id: int
    node_id: int
    num_train: int
    num_test: int
    unseen: bool


@dataclass
class Update:
    """A validated training reply."""

    client: int
    num_examples: float
    metrics: dict[str, float]
    state: State | None
    #: further validated array records of the reply (e.g. SCAFFOLD's control-variate change)
    records: dict[str, State] = field(default_factory=dict)


def to_state(record: ArrayRecord) -> State:
    return {key: array.numpy() for key, array in record.items()}


def to_record(state: Mapping[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({key: Array(np.ascontiguousarray(value)) for key, value in state.items()})


def payload_bytes(content: RecordDict) -> int:
    """Bytes of array payload in a message (what dominates traffic: the model tensors)."""
    return sum(len(array.data) for record in content.array_records.values()
               for array in record.values())


class ClientFailure(Exception):
    """A reply that cannot be used; the message says which client and why."""


class PFLStrategy(Strategy):
    """Base strategy: FedAvg's behaviour, with hooks for personalized methods."""

    uploads_model = True
    #: client metrics averaged over the round's clients into the round's row
    client_diagnostics: tuple[str, ...] = ()

    def __init__(self, settings: Settings, spec: MethodSpec, initial_state: State,
                 reporter: Reporter | None = None, timeout: float = 3600.0,
                 discovery_timeout: float = 120.0, trainable: tuple[str, ...] | None = None,
                 label: str | None = None):
        self.settings = settings
        self.label = label or spec.name
        self.trainable = trainable if trainable is not None else tuple(
            k for k, v in initial_state.items() if np.asarray(v).dtype.kind == "f")
        self.discovery_timeout = discovery_timeout
        self.spec = spec
        self.reporter = reporter or Reporter()
        self.timeout = timeout
        self.global_state: State = initial_state
        self.shared = tuple(k for k in initial_state if k not in set(self.personal_keys()))
        #: the exchanged part of the model: what is sent, uploaded, validated and averaged
        self.flat = FlatSpec.of({k: initial_state[k] for k in self.shared})
        #: further array records each training reply must carry, with their specs
        self.reply_records: dict[str, FlatSpec] = {}
        self.clients: dict[int, ClientInfo] = {}
        self.node_to_client: dict[int, int] = {}
        self.rounds: list[dict] = []
        self.client_results: list[dict] = []
        self._run_config = ConfigRecord(settings.to_dict())
        self._global_record: ArrayRecord | None = None

    # --- Flower Strategy interface -------------------------------------------------------------
    def summary(self) -> None:
        s = self.settings
        self.reporter.info(
            f"[{self.label}] {s['rounds']} rounds, {s['num-clients']} clients "
            f"(+{s['num-unseen-clients']} unseen), fraction-train {s['fraction-train']}, "
            f"model {s['model']} ({self.flat.size:,} values)")

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        return [self._message(cid, self.train_records(cid), MessageType.TRAIN, server_round,
                              self.train_config(cid, server_round))
                for cid in self.largest_first(self.sample(server_round))]

    def aggregate_train(self, server_round: int, replies: Iterable[Message],
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        updates, failures = self._collect(replies, expect_arrays=self.uploads_model,
                                          required=("num-examples",))
        train_updates = [Update(client=int(m["partition-id"]), num_examples=m["num-examples"],
                                metrics=m, state=state[ARRAYS] if state else None,
                                records={k: v for k, v in (state or {}).items() if k != ARRAYS})
                         for m, state in updates]
        metrics: dict[str, float] = {"clients-trained": len(train_updates), "failures": failures}
        if train_updates:
            previous = self.global_state
            new_state = self.aggregate(server_round, train_updates)
            if new_state is not None:
                metrics["update-cosine"] = self.update_cosine(previous, new_state, train_updates)
                self.global_state = {**self.global_state, **new_state}
                self._global_record = None
            for key in self.client_diagnostics:
                values = [u.metrics[key] for u in train_updates if key in u.metrics]
                if values:
                    metrics[key] = float(np.mean(values))
            weights = [u.num_examples for u in train_updates]
            metrics["client-seconds"] = float(sum(u.metrics.get("client-seconds", 0.0)
                                                  for u in train_updates))
            if all("train-loss" in u.metrics for u in train_updates):
                metrics["train-loss"] = float(np.average(
                    [u.metrics["train-loss"] for u in train_updates], weights=weights))
        else:
            self.reporter.warn(f"[{self.label}] round {server_round}: no usable training "
                               "reply; the global model is kept unchanged.")
        return self.global_record(), MetricRecord(metrics)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return [self._message(cid, self.eval_records(cid), MessageType.EVALUATE, server_round)
                for cid in self.largest_first(self.eval_clients())]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message],
                           ) -> MetricRecord | None:
        rows, failures = self._collect(replies, expect_arrays=False,
                                       required=("num-test", "personal-correct", "personal-loss"))
        info = {int(m["partition-id"]): self.clients[int(m["partition-id"])] for m, _ in rows}
        seen = [m for m, _ in rows if not info[int(m["partition-id"])].unseen]
        unseen = [m for m, _ in rows if info[int(m["partition-id"])].unseen]
        metrics: dict[str, float] = {"eval-failures": failures}
        if seen:
            metrics.update(accuracy_summary([m["personal-correct"] for m in seen],
                                            [m["num-test"] for m in seen]))
            metrics["personal-loss"] = float(np.average(
                [m["personal-loss"] for m in seen], weights=[m["num-test"] for m in seen]))
            tested = sum(m["num-test"] for m in seen)
            if self.spec.has_global_model and all("global-correct" in m for m in seen):
                metrics["global-acc"] = sum(m["global-correct"] for m in seen) / tested
            if all("next-correct" in m for m in seen):
                metrics["personal-acc-next"] = sum(m["next-correct"] for m in seen) / tested
        if unseen:
            metrics["unseen-acc"] = (sum(m["personal-correct"] for m in unseen)
                                     / sum(m["num-test"] for m in unseen))
        self.client_results = [
            {"id": cid, "unseen": info[cid].unseen, "num-train": info[cid].num_train,
             "num-test": int(m["num-test"]), "personal-acc": m["personal-correct"] / m["num-test"]}
            for m, _ in rows for cid in [int(m["partition-id"])]]
        return MetricRecord(metrics)

    # --- hooks for methods ---------------------------------------------------------------------
    def train_records(self, client: int) -> dict[str, ArrayRecord]:
        """Array records sent to ``client`` for training (default: the global model)."""
        return {ARRAYS: self.global_record()}

    def eval_records(self, client: int) -> dict[str, ArrayRecord]:
        """Array records sent to ``client`` for evaluation (default: the global model)."""
        return {ARRAYS: self.global_record()}

    def train_config(self, client: int, server_round: int) -> dict[str, bool | int | float]:
        """Extra per-client entries of the training message's config (default: none)."""
        return {}

    def eval_clients(self) -> list[int]:
        """Clients evaluated (default: every client, unseen ones included)."""
        return sorted(self.clients)

    def personal_keys(self) -> tuple[str, ...]:
        """Model entries that stay on the clients: never sent, uploaded or averaged (default:
        none). Called once, at construction."""
        return ()

    def template_model(self) -> torch.nn.Module:
        """A freshly built model of this run (for looking up its layers, not for training)."""
        dataset = federated_dataset(self.settings).dataset
        return build_model(str(self.settings["model"]), dataset.input_shape, dataset.num_classes)

    def aggregate(self, server_round: int, updates: list[Update]) -> State | None:
        """The new global state of the shared entries from validated updates (default: FedAvg
        by num-examples)."""
        return fedavg([u.state for u in updates], [u.num_examples for u in updates], self.flat)

    # --- shared machinery ----------------------------------------------------------------------
    def global_record(self) -> ArrayRecord:
        if self._global_record is None:
            self._global_record = to_record({k: self.global_state[k] for k in self.shared})
        return self._global_record

    def sample(self, server_round: int) -> list[int]:
        """This round's training clients: reproducible from (seed, round), same for all methods."""
        return sample_clients((cid for cid, info in self.clients.items() if not info.unseen),
                              float(self.settings["fraction-train"]), int(self.settings["seed"]),
                              server_round)

    def largest_first(self, clients: Iterable[int]) -> list[int]:
        """Clients in decreasing order of data size: the simulation hands messages to free workers
        in order, so sending the longest jobs first keeps workers evenly busy (LPT scheduling)."""
        return sorted(clients, key=lambda c: (-self.clients[c].num_train - self.clients[c].num_test,
                                              c))

    def update_cosine(self, previous: State, new: State, updates: list[Update]) -> float:
        """Mean cosine between each client's update and the aggregated update (trainable
        entries), a measure of how much aggregation agrees with the clients' directions."""
        spec = FlatSpec.of({k: previous[k] for k in self.trainable if k in new})
        base = spec.flatten(previous, np.float64)
        return mean_cosine([spec.flatten(u.state, np.float64) - base for u in updates
                            if u.state is not None], spec.flatten(new, np.float64) - base)

    def _message(self, client: int, records: dict[str, ArrayRecord], message_type: str,
                 server_round: int, extra_config: dict | None = None) -> Message:
        content = RecordDict({
            CONFIG: ConfigRecord({"method": self.spec.name, "label": self.label,
                                  "server-round": server_round, **(extra_config or {})}),
            RUN_CONFIG: self._run_config, **records})
        return Message(content=content, dst_node_id=self.clients[client].node_id,
                       message_type=message_type)

    def _describe(self, msg: Message) -> str:
        node = msg.metadata.src_node_id
        cid = self.node_to_client.get(node)
        return f"client {cid}" if cid is not None else f"node {node}"

    def _validate(self, msg: Message, expect_arrays: bool, required: tuple[str, ...],
                  ) -> tuple[dict[str, float], dict[str, State] | None]:
        who = self._describe(msg)
        if msg.has_error():
            raise ClientFailure(f"{who} failed: {msg.error.reason}")
        record = msg.content.metric_records.get(METRICS)
        if record is None:
            raise ClientFailure(f"{who} replied without a '{METRICS}' MetricRecord")
        metrics = dict(record)
        for key in ("partition-id", *required):
            if key not in metrics:
                raise ClientFailure(f"{who} replied without the metric '{key}'")
        for key, value in metrics.items():
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise ClientFailure(f"{who} reported a non-finite or non-scalar '{key}': {value!r}")
        if self.node_to_client.get(msg.metadata.src_node_id) != int(metrics["partition-id"]):
            raise ClientFailure(f"{who} reported partition-id {metrics['partition-id']}, which "
                                "is not the id it was discovered with")
        for key in required:
            if key.startswith("num-") and metrics[key] <= 0:
                raise ClientFailure(f"{who} reported {key} = {metrics[key]}, expected > 0")
        for key in ("personal-correct", "global-correct", "next-correct"):
            if key in metrics and not 0 <= metrics[key] <= metrics.get("num-test", 0):
                raise ClientFailure(f"{who} reported {key} = {metrics[key]} for "
                                    f"{metrics.get('num-test')} test samples")
        if not expect_arrays:
            return metrics, None
        records: dict[str, State] = {}
        for name, spec in {ARRAYS: self.flat, **self.reply_records}.items():
            arrays = msg.content.array_records.get(name)
            if arrays is None:
                what = "its model arrays" if name == ARRAYS else f"the array record '{name}'"
                raise ClientFailure(f"{who} replied without {what}")
            records[name] = to_state(arrays)
            problem = spec.problem_with(records[name])
            if problem:
                what = "update" if name == ARRAYS else f"'{name}' record"
                raise ClientFailure(f"{who}'s {what} was rejected: {problem}")
        return metrics, records

    def _collect(self, replies: Iterable[Message], expect_arrays: bool,
                 required: tuple[str, ...],
                 ) -> tuple[list[tuple[dict, dict[str, State] | None]], int]:
        """Validated (metrics, array records) pairs sorted by client id, and the number of
        failures."""
        good, failures = [], 0
        for msg in replies:
            try:
                good.append(self._validate(msg, expect_arrays, required))
            except ClientFailure as failure:
                failures += 1
                self.reporter.warn(f"[{self.label}] {failure}; the reply is skipped.")
        good.sort(key=lambda pair: int(pair[0]["partition-id"]))
        return good, failures

    def discover(self, grid: Grid) -> None:
        """Wait for the nodes, then ask each for its partition-id and split sizes (QUERY).

        Nodes whose partition-id is outside this run (more SuperNodes than clients) are left idle
        with a warning; a missing or duplicated id is an error naming the fix.
        """
        expected = self.settings.num_nodes
        started = time.monotonic()
        next_notice = started
        while len(node_ids := sorted(grid.get_node_ids())) < expected:
            waited = time.monotonic() - started
            if waited > self.discovery_timeout:
                raise RuntimeError(
                    f"Only {len(node_ids)} of {expected} nodes connected within "
                    f"{self.discovery_timeout:.0f}s. This run needs num-clients + "
                    f"num-unseen-clients = {expected} SuperNodes: with `flwr run`, pass "
                    f"--federation-config \"num-supernodes={expected}\"; in a deployment, "
                    "start the missing SuperNodes.")
            if time.monotonic() >= next_notice:
                self.reporter.info(f"Waiting for nodes: {len(node_ids)} of {expected} connected")
                next_notice += 15.0
            time.sleep(0.5)
        content = RecordDict({RUN_CONFIG: self._run_config})
        messages = [Message(content=content, dst_node_id=node, message_type=MessageType.QUERY)
                    for node in node_ids]
        clients: dict[int, ClientInfo] = {}
        for msg in grid.send_and_receive(messages, timeout=self.timeout):
            if msg.has_error():
                self.reporter.warn(f"Node {msg.metadata.src_node_id} is not used: "
                                   f"{msg.error.reason}")
                continue
            m = msg.content.metric_records[METRICS]
            cid = int(m["partition-id"])
            if cid in clients:
                raise RuntimeError(f"Two nodes report partition-id {cid}; every SuperNode needs "
                                   "its own partition-id.")
            clients[cid] = ClientInfo(id=cid, node_id=msg.metadata.src_node_id,
                                      num_train=int(m["num-train"]), num_test=int(m["num-test"]),
                                      unseen=bool(m["unseen"]))
        missing = sorted(set(range(expected)) - set(clients))
        if missing:
            raise RuntimeError(f"No node answered for client ids {missing[:10]}; each of the "
                               f"{expected} SuperNodes needs a distinct partition-id "
                               f"0..{expected - 1}.")
        self.clients = clients
        self.node_to_client = {info.node_id: cid for cid, info in clients.items()}

    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None,  # type: ignore[override]
              num_rounds: int | None = None, timeout: float | None = None, **_: object) -> dict:
        """Run all rounds; return ``{"rounds": [...], "final": {...}, "clients": [...]}``."""
        if timeout is not None:
            self.timeout = timeout
        if initial_arrays is not None:
            self.global_state = to_state(initial_arrays)
            self._global_record = None
        rounds = int(num_rounds or self.settings["rounds"])
        every = int(self.settings["eval-every"])
        self.summary()
        self.discover(grid)
        warm_start = AnnealedWarmStart(self) if self.settings["gga"] else None
        last_eval: dict[str, float] = {}
        for server_round in range(1, rounds + 1):
            started = time.perf_counter()
            row: dict = {"round": server_round}
            down = up = 0
            if warm_start is not None and warm_start.active(server_round):
                row.update(warm_start.run(server_round, grid))
                down, up = int(row["gga-bytes-down"]), int(row["gga-bytes-up"])
            messages = list(self.configure_train(server_round, self.global_record(),
                                                 ConfigRecord(), grid))
            down += sum(payload_bytes(m.content) for m in messages)
            replies = list(grid.send_and_receive(messages, timeout=self.timeout))
            up += sum(payload_bytes(m.content) for m in replies if not m.has_error())
            _, train_metrics = self.aggregate_train(server_round, replies)
            row.update(train_metrics or {})
            row["train-seconds"] = time.perf_counter() - started
            row.update(self.round_diagnostics(server_round))
            if server_round % every == 0 or server_round == rounds:
                eval_started = time.perf_counter()
                messages = list(self.configure_evaluate(server_round, self.global_record(),
                                                        ConfigRecord(), grid))
                down += sum(payload_bytes(m.content) for m in messages)
                replies = list(grid.send_and_receive(messages, timeout=self.timeout))
                up += sum(payload_bytes(m.content) for m in replies if not m.has_error())
                last_eval = dict(self.aggregate_evaluate(server_round, replies) or {})
                row.update(last_eval)
                row["eval-seconds"] = time.perf_counter() - eval_started
            row.update({"round-seconds": time.perf_counter() - started,
                        "bytes-up": up, "bytes-down": down})
            self.rounds.append(row)
            self.reporter.info(round_line(self.label, row, rounds))
        return {"rounds": self.rounds, "final": self.final_metrics(last_eval),
                "clients": self.client_results}

    def round_diagnostics(self, server_round: int) -> dict[str, float]:
        """Extra per-round metrics a method wants recorded (default: none)."""
        return {}

    def final_metrics(self, last_eval: Mapping[str, float]) -> dict[str, float]:
        seconds = [r["round-seconds"] for r in self.rounds]
        final = dict(last_eval)
        if self.rounds and "train-loss" in self.rounds[-1]:
            final["train-loss"] = self.rounds[-1]["train-loss"]
        final.update({
            "rounds": len(self.rounds),
            "seconds-per-round": float(np.mean(seconds)) if seconds else 0.0,
            "total-seconds": float(np.sum(seconds)),
            "bytes-up": int(sum(r["bytes-up"] for r in self.rounds)),
            "bytes-down": int(sum(r["bytes-down"] for r in self.rounds)),
        })
        return final
