"""Run a config as a Flower simulation on the Ray backend, in this process.

The ServerApp runs in a thread of this process; every client is a Flower SuperNode whose
ClientApp runs in a Ray actor (``client-resources-num-cpus`` / ``-num-gpus`` each). Ray's and
Flower's working folders live in a temporary directory of the run, removed afterwards, and Ray is
shut down so that no process outlives the run.
"""

from __future__ import annotations

import logging
import shutil
import tempfile

from pflalign.config import Settings
from pflalign.engines import check_resources
from pflalign.federation import federated_dataset
from pflalign.results import Reporter
from pflalign.runtime import set_flower_environment


class _DropDeprecation(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "run_simulation` function is deprecated" not in record.getMessage()


def backend_config(settings: Settings, verbose: bool = False) -> dict:
    """Ray backend settings; the workers' own log lines reach the terminal only when verbose
    (client errors still come back as error replies, which the strategy reports)."""
    return {
        "client_resources": {"num_cpus": settings.run.client_resources_num_cpus,
                             "num_gpus": settings.run.client_resources_num_gpus},
        "init_args": {"logging_level": "ERROR", "log_to_driver": verbose},
    }


def simulate(settings: Settings, reporter: Reporter | None = None, verbose: bool = False) -> dict:
    """Validate the data, run every method of ``settings`` on Ray, and return the results."""
    federated_dataset(settings)  # data and partition errors surface here, before Ray starts
    check_resources(settings)
    run_dir = tempfile.mkdtemp(prefix="pflalign-")
    set_flower_environment(run_dir)
    import ray
    from flwr.simulation import run_simulation

    from clients.app import app as client_app
    from strategies.app import make_server_app

    flwr_logger = logging.getLogger("flwr")
    quiet_filter = _DropDeprecation()
    flwr_logger.addFilter(quiet_filter)
    previous_level = flwr_logger.level
    if not verbose:
        flwr_logger.setLevel(logging.WARNING)
    collected: list[dict] = []
    try:
        run_simulation(server_app=make_server_app(settings, reporter, collected.append),
                       client_app=client_app, num_supernodes=settings.num_nodes,
                       backend_config=backend_config(settings, verbose),
                       verbose_logging=verbose)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        flwr_logger.removeFilter(quiet_filter)
        flwr_logger.setLevel(previous_level)
        shutil.rmtree(run_dir, ignore_errors=True)
    if not collected:
        raise RuntimeError("The simulation ended without results; see the log above.")
    return collected[0]
