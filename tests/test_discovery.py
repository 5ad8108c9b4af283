"""Discovery survives bad nodes: the Flower engine's discovery over a small in-memory stand-in
for Flower's Grid (push and pull, replies matched to messages as the real Grid matches them).
Two nodes claiming one partition-id are both left out for it and named; a silent node is left
out and named; the run goes on with the rest, unless fewer than ``min-clients`` remain."""

from __future__ import annotations

import uuid

import pytest
from conftest import needs_fashion_mnist
from flwr.app import Message, MetricRecord, RecordDict

from pflalign.data.federated import federated_dataset
from pflalign.outputs.results import Reporter
from pflalign.run.config import ConfigError, build_settings
from pflalign.wire.protocol import METRICS, NUM_TEST, NUM_TRAIN, PARTITION_ID, UNSEEN
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


# --- partition-ids bound to SuperNode keys --------------------------------------------------
class _KeyedGrid(_Grid):
    """Nodes that answer discovery through the project's ClientApp handler, each with the node
    config ``configs[node]`` (its partition-id and, if any, its auth-key)."""

    def __init__(self, configs: dict[int, dict], settings):
        super().__init__({n: c["partition-id"] for n, c in configs.items()}, settings)
        self.configs = configs

    def push_messages(self, messages):
        from flwr.app import Context
        from flwr.supercore.task_identity import TaskIdentity

        import clients.app as project

        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            node = msg.metadata.dst_node_id
            TaskIdentity.node_id = node
            context = Context(run_id=1, node_id=node, node_config=self.configs[node],
                              state=RecordDict(), run_config={})
            self.replies[msg.metadata.message_id] = project.query(msg, context)
            ids.append(msg.metadata.message_id)
        return ids


def _keys(tmp_path, count: int):
    import subprocess

    for i in range(count):
        subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-b", "384", "-N", "", "-f",
                        str(tmp_path / f"node-{i}")], check=True, timeout=30)


def test_a_node_must_prove_it_holds_the_key_bound_to_its_partition_id(tmp_path):
    """With node-keys, a node claiming another's id with its own key, and a node that gives no
    proof, are left out and named; the honest holder of the id keeps it (no duplicate claim)."""
    from pflalign.wire.binding import write_bindings

    _keys(tmp_path, 4)
    bindings = write_bindings(tmp_path / "node-keys.json", tmp_path, [0, 1, 2, 3])
    configs = {100: {"partition-id": 0, "auth-key": str(tmp_path / "node-0")},
               101: {"partition-id": 1},  # no auth-key: no proof
               102: {"partition-id": 2, "auth-key": str(tmp_path / "node-2")},
               103: {"partition-id": 0, "auth-key": str(tmp_path / "node-3")}}  # an impostor
    settings = build_settings({**SETTINGS, "node-keys": str(bindings)})
    warnings: list[str] = []
    reporter = Reporter(quiet=True)
    reporter.warn = warnings.append
    engine = FlowerEngine(_KeyedGrid(configs, settings), settings, reporter, timeout=5,
                          discovery_timeout=5)
    assert sorted(engine.discover()) == [0, 2]
    assert engine.node_of == {0: 100, 2: 102}
    assert ("Node 103 is not used for partition-id 0: its proof does not verify against the key "
            "bound to partition-id 0 (it holds another key).") in warnings
    assert ("Node 101 is not used for partition-id 1: it gave no proof that it holds the key "
            "bound to partition-id 1 (its node config needs auth-key = its SuperNode private "
            "key).") in warnings
    assert not [w for w in warnings if "all report partition-id" in w]
    # without node-keys the same nodes are self-declared: the impostor knocks client 0 out
    plain = build_settings(SETTINGS)
    engine = FlowerEngine(_KeyedGrid(configs, plain), plain, Reporter(quiet=True), timeout=5,
                          discovery_timeout=5)
    assert sorted(engine.discover()) == [1, 2]


def test_a_proof_is_bound_to_the_challenge_and_the_id(tmp_path):
    from pflalign.wire.binding import (
        new_challenge,
        proof_problem,
        read_bindings,
        sign,
        write_bindings,
    )

    _keys(tmp_path, 2)
    bindings = read_bindings(write_bindings(tmp_path / "b.json", tmp_path, [0, 1]))
    challenge = new_challenge()
    proof = sign(tmp_path / "node-0", challenge, 0)
    assert proof_problem(bindings, 0, challenge, proof) is None
    assert "does not verify" in proof_problem(bindings, 0, new_challenge(), proof)  # replayed
    assert "does not verify" in proof_problem(bindings, 1, challenge, proof)  # another id
    assert "no key is bound to partition-id 5" in proof_problem(bindings, 5, challenge, proof)
    (tmp_path / "node-1.pub").write_text("not a key")
    with pytest.raises(ConfigError, match="is not an OpenSSH public key"):
        write_bindings(tmp_path / "c.json", tmp_path, [1])
