"""Run a config as a Flower simulation on the Ray backend, in this process.

The ServerApp runs in a thread of this process; every client is a Flower SuperNode whose
ClientApp runs in a Ray actor (``client-resources-num-cpus`` / ``-num-gpus`` each). Ray's and
Flower's working folders live in a temporary directory of the run (with the owner's process id,
so that a later run removes it if this one is killed), removed afterwards, and Ray is shut down
so that no process outlives the run.

Ray is started here rather than by Flower's Ray backend (which skips its own ``ray.init`` when Ray
is already up), with the same arguments, for three reasons: a local Ray listens on 127.0.0.1 only
(:func:`pflalign.engines.flower_process.bind_ray_to_loopback`); ``ray_address`` joins an existing
cluster instead, with a one-line error when it cannot be reached; and ``ray.init`` replaces the
process's SIGTERM handler, which must be given back to :mod:`pflalign.process.interrupt` afterwards.

A stop request (Ctrl-C, SIGTERM; :mod:`pflalign.process.interrupt`) makes the round loop, which runs
in the ServerApp thread, raise :class:`~pflalign.process.interrupt.Interrupted` at its next check
(while it waits for replies, or at the start of a round); ``run_methods`` writes the finished
entries and the ServerApp ends. Flower's ``run_simulation`` installs no signal handlers of its own:
when its ServerApp thread raises, it stops its simulation runtime (whose workers first finish the
client messages in flight) and re-raises that exception in the main thread, here, after which Ray is
shut down and the temporary folder removed.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys

from pflalign.data.federated import federated_dataset
from pflalign.engines.base import register_engine
from pflalign.engines.flower_process import (
    bind_ray_to_loopback,
    make_run_dir,
    set_flower_environment,
    terminate_children,
)
from pflalign.engines.ray_cluster import LOOPBACK_HOSTS, check_ray_address, parse_ray_address
from pflalign.outputs.results import Reporter
from pflalign.process.interrupt import (
    check_stop,
    cleanup_on_forced_exit,
    reinstall_handlers,
    request_stop,
)
from pflalign.run.driver import check_resources
from pflalign.settings.options import ConfigError
from pflalign.settings.schema import Settings


class _DropDeprecation(logging.Filter):
    """Drops run_simulation's deprecation notice, and, unless verbose, the remote traceback
    Flower logs for every client that raises: the round loop reports each failed client in one
    line already."""

    def __init__(self, verbose: bool = False):
        super().__init__()
        self.verbose = verbose

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "run_simulation` function is deprecated" in text:
            return False
        client_error = ("ClientAppException" in text
                        or text.startswith("An exception was raised when processing a message"))
        return self.verbose or record.levelno != logging.ERROR or not client_error


def backend_config(settings: Settings, verbose: bool = False,
                   ray_address: str | None = None) -> dict:
    """Ray backend settings; the workers' own log lines reach the terminal only when verbose
    (client errors still come back as error replies, which the strategy reports).
    ``init_args`` are :func:`ray.init`'s arguments (``address``: an existing cluster)."""
    init_args: dict = {"logging_level": "ERROR", "log_to_driver": verbose}
    if ray_address:
        init_args["address"] = ray_address
    return {
        "client_resources": {"num_cpus": settings.run.client_resources_num_cpus,
                             "num_gpus": settings.run.client_resources_num_gpus},
        "init_args": init_args,
    }


def start_ray(init_args: dict) -> None:
    """``ray.init`` as Flower's Ray backend calls it: no dashboard, and this process's
    ``sys.path`` on the workers' PYTHONPATH (so that they import ``clients``)."""
    import ray

    pythonpath = os.pathsep.join(sys.path)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
    os.environ["PYTHONPATH"] = pythonpath
    address = init_args.get("address")
    try:
        ray.init(runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
                 **{"include_dashboard": False, **init_args})
    except (ConnectionError, ValueError) as err:
        if not address:
            raise
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"Cannot join the Ray cluster at '{address}' ({reason}); start it "
                          "with `ray start --head --port PORT` and pass the address it prints, "
                          "from a machine that is one of its nodes.") from err


def simulate(settings: Settings, reporter: Reporter | None = None, verbose: bool = False,
             ray_address: str | None = None, resume: bool = False,
             client_app: object | None = None, server_app: object | None = None) -> dict:
    """Validate the data, run every method of ``settings`` on Ray, and return the results.

    ``ray_address`` (or Ray's own ``RAY_ADDRESS`` variable): run the clients on that existing
    Ray cluster instead of a local Ray started (and stopped) here. ``resume``: continue a killed
    run in ``out-dir`` (:func:`~pflalign.run.driver.run_methods`). ``client_app``: a ClientApp
    to serve the clients in place of the project's (a test's, wrapping its handlers);
    ``server_app``: a ServerApp in place of the project's (one of a user's own, over a strategy of
    :mod:`strategies.methods`), which returns nothing here: it keeps its own results."""
    address = ray_address or os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        check_ray_address(address)
    federated_dataset(settings)  # data and partition errors surface here, before Ray starts
    if address is None:
        check_resources(settings)  # this machine's cores and GPUs; a cluster's nodes decide there
    check_stop()
    run_dir = make_run_dir()
    set_flower_environment(run_dir)
    if address is None or parse_ray_address(address)[0] in LOOPBACK_HOSTS:
        # a Ray started here, or a head on 127.0.0.1: this driver listens on 127.0.0.1 too
        # (and Ray does not swap 127.0.0.1 in the address for the machine's routable address)
        bind_ray_to_loopback()
    import ray
    from flwr.simulation import run_simulation

    from clients.app import app as project_app
    from strategies.app import make_server_app

    flwr_logger = logging.getLogger("flwr")
    quiet_filter = _DropDeprecation(verbose)
    flwr_logger.addFilter(quiet_filter)
    previous_level = flwr_logger.level
    if not verbose:
        flwr_logger.setLevel(logging.WARNING)
    collected: list[dict] = []
    config = backend_config(settings, verbose, address)

    def forced_cleanup() -> None:  # a second Ctrl-C leaves no time for ray.shutdown
        terminate_children()
        shutil.rmtree(run_dir, ignore_errors=True)

    try:
        with cleanup_on_forced_exit(forced_cleanup):
            try:
                start_ray(config["init_args"])
            except SystemExit as err:  # SIGTERM met ray.init's own handlers (sys.exit(15 or 1))
                if err.code not in (signal.SIGTERM, 1):
                    raise
                request_stop(signal.SIGTERM)
            reinstall_handlers()  # ray.init installs its own SIGTERM handler
            check_stop()
            run_simulation(server_app=server_app or make_server_app(
                               settings, reporter, collected.append, resume=resume),
                           client_app=client_app or project_app,
                           num_supernodes=settings.num_nodes,
                           backend_config=config, verbose_logging=verbose)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        flwr_logger.removeFilter(quiet_filter)
        flwr_logger.setLevel(previous_level)
        shutil.rmtree(run_dir, ignore_errors=True)
    if server_app is not None:
        return {}
    if not collected:
        raise RuntimeError("The simulation ended without results; see the log above.")
    return collected[0]


register_engine("flower", runner=simulate)
