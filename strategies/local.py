"""Local-only server half: no aggregation, no global model.

The server only schedules rounds and collects metrics. The common initial model is sent to a
client until it has trained once (afterwards its own model lives in its state), so the downlink
counts what is really needed. Unseen clients are not evaluated: without a shared model a new
client has nothing to start from but its own training.
"""

from __future__ import annotations

from flwr.app import ArrayRecord

from pflalign.aggregation import State
from strategies.base import PFLStrategy, Update


class LocalStrategy(PFLStrategy):
    uploads_model = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained: set[int] = set()

    def train_arrays(self, client: int) -> ArrayRecord | None:
        return None if client in self.trained else self.global_record()

    def eval_arrays(self, client: int) -> ArrayRecord | None:
        return self.train_arrays(client)

    def eval_clients(self) -> list[int]:
        return sorted(cid for cid, info in self.clients.items() if not info.unseen)

    def aggregate(self, server_round: int, updates: list[Update]) -> State | None:
        self.trained.update(u.client for u in updates)
        return None
