"""pFedMe server half (T Dinh et al., NeurIPS 2020, Algorithm 1 line 12):
``w_g <- (1 - pfedme-beta) w_g + pfedme-beta sum_i p_i w_i`` with sample weights ``p_i``
(:func:`pflalign.baselines.pfedme_server_update`); ``pfedme-beta = 1`` is FedAvg's average.

Only the sampled clients train in a round (as for every method here; the paper lets all clients
update locally and averages a sampled subset). Buffers are averaged as in FedAvg."""

from __future__ import annotations

import numpy as np

from pflalign.aggregation import FlatSpec, State, fedavg, weighted_average
from pflalign.baselines import pfedme_server_update
from strategies.base import PFLStrategy, Update


class PFedMeStrategy(PFLStrategy):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trainable_spec = FlatSpec.of({k: self.global_state[k] for k in self.trainable})

    def aggregate(self, server_round: int, updates: list[Update]) -> State | None:
        """beta-mixing of the trainable entries; buffers (batch-norm statistics) are averaged."""
        spec = self.trainable_spec
        weights = [u.num_examples for u in updates]
        average = weighted_average([spec.flatten(u.state, np.float64) for u in updates], weights)
        current = spec.flatten(self.global_state, np.float64)
        mixed = spec.unflatten(pfedme_server_update(current, average,
                                                    float(self.settings["pfedme-beta"])))
        return {**fedavg([u.state for u in updates], weights, self.flat), **mixed}
