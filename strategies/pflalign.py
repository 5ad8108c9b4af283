"""pFLAlign server half: AggregationRobustPersonalization (ALGORITHMS.md 1.5-1.7).

Aggregation is FedAvg by sample count (1.6). The alignment lives in each client's personalized
initialization ``theta_g + Delta_i`` and the gamma-weighted correction (1.7).

``pflalign-state = client``: the server sends ``theta_g`` and the client keeps ``Delta_i``.
``pflalign-state = server``: the strategy keeps ``Delta_i = theta_i^end - theta_g^r`` (measured
against the global model it sent this round, trainable entries only, A6) and sends, in client i's
own message, the personalized initialization ``theta_g + Delta_i`` as ``arrays`` and ``Delta_i``
as ``offset`` (the client needs Delta for its correction). Both modes compute the same numbers in
float32, so they give identical metrics; they differ in bytes and in where the offsets are kept.
Clients not sampled keep their offsets untouched; a first participation starts from Delta = 0.

Per round it records mean P and mean gamma over the clients (their reports), the mean norm of
their offsets, and the mean cosine between each client's update and the aggregated update.
"""

from __future__ import annotations

import math

import numpy as np
from flwr.app import ArrayRecord

from pflalign.aggregation import State, fedavg, l2_norm, personal_offset, personalized_init
from strategies.base import ARRAYS, PFLStrategy, Update, to_record

OFFSET, PERSONAL = "offset", "personal"


class PFLAlignStrategy(PFLStrategy):
    client_diagnostics = ("mean-P", "mean-gamma")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.server_mode = self.settings["pflalign-state"] == "server"
        self.personalize = bool(self.settings["pflalign-personalize"])
        self.offsets: dict[int, State] = {}
        self._delta_norm = float("nan")
        self._samples: dict[int, list[int]] = {}

    # --- what each client receives -------------------------------------------------------------
    def _personalized(self, client: int) -> State:
        return personalized_init(self.global_state, self.offsets[client])

    def train_records(self, client: int) -> dict[str, ArrayRecord]:
        if not (self.server_mode and client in self.offsets):
            return {ARRAYS: self.global_record()}
        return {ARRAYS: to_record(self._personalized(client)),
                OFFSET: to_record(self.offsets[client])}

    def eval_records(self, client: int) -> dict[str, ArrayRecord]:
        records = {ARRAYS: self.global_record()}
        if self.server_mode and client in self.offsets:
            records[PERSONAL] = to_record(self._personalized(client))
        return records

    def train_config(self, client: int, server_round: int) -> dict[str, bool]:
        """Ask a client to score its model right after training when it will not train again
        before the next evaluation: that model is then its personal model at evaluation."""
        every, rounds = int(self.settings["eval-every"]), int(self.settings["rounds"])
        next_eval = min(math.ceil(server_round / every) * every, rounds)
        later = range(server_round + 1, next_eval + 1)
        return {"evaluate-after-fit": all(client not in self._sampled(r) for r in later)}

    def _sampled(self, server_round: int) -> list[int]:
        if server_round not in self._samples:
            self._samples[server_round] = self.sample(server_round)
        return self._samples[server_round]

    # --- aggregation ---------------------------------------------------------------------------
    def aggregate(self, server_round: int, updates: list[Update]) -> State | None:
        norms = []
        for update in updates:
            offset = personal_offset(update.state, self.global_state, self.trainable)
            norms.append(l2_norm(offset))
            if self.server_mode and self.personalize:
                self.offsets[update.client] = offset
        self._delta_norm = float(np.mean(norms))
        return fedavg([u.state for u in updates], [u.num_examples for u in updates], self.flat)

    def round_diagnostics(self, server_round: int) -> dict[str, float]:
        return {"delta-norm": self._delta_norm}
