"""pFedMe server half (T Dinh et al., NeurIPS 2020, Algorithm 1 line 12):
``w_g <- (1 - pfedme-beta) w_g + pfedme-beta sum_i p_i w_i`` with sample weights ``p_i``
(:func:`pflalign.baselines.pfedme_server_update`); ``pfedme-beta = 1`` is FedAvg's average."""

from __future__ import annotations

import numpy as np

from pflalign.aggregation import State, weighted_average
from pflalign.baselines import pfedme_server_update
from strategies.base import PFLStrategy, Update


class PFedMeStrategy(PFLStrategy):
    def aggregate(self, server_round: int, updates: list[Update]) -> State | None:
        average = weighted_average([self.flat.flatten(u.state, np.float64) for u in updates],
                                   [u.num_examples for u in updates])
        current = self.flat.flatten(self.global_state, np.float64)
        return self.flat.unflatten(pfedme_server_update(current, average,
                                                        float(self.settings["pfedme-beta"])))
