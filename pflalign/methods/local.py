"""Local-only training (the standard pFL reference): each client trains only on its own data.

Client: the model persists across rounds in the client's state; a client that has not trained
yet starts from the run's common initial model, which the server sends only then. Server: no
aggregation and no global model; it only schedules rounds and collects metrics, so the downlink
counts what is really needed. Unseen clients are not evaluated: without a shared model a new
client has nothing to start from but its own training.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from pflalign.methods.base import Method
from pflalign.server.runtime import ServerRuntime
from pflalign.training.client import ClientRuntime
from pflalign.training.runs import LocalRun, Rule
from pflalign.wire.messages import Payload, Received, Update, Upload
from pflalign.wire.protocol import LOCAL_STEPS, MODEL, TRAIN_LOSS
from pflalign.wire.state import ArrayState, ServerState, TorchState


@dataclass
class LocalClientState(ArrayState):
    model: TorchState | None = None


@dataclass
class LocalServerState(ServerState):
    #: clients that have trained (and so hold their own model)
    trained: frozenset[int] = frozenset()


class Local(Method):
    asynchronous = True  # its server update is a sample-weighted average of uploads
    name = "local"
    summary = ("Each client trains only on its own data; no averaging. Its model persists "
               "across rounds in the client's state.")
    paper = "Local-only training (the standard pFL reference)"
    ClientState = LocalClientState
    ServerState = LocalServerState
    has_global_model = False
    uploads_model = False
    private = True  # it uploads nothing: nothing of its training leaves a client

    def train(self, client: ClientRuntime, received: Received, state: LocalClientState) -> Rule:
        result = yield LocalRun(state.model or received.model)
        return (Upload(None, {TRAIN_LOSS: result.stats.loss, LOCAL_STEPS: result.stats.steps}),
                LocalClientState(model=result.model))

    def evaluate(self, client: ClientRuntime, received: Received,
                 state: LocalClientState) -> Rule:
        return client.eval_metrics(client.test(state.model or received.model))

    def train_payload(self, server: ServerRuntime, state: LocalServerState, client: int,
                      server_round: int) -> Payload:
        return Payload() if client in state.trained else Payload(
            {MODEL: server.shared_model(state)})

    def eval_payload(self, server: ServerRuntime, state: LocalServerState, client: int,
                     server_round: int) -> Payload:
        return self.train_payload(server, state, client, server_round)

    def eval_clients(self, server: ServerRuntime) -> list[int]:
        return sorted(cid for cid, info in server.clients.items() if not info.unseen)

    def aggregate(self, server: ServerRuntime, state: LocalServerState, server_round: int,
                  updates: Sequence[Update]) -> tuple[LocalServerState, dict[str, float]]:
        trained = state.trained | {u.client for u in updates}
        return dataclasses.replace(state, trained=frozenset(trained)), {}
