"""This app's ServerApp: pflalign's PFLAlign strategy, started as Flower's FedAvg would be."""

from __future__ import annotations

import json
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from ownapp.task import CLASSES, FEATURES
from strategies import PFLAlign

app = ServerApp()

#: the run's settings that describe this app (the rest come from its run config)
APP_SETTINGS = {"dataset": "clients", "num-classes": CLASSES, "input-shape": str(FEATURES),
                "partition": "natural", "model": "py:ownapp.task:Net",
                "eval-audit-fraction": 0.0, "engine": "flower"}


def strategy_config(run_config: dict) -> dict:
    """The strategy's settings: this app's, and the run config's pflalign keys."""
    own = {"num-server-rounds", "out-dir"}
    return {**APP_SETTINGS, **{k: v for k, v in run_config.items() if k not in own}}


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_config = dict(context.run_config)
    strategy = PFLAlign(strategy_config(run_config))
    strategy.start(grid=grid, initial_arrays=strategy.initial_arrays(),
                   num_rounds=int(run_config["num-server-rounds"]))
    out = Path(str(run_config.get("out-dir") or "results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(strategy.results, indent=1, default=float))
    final = strategy.results["final"]
    print(f"pFLAlign after {run_config['num-server-rounds']} rounds: "
          + ", ".join(f"{k} {v:.4f}" for k, v in final.items() if isinstance(v, float)))
