"""Flower server side: every registered method as a Flower Message-API strategy
(:mod:`strategies.methods`: ``from strategies import PFLAlign``), the project's ServerApp and the
Flower engine, thin over the round loop and the methods in ``pflalign``.

A package is imported before any of its modules, so this sets Flower's and Ray's environment
(no telemetry, no update checks, no package installs) before any module here imports flwr.
"""

from pflalign.engines.flower_process import set_flower_environment

set_flower_environment()

import strategies.simulation  # noqa: E402,F401,I001  (registers engine = flower)
from strategies.methods import (  # noqa: E402  (after the environment is set)
    APFL,
    GPFL,
    STRATEGIES,
    Ditto,
    FedALA,
    FedAvg,
    FedAvgFT,
    FedBN,
    FedCP,
    FedDBE,
    FedDyn,
    FedPer,
    FedProx,
    FedRep,
    Local,
    MethodStrategy,
    PerFedAvg,
    PFedMe,
    PFLAlign,
    Scaffold,
    strategy_for,
)
from strategies.wrappers import CentralDP, StrategyWrapper, UpdateClip  # noqa: E402

__all__ = ["APFL", "GPFL", "STRATEGIES", "CentralDP", "Ditto", "FedALA", "FedAvg", "FedAvgFT",
           "FedBN", "FedCP", "FedDBE", "FedDyn", "FedPer", "FedProx", "FedRep", "Local",
           "MethodStrategy", "PFLAlign", "PFedMe", "PerFedAvg", "Scaffold", "StrategyWrapper",
           "UpdateClip", "strategy_for"]
