"""Discovery survives bad nodes: the Flower engine's discovery over a small in-memory stand-in
for Flower's Grid (push and pull, replies matched to messages as the real Grid matches them).
Two nodes claiming one partition-id are both left out for it and named; a silent node is left
out and named; the run goes on with the rest, unless fewer than ``min-clients`` remain."""

from __future__ import annotations

import uuid

import pytest
from conftest import needs_fashion_mnist
from flwr.app import Message, MetricRecord, RecordDict

from pflalign.config import build_settings
from pflalign.federation import federated_dataset
from pflalign.protocol import METRICS, NUM_TEST, NUM_TRAIN, PARTITION_ID, UNSEEN
from pflalign.results import Reporter
from strategies.flower import FlowerEngine

pytestmark = needs_fashion_mnist

SETTINGS = {"num-clients": 4, "max-samples": 800, "seed": 3}


@pytest.fixture(autouse=True)
def _a_run(monkeypatch):
    """Flower's messages take their run id from the process's task (a ServerApp's)."""
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


class _Grid:
    """Nodes 100 + i; ``claims[node]`` is the partition-id a node reports (None: silent)."""

    def __init__(self, claims: dict[int, int | None], settings):
        self.claims = claims
        self.federation = federated_dataset(settings)
        self.replies: dict[str, Message] = {}

    def get_node_ids(self):
        return list(self.claims)

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())  # as Flower's grids do
            cid = self.claims[msg.metadata.dst_node_id]
            if cid is not None:
                from flwr.supercore.task_identity import TaskIdentity

                TaskIdentity.node_id = msg.metadata.dst_node_id  # the node that replies
                train, test = self.federation.sizes(cid)
                reply = Message(RecordDict({METRICS: MetricRecord({
                    PARTITION_ID: cid, NUM_TRAIN: train, NUM_TEST: test, UNSEEN: 0})}),
                    reply_to=msg)
                self.replies[msg.metadata.message_id] = reply
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]


def _discover(claims, **changes):
    settings = build_settings({**SETTINGS, **changes})
    warnings: list[str] = []
    reporter = Reporter(quiet=True)
    reporter.warn = warnings.append
    engine = FlowerEngine(_Grid(claims, settings), settings, reporter, timeout=0.5,
                          discovery_timeout=0.5)
    return engine, warnings


def test_every_node_answering_with_its_own_id_is_every_client():
    engine, warnings = _discover({100: 0, 101: 1, 102: 2, 103: 3})
    assert sorted(engine.discover()) == [0, 1, 2, 3] and warnings == []
    assert engine.node_of == {0: 100, 1: 101, 2: 102, 3: 103}


def test_two_nodes_claiming_one_id_are_both_left_out_and_the_run_goes_on():
    engine, warnings = _discover({100: 0, 101: 1, 102: 2, 103: 0})
    clients = engine.discover()
    assert sorted(clients) == [1, 2]
    assert engine.node_of == {1: 101, 2: 102}
    assert ("Nodes 100, 103 all report partition-id 0; none of them is used (every SuperNode "
            "needs its own partition-id).") in warnings
    assert ("No node answered discovery for client ids [0, 3]; the run goes on with the other "
            "2 of 4 clients.") in warnings


def test_a_silent_node_is_left_out_and_named():
    engine, warnings = _discover({100: 0, 101: None, 102: 2, 103: 3})
    assert sorted(engine.discover()) == [0, 2, 3]
    assert "Node 101 is not used: it did not answer discovery within 0.5 s." in warnings


def test_too_few_clients_left_stop_the_run_in_one_sentence():
    engine, _ = _discover({100: 0, 101: None, 102: 0, 103: 3}, **{"min-clients": 2})
    with pytest.raises(RuntimeError, match=r"No node answered discovery for client ids \[0, 1, "
                                           r"2\], and the 1 clients left are fewer than "
                                           r"min-clients = 2"):
        engine.discover()
