"""Local-only server half: no aggregation, no global model.

The server only schedules rounds and collects metrics. The common initial model is sent to a
client until it has trained once (afterwards its own model lives in its state), so the downlink
counts what is really needed. Unseen clients are not evaluated: without a shared model a new
client has nothing to start from but its own training.
"""

from __future__ import annotations

from flwr.app import ArrayRecord

from pflalign.aggregation import State
from strategies.base import ARRAYS, PFLStrategy, Update


class LocalStrategy(PFLStrategy):
    uploads_model = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained: set[int] = set()

    def train_records(self, client: int) -> dict[str, ArrayRecord]:
        return {} if client in self.trained else {ARRAYS: self.global_record()}

    def eval_records(self, client: int) -> dict[str, ArrayRecord]:
        return self.train_records(client)

    def eval_clients(self) -> list[int]:
        return sorted(cid for cid, info in self.clients.items() if not info.unseen)

    def aggregate(self, server_round: int, updates: list[Update]) -> State | None:
        self.trained.update(u.client for u in updates)
        return None
