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
from typing import TYPE_CHECKING

from torch import nn

from pflalign.client import ClientRuntime, Received, Upload
from pflalign.method import Method, Payload, Update
from pflalign.protocol import LOCAL_STEPS, MODEL, TRAIN_LOSS
from pflalign.server import ServerRuntime
from pflalign.state import ArrayState, ServerState, TorchState

if TYPE_CHECKING:
    from pflalign.cohort import Cohort


@dataclass
class LocalClientState(ArrayState):
    model: TorchState | None = None


@dataclass
class LocalServerState(ServerState):
    #: clients that have trained (and so hold their own model)
    trained: frozenset[int] = frozenset()


class Local(Method):
    name = "local"
    summary = ("Each client trains only on its own data; no averaging. Its model persists "
               "across rounds in the client's state.")
    paper = "Local-only training (the standard pFL reference)"
    ClientState = LocalClientState
    ServerState = LocalServerState
    has_global_model = False
    uploads_model = False

    def _model(self, client: ClientRuntime, received: Received,
               state: LocalClientState) -> nn.Module:
        return client.new_model(state.model or received.model)

    def train(self, client: ClientRuntime, received: Received, state: LocalClientState,
              ) -> tuple[Upload, LocalClientState]:
        model = self._model(client, received, state)
        stats = client.local_train(model, received.server_round)
        return (Upload(None, {TRAIN_LOSS: stats.loss, LOCAL_STEPS: stats.steps}),
                LocalClientState(model=model.state_dict()))

    def evaluate(self, client: ClientRuntime, received: Received,
                 state: LocalClientState) -> dict:
        return client.eval_metrics(client.test(self._model(client, received, state)))

    def train_cohort(self, cohort: Cohort, received: Sequence[Received],
                     states: Sequence[LocalClientState],
                     ) -> list[tuple[Upload, LocalClientState]]:
        server_round = received[0].server_round
        starts = [s.model or r.model for r, s in zip(received, states, strict=True)]
        params = cohort.stack(starts)
        stats = cohort.local_train(params, server_round, cohort.optimizers(params, server_round))
        return [(Upload(None, {TRAIN_LOSS: s.loss, LOCAL_STEPS: s.steps}),
                 LocalClientState(model=cohort.state_dict(params, i, starts[i])))
                for i, s in enumerate(stats)]

    def evaluate_cohort(self, cohort: Cohort, received: Sequence[Received],
                        states: Sequence[LocalClientState]) -> list[dict]:
        return [cohort.eval_metrics(cohort.test(cohort.model(s.model or r.model), i))
                for i, (r, s) in enumerate(zip(received, states, strict=True))]

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
