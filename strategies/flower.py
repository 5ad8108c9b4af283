"""The Flower engine: a federation's messages as Flower Messages through a Grid.

:class:`FlowerEngine` is what :class:`~pflalign.round.loop.RoundLoop` runs on under ``flwr
run`` and ``simulate.py`` (a Flower simulation on Ray), and in a real deployment of SuperNodes. It
discovers the nodes (a QUERY for each one's stable ``partition-id`` and split sizes), turns each
outgoing payload into a Message to that client's node, and turns replies back into metrics and NumPy
state dicts. Everything else, from sampling to aggregation, is the round loop's and the method's.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from pflalign.data.federated import federated_dataset
from pflalign.engines.base import Engine
from pflalign.outputs.results import Reporter
from pflalign.process.interrupt import check_stop
from pflalign.server.validation import quote, quote_names
from pflalign.settings.schema import Settings
from pflalign.wire.binding import CHALLENGE, PROOF, new_challenge, proof_problem, read_bindings
from pflalign.wire.messages import ClientInfo, Exchange, Outgoing, Reply
from pflalign.wire.protocol import (
    ARRAYS_FACTOR,
    ARRAYS_SLACK,
    CONFIG,
    EVALUATE,
    METRICS,
    NUM_TEST,
    NUM_TRAIN,
    PARTITION_ID,
    QUERY,
    RESTORE,
    RUN_CONFIG,
    SCORED,
    STATE,
    TRAIN,
    UNSEEN,
)
from pflalign.wire.state import State

#: a checkpoint's state query is a query routed to its own ClientApp function (``query.state``)
MESSAGE_TYPES = {TRAIN: MessageType.TRAIN, EVALUATE: MessageType.EVALUATE,
                 QUERY: MessageType.QUERY, STATE: f"{MessageType.QUERY}.{STATE}"}


def to_state(record: ArrayRecord) -> State:
    return {key: array.numpy() for key, array in record.items()}


def to_record(state: Mapping[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({key: Array(np.ascontiguousarray(value)) for key, value in state.items()})


def exact_record(state: Mapping[str, np.ndarray]) -> ArrayRecord:
    """``state`` as an ArrayRecord with every shape kept (0-d arrays stay 0-d), as a ClientApp
    keeps its method state: a client's restored state is sent this way."""
    return ArrayRecord({key: Array(np.array(value, order="C", copy=True))
                        for key, value in state.items()})


def array_bytes(content: RecordDict, skip: tuple[str, ...] = ()) -> int:
    """Bytes of array payload in a message's records (those named in ``skip`` aside)."""
    return sum(len(array.data) for name, record in content.array_records.items()
               if name not in skip for array in record.values())


def message_bytes(content: RecordDict) -> int:
    """Bytes of array payload in a message (what dominates traffic: the model tensors); a
    client's restored state after a resume is not counted (no round of the run sends it), nor
    a model sent back for ``save-models`` (the run's output, not the method's traffic)."""
    return array_bytes(content, skip=(RESTORE, SCORED))


def short_reason(reason: str) -> str:
    """The gist of a Flower error reply: the client's own exception message when the reply
    wraps one (a Ray task error carries the whole remote traceback), else its first line."""
    marker = "Message: "
    if marker in reason:
        reason = reason.rsplit(marker, 1)[1]
        return reason.removesuffix("'>").strip().splitlines()[0]
    first = reason.strip().splitlines()[0] if reason.strip() else "(no reason given)"
    return first if len(first) <= 300 else first[:300] + " ..."


class FlowerEngine(Engine):
    """Reaches a run's clients as Flower SuperNodes through ``grid``."""

    #: seconds between two "waiting for clients ..." lines
    notice_every = 30.0

    def __init__(self, grid: Grid, settings: Settings, reporter: Reporter | None = None,
                 timeout: float | None = None, discovery_timeout: float | None = None):
        self.grid = grid
        self.settings = settings
        self.reporter = reporter or Reporter()
        self.timeout = settings.run.round_timeout if timeout is None else timeout
        self.discovery_timeout = (settings.run.discovery_timeout if discovery_timeout is None
                                  else discovery_timeout)
        self.run_config = ConfigRecord(settings.to_dict())
        self.node_of: dict[int, int] = {}
        #: the array bytes of the largest message sent so far (bounds a reply's size)
        self.largest_sent = 0
        #: messages submitted and not yet answered: id -> (client, reply limits, push time), and
        #: the clients whose submitted message the SuperLink refused
        self.flying: dict[str, tuple[int, Mapping[str, int] | None, float]] = {}
        self.refused: list[int] = []

    def discover(self) -> dict[int, ClientInfo]:
        """Wait for the nodes, then ask each for its partition-id and split sizes (QUERY).

        Nodes whose partition-id is outside this run (more SuperNodes than clients) are left idle
        with a warning. Nodes that claim one partition-id are all left out for it, each named,
        and a node that does not answer in time is left out and named; the run goes on with the
        clients that remain, unless fewer than ``min-clients`` do (or none that trains): then it
        stops with one sentence.
        """
        expected = self.settings.num_nodes
        started = time.monotonic()
        next_notice = started
        while len(node_ids := sorted(self.grid.get_node_ids())) < expected:
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
        content = RecordDict({RUN_CONFIG: self.run_config})
        bindings = read_bindings(self.settings.run.node_keys) if self.settings.run.node_keys \
            else None
        challenge = new_challenge()
        if bindings is not None:  # each node proves it holds the key bound to its id
            content[CHALLENGE] = ConfigRecord({CHALLENGE: challenge})
        messages = [Message(content=content, dst_node_id=node, message_type=MessageType.QUERY)
                    for node in node_ids]
        # discovery includes each node's start-up (data loading): the longer of the two limits
        limit = max(self.timeout, self.discovery_timeout)
        replies, silent = self.send(dict(zip(node_ids, messages, strict=True)), "nodes", limit)
        for node in silent:
            self.reporter.warn(f"Node {node} is not used: it did not answer discovery within "
                               f"{limit:g} s.")
        # the sizes every reply is checked against come from the server's own copy of the
        # partition, never from what a node declares (but under dataset = clients, where the
        # server holds no data and the clients' loaders are the partition)
        federation = federated_dataset(self.settings)
        partition = federation.partition
        claims: dict[int, list[tuple[int, ClientInfo]]] = {}
        for node, msg in replies.items():
            if msg.has_error():
                self.reporter.warn(f"Node {node} is not used: {short_reason(msg.error.reason)}")
                continue
            try:
                m = msg.content.metric_records[METRICS]
                cid = int(m[PARTITION_ID])
                declared = (int(m[NUM_TRAIN]), int(m[NUM_TEST]), bool(m[UNSEEN]))
            except (KeyError, TypeError, ValueError) as err:
                self.reporter.warn(f"Node {node} is not used: its discovery reply is malformed "
                                   f"({type(err).__name__}: {str(err)[:200]}).")
                continue
            if not 0 <= cid < expected:
                self.reporter.warn(f"Node {node} is not used: its partition-id {cid} is outside "
                                   f"this run's clients 0..{expected - 1}.")
                continue
            if bindings is not None:
                proof = msg.content.config_records.get(PROOF)
                problem = proof_problem(bindings, cid, challenge,
                                        proof.get(PROOF) if proof is not None else None)
                if problem:
                    self.reporter.warn(f"Node {node} is not used for partition-id {cid}: "
                                       f"{problem}.")
                    continue
            if federation.sizes_declared:  # dataset = clients: the clients' own
                if declared[0] < 0 or declared[1] < 0 or declared[2] != partition.is_unseen(cid):
                    self.reporter.warn(
                        f"Node {node} is not used: it declared {declared[0]} train / "
                        f"{declared[1]} test samples (unseen: {declared[2]}) for partition-id "
                        f"{cid}, which this run cannot take.")
                    continue
                num_train, num_test = declared[0], declared[1]
            else:
                num_train, num_test = federation.sizes(cid)
            info = ClientInfo(id=cid, num_train=num_train, num_test=num_test,
                              unseen=partition.is_unseen(cid))
            if declared != (info.num_train, info.num_test, info.unseen):
                self.reporter.warn(
                    f"client {cid} (node {node}) declared {declared[0]} train / {declared[1]} "
                    f"test samples (unseen: {declared[2]}), but this run's partition gives "
                    f"{info.num_train} / {info.num_test} (unseen: {info.unseen}); its replies "
                    "are checked against the partition.")
            claims.setdefault(cid, []).append((node, info))
        clients: dict[int, ClientInfo] = {}
        nodes: dict[int, int] = {}
        for cid, claimed in sorted(claims.items()):
            if len(claimed) > 1:
                self.reporter.warn(
                    f"Nodes {', '.join(str(n) for n, _ in claimed)} all report partition-id "
                    f"{cid}; none of them is used (every SuperNode needs its own partition-id).")
                continue
            (node, info), = claimed
            clients[cid], nodes[cid] = info, node
        missing = sorted(set(range(expected)) - set(clients))
        if missing:
            shown = ", ".join(map(str, missing[:20])) + (" ..." if len(missing) > 20 else "")
            if len(clients) < self.settings.run.min_clients or not any(
                    not info.unseen for info in clients.values()):
                raise RuntimeError(
                    f"No node answered discovery for client ids [{shown}], and the "
                    f"{len(clients)} clients left are fewer than min-clients = "
                    f"{self.settings.run.min_clients} (or none of them trains); each of the "
                    f"{expected} SuperNodes needs a distinct partition-id 0..{expected - 1}.")
            self.reporter.warn(f"No node answered discovery for client ids [{shown}]; the run "
                               f"goes on with the other {len(clients)} of {expected} clients.")
        self.node_of = nodes
        return clients

    def send(self, messages: Mapping[int, Message], what: str = "clients",
             timeout: float | None = None) -> tuple[dict[int, Message], list[int]]:
        """Push one message per key (a client or node id), then pull replies until every key
        has one or ``timeout`` (default ``round-timeout``) passes, naming the keys still waited
        for every :attr:`notice_every` seconds. Returns the replies by key and the keys without one.

        Replies are matched to keys by the message they answer, never by their sender node: a
        Flower error reply for a lost node comes from the SuperLink, not from that node."""
        # one push for all (as Flower's send_and_receive does: messages share content objects,
        # which the store must hold until every node has pulled them); each message carries
        # its id once pushed, and a message the SuperLink refused has no id among those returned
        pending, unsent = self.push(messages)
        replies: dict[int, Message] = {}
        timeout = self.timeout if timeout is None else timeout
        started = time.monotonic()
        next_notice = started + self.notice_every
        while pending:
            check_stop()
            for reply in self.grid.pull_messages(list(pending)):
                key = pending.pop(reply.metadata.reply_to_message_id, None)
                if key is not None:
                    replies[key] = reply
            now = time.monotonic()
            if not pending or now - started >= timeout:
                break
            if now >= next_notice:
                waiting = sorted(pending.values())
                shown = ", ".join(map(str, waiting[:20])) + (" ..." if len(waiting) > 20 else "")
                self.reporter.info(f"waiting for {len(waiting)} {what} ({shown}): "
                                   f"{now - started:.0f} s of {timeout:g} s")
                next_notice += self.notice_every
            time.sleep(0.05)
        return replies, sorted([*unsent, *pending.values()])

    def push(self, messages: Mapping[int, Message]) -> tuple[dict[str, int], list[int]]:
        """Push one message per key in one call; returns the pushed messages' ids with their
        keys, and the keys whose message the SuperLink refused."""
        accepted = {str(i) for i in self.grid.push_messages(list(messages.values()))
                    if i is not None}
        pending: dict[str, int] = {}
        unsent = []
        for key, message in messages.items():
            if message.metadata.message_id in accepted:
                pending[message.metadata.message_id] = key
            else:
                unsent.append(key)
        return pending, unsent

    # --- asynchronous rounds in real time (pflalign.round.fedbuff.RealTimeRounds) ----------
    def submit(self, action: str, messages: Sequence[Outgoing]) -> int:
        """Push ``messages`` without waiting for their replies (:meth:`poll` collects them);
        returns their bytes."""
        outgoing, sizes = self.outgoing(action, messages)
        pushed, unsent = self.push(outgoing)
        now = time.monotonic()
        limits = {m.client: m.limits for m in messages}
        for message_id, cid in pushed.items():
            self.flying[message_id] = (cid, limits.get(cid), now)
        self.refused.extend(unsent)
        return sum(sizes)

    def poll(self) -> list[tuple[int, Reply, int]]:
        """The replies to :meth:`submit`'s messages that have come since the last call, in the
        order they were pulled, as ``(client, reply, bytes up)``; a message the SuperLink refused,
        and one without a reply within ``round-timeout`` of its push, as a failed reply."""
        out: list[tuple[int, Reply, int]] = [
            (cid, Reply(cid, f"client {cid}", error="could not be sent its message"), 0)
            for cid in self.refused]
        self.refused = []
        if self.flying:
            for msg in self.grid.pull_messages(list(self.flying)):
                entry = self.flying.pop(msg.metadata.reply_to_message_id, None)
                if entry is not None:
                    cid, limits, _ = entry
                    up = 0 if msg.has_error() else message_bytes(msg.content)
                    out.append((cid, self.reply(cid, msg, limits), up))
            now = time.monotonic()
            for message_id, (cid, _, pushed) in list(self.flying.items()):
                if now - pushed > self.timeout:
                    del self.flying[message_id]
                    out.append((cid, Reply(cid, f"client {cid}", timed_out=True, error=(
                        f"did not reply within round-timeout = {self.timeout:g} s")), 0))
        return out

    def outgoing(self, action: str, messages: Sequence[Outgoing],
                 ) -> tuple[dict[int, Message], list[int]]:
        """The Flower messages of ``messages`` by client, and each one's bytes."""
        records: dict[tuple, ArrayRecord] = {}  # one serialization per distinct state

        def record(state: State) -> ArrayRecord:
            key = tuple((k, id(v)) for k, v in state.items())
            if key not in records:
                records[key] = to_record(state)
            return records[key]

        outgoing = {m.client: Message(
            content=RecordDict({CONFIG: ConfigRecord(m.config), RUN_CONFIG: self.run_config,
                                **{name: exact_record(state) if name == RESTORE else record(state)
                                   for name, state in m.payload.arrays.items()}}),
            dst_node_id=self.node_of[m.client], message_type=MESSAGE_TYPES[action])
            for m in messages}
        sizes = [message_bytes(m.content) for m in outgoing.values()]
        self.largest_sent = max([self.largest_sent, *sizes])
        return outgoing, sizes

    def exchange(self, action: str, messages: Sequence[Outgoing]) -> Exchange:
        outgoing, sizes = self.outgoing(action, messages)
        replies, silent = self.send(outgoing)
        return self.collected(messages, sizes, replies, silent)

    def collected(self, messages: Sequence[Outgoing], sizes: Sequence[int],
                  replies: Mapping[int, Message], silent: Sequence[int]) -> Exchange:
        """The exchange of ``messages`` (``sizes``: their bytes) from the Flower ``replies`` by
        client, the ``silent`` clients counted as timed out."""
        up = sum(message_bytes(m.content) for m in replies.values() if not m.has_error())
        limits = {m.client: m.limits for m in messages}
        answers = [self.reply(cid, m, limits.get(cid)) for cid, m in replies.items()]
        answers += [Reply(cid, f"client {cid}", timed_out=True,
                          error=f"did not reply within round-timeout = {self.timeout:g} s")
                    for cid in silent]
        return Exchange(answers, sum(sizes), up)

    def oversized(self, content: RecordDict, limits: Mapping[str, int] | None) -> str | None:
        """Why a reply's records cannot be read (None when they can), from their sizes alone."""
        stray = [*content.config_records, *(n for n in content.metric_records if n != METRICS)]
        if stray:
            return (f"sent {len(stray)} record{'s' if len(stray) > 1 else ''} no reply has "
                    f"({quote_names(stray)})")
        if limits is None:
            size, limit = array_bytes(content), self.reply_limit  # every record, whatever name
            if size > limit:
                return (f"sent {size:,} bytes of arrays, more than any honest reply (at most "
                        f"{limit:,}: {ARRAYS_FACTOR} x the largest message it was sent + 1 MiB)")
            return None
        unknown = [name for name in content.array_records if name not in limits]
        if unknown:
            return (f"sent the array record{'s' if len(unknown) > 1 else ''} "
                    f"{quote_names(unknown)}, which this action's replies do not have")
        for name, record in content.array_records.items():
            size = sum(len(array.data) for array in record.values())
            if size > limits[name]:
                return (f"sent {size:,} bytes in its {quote(name, 60)} record, more than the "
                        f"{limits[name]:,} its declared arrays take")
        return None

    @property
    def reply_limit(self) -> int:
        """The most array bytes a reply may carry now: :data:`~pflalign.wire.protocol.ARRAYS_FACTOR`
        times the largest message sent so far (the model and what goes with it), plus
        ``ARRAYS_SLACK``."""
        return ARRAYS_FACTOR * self.largest_sent + ARRAYS_SLACK

    def reply(self, cid: int, msg: Message, limits: Mapping[str, int] | None = None) -> Reply:
        """The reply ``msg`` of client ``cid`` as the round loop reads it. Refused unread: one
        with records a reply never has (config records, metric records beside
        :data:`~pflalign.wire.protocol.METRICS`), one with an array record ``limits`` does not name
        or bigger than it allows, and (without ``limits``) one over :attr:`reply_limit`."""
        who = f"client {cid}"
        if msg.has_error():
            return Reply(cid, who, error=f"failed: {short_reason(msg.error.reason)}")
        if msg.metadata.src_node_id != self.node_of[cid]:
            return Reply(None, who, error=f"was answered by node {msg.metadata.src_node_id}, "
                                          f"not by its own node {self.node_of[cid]}")
        problem = self.oversized(msg.content, limits)
        if problem:  # refused before its arrays are turned into anything
            return Reply(cid, who, refused=True, error=f"{problem}; the reply is not read")
        try:
            metrics = msg.content.metric_records.get(METRICS)
            if metrics is None:
                return Reply(cid, who, error=f"replied without a '{METRICS}' MetricRecord")
            return Reply(cid, who, metrics=dict(metrics),
                         arrays={name: to_state(rec) for name, rec in
                                 msg.content.array_records.items()})
        except Exception as err:  # undecodable arrays: this reply is unusable, not the run
            return Reply(cid, who, error=f"sent a reply that cannot be decoded "
                                         f"({type(err).__name__}: {err})")
