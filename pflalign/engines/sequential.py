"""The sequential engine: every client's rule called in turn, in this process, without Flower.

Messages carry what Flower's would (the arrays the Flower engine serializes, the message config),
each client's state is kept as the flat arrays :meth:`~pflalign.wire.state.ArrayState.to_arrays`
gives, as a Flower client keeps it in its node state (in a
:class:`~pflalign.engines.store.ClientStateStore`: in memory up to ``memory-budget-gb``, spilled to
memory-mapped files beyond it), and the bytes counted are those Flower would send. A client rule
that raises becomes an error reply naming the exception and where it was raised, which the round
loop skips with a warning, as under Flower. Torch uses ``client-resources-num-cpus`` threads. Needs
neither Ray nor flwr.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch

from pflalign.data.federated import federated_dataset
from pflalign.engines.base import Engine, EngineFactory, register_engine
from pflalign.engines.faults import ClientDropout, with_faults
from pflalign.engines.host import discovery, handle, to_torch
from pflalign.engines.secagg_client import with_secure_upload
from pflalign.engines.store import ClientStateStore
from pflalign.outputs.results import Reporter
from pflalign.settings.schema import Settings
from pflalign.wire.messages import ClientInfo, Exchange, Outgoing, Reply
from pflalign.wire.protocol import NUM_TEST, NUM_TRAIN, RESTORE, SCORED, UNSEEN
from pflalign.wire.state import State
from pflalign.wire.traffic import records_bytes, sent_bytes


def sent_records(arrays: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, dict]:
    """A message's array records as the Flower engine serializes them (to_record: C-contiguous,
    0-d arrays as 1-d), and a client's restored state (:data:`~pflalign.wire.protocol.RESTORE`)
    exactly."""
    return {name: ({k: np.array(v, order="C", copy=True) for k, v in record.items()}
                   if name == RESTORE else {k: np.ascontiguousarray(v) for k, v in record.items()})
            for name, record in arrays.items()}


def failure_reply(client: int, err: Exception) -> Reply:
    """A failing client's error reply: the exception and where it was raised, as under Flower."""
    where = traceback.extract_tb(err.__traceback__)[-1]
    return Reply(client, f"client {client}", error=(
        f"failed: {type(err).__name__}: {err} (at {where.filename}:{where.lineno})"))


def numpy_records(arrays: Mapping[str, Mapping[str, torch.Tensor]],
                  ) -> dict[str, dict[str, np.ndarray]]:
    """A reply's array records as NumPy copies (what the server receives)."""
    return {name: {k: v.detach().cpu().numpy().copy() for k, v in record.items()}
            for name, record in arrays.items()}


class SequentialEngine(Engine):
    """Clients called one after another in this process, with their states kept in memory."""

    def __init__(self, settings: Settings):
        self.settings = settings
        #: each client's saved state, in memory up to memory-budget-gb, beyond it in files
        self.states = ClientStateStore(int(settings.run.memory_budget_gb * 1e9),
                                       settings.run.out_dir)
        #: the client handler, with the run's fault injection around it
        self.handler = with_secure_upload(with_faults(handle))

    def memory_note(self) -> str | None:
        """What the client-state store spilled to disk (None: nothing)."""
        return self.states.describe()

    def close(self) -> None:
        """Remove the client-state files spilled beyond memory-budget-gb."""
        self.states.close()

    def dropout_reply(self, cid: int) -> Reply:
        """What the server gets from a client that stays silent: nothing before its deadline."""
        return Reply(cid, f"client {cid}", timed_out=True, error=(
            f"did not reply within round-timeout = {self.settings.run.round_timeout:g} s"))

    def discover(self) -> dict[int, ClientInfo]:
        partition = federated_dataset(self.settings).partition
        clients = {}
        for cid in range(partition.num_clients):
            m = discovery(self.settings, cid)
            clients[cid] = ClientInfo(id=cid, num_train=int(m[NUM_TRAIN]),
                                      num_test=int(m[NUM_TEST]), unseen=bool(m[UNSEEN]))
        return clients

    def received(self, sent: Mapping[str, Mapping[str, np.ndarray]], exchange: dict,
                 ) -> dict[str, dict[str, torch.Tensor]]:
        """What a client receives of ``sent``, as torch tensors: its own copy, as each Flower
        client deserializes its own (``exchange``: a dict that lives for one exchange, for an
        engine that shares what its clients receive)."""
        return to_torch(sent)

    def arrive(self, message: Outgoing, shared: dict) -> tuple[int, dict[str, dict]]:
        """The bytes ``message`` carries down, and its records as the client receives them."""
        sent = sent_records(message.payload.arrays)
        return sent_bytes(sent), self.received(sent, shared)

    def answer(self, cid: int, metrics: dict, arrays: dict, state: State | None,
               ) -> tuple[Reply, int]:
        """A client's reply as the server receives it, and its bytes up; its new state kept."""
        if state is not None:
            self.states[cid] = state
        reply_arrays = numpy_records(arrays)
        # a model sent back for save-models is the run's output, not the method's traffic
        return (Reply(cid, f"client {cid}", metrics=metrics, arrays=reply_arrays),
                records_bytes(r for name, r in reply_arrays.items() if name != SCORED))

    def exchange(self, action: str, messages: Sequence[Outgoing]) -> Exchange:
        replies, down, up = [], 0, 0
        shared: dict = {}
        for message in messages:
            cid = message.client
            size, arrays = self.arrive(message, shared)
            down += size
            try:
                metrics, reply, state = self.handler(action, self.settings, cid,
                                                     message.config, arrays,
                                                     self.states.get(cid))
            except ClientDropout:  # silent: the round's deadline passes without its reply
                replies.append(self.dropout_reply(cid))
                continue
            except Exception as err:  # a failing client is an error reply, as under Flower
                replies.append(failure_reply(cid, err))
                continue
            answer, size = self.answer(cid, metrics, reply, state)
            replies.append(answer)
            up += size
        return Exchange(replies, down, up)


@contextlib.contextmanager
def session(settings: Settings, reporter: Reporter, ray_address: str | None,
            ) -> Iterator[EngineFactory]:
    """The sequential engine for a run (:data:`~pflalign.engines.base.Session`): nothing to set
    up (it runs in this process, never on a cluster: :func:`pflalign.run.driver.check_resources`
    refuses ``ray_address`` for it)."""
    yield SequentialEngine


register_engine("sequential", session=session)
