"""FedAvg server half (also serves fedavg-ft, whose difference is all on the client).

Sample-weighted averaging of the sampled clients' models, ALGORITHMS.md 1.6:
``theta_g <- sum_i n_i theta_i / sum_i n_i`` -- exactly :meth:`PFLStrategy.aggregate`'s default.
"""

from __future__ import annotations

from strategies.base import PFLStrategy


class FedAvgStrategy(PFLStrategy):
    """McMahan et al. (2017): the base strategy's defaults are FedAvg."""
