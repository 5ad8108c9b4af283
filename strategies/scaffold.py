"""SCAFFOLD server half (Karimireddy et al., ICML 2020, Algorithm 1 lines 16-17).

The server keeps the control variate ``c`` (trainable entries, zeros at start) and sends it to each
sampled client as the record ``control`` beside the global model. Each reply carries the model
``y_i`` and ``dc_i`` (record ``control-delta``). The server steps
``x <- x + scaffold-server-lr * sum_i p_i (y_i - x)`` (sample weights ``p_i``; buffers are
averaged as in FedAvg) and ``c <- c + (1/N) sum_i dc_i`` over the N training clients
(:func:`pflalign.baselines.scaffold_server_update`).
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord

from pflalign.aggregation import FlatSpec, State, fedavg
from pflalign.baselines import scaffold_server_update
from strategies.base import ARRAYS, PFLStrategy, Update, to_record

CONTROL, CONTROL_DELTA = "control", "control-delta"


class ScaffoldStrategy(PFLStrategy):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.control_spec = FlatSpec.of({k: self.global_state[k] for k in self.trainable})
        self.control = np.zeros(self.control_spec.size, dtype=np.float64)
        self.reply_records = {CONTROL_DELTA: self.control_spec}
        self._control_record: ArrayRecord | None = None

    def train_records(self, client: int) -> dict[str, ArrayRecord]:
        if self._control_record is None:
            self._control_record = to_record(self.control_spec.unflatten(self.control))
        return {ARRAYS: self.global_record(), CONTROL: self._control_record}

    def aggregate(self, server_round: int, updates: list[Update]) -> State | None:
        spec = self.control_spec
        weights = [u.num_examples for u in updates]
        x = spec.flatten(self.global_state, np.float64)
        model, self.control = scaffold_server_update(
            x, self.control, [spec.flatten(u.state, np.float64) - x for u in updates],
            [spec.flatten(u.records[CONTROL_DELTA], np.float64) for u in updates], weights,
            num_clients=sum(not info.unseen for info in self.clients.values()),
            server_lr=float(self.settings["scaffold-server-lr"]))
        self._control_record = None
        averaged = fedavg([u.state for u in updates], weights, self.flat)
        return {**averaged, **spec.unflatten(model)}

    def round_diagnostics(self, server_round: int) -> dict[str, float]:
        return {"control-norm": float(np.linalg.norm(self.control))}
