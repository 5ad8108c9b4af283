"""The ServerApp. ``flwr run .`` uses the module-level ``app`` (settings from the run config);
``simulate.py`` builds one with :func:`make_server_app` around already-resolved settings. Both run
every method entry through :func:`pflalign.run.driver.run_methods` on the Flower engine."""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from pflalign.outputs.results import Reporter
from pflalign.run.config import build_settings
from pflalign.run.driver import run_methods
from pflalign.settings.options import ConfigError
from pflalign.settings.schema import Settings
from strategies.flower import FlowerEngine

app = ServerApp()


def run_on_grid(grid: Grid, settings: Settings, reporter: Reporter | None = None,
                resume: bool = False) -> dict:
    """Run every method of ``settings`` over the Flower engine on ``grid`` (``resume``: continue
    a killed run in ``out-dir``, :func:`~pflalign.run.driver.run_methods`)."""
    reporter = reporter or Reporter()
    return run_methods(settings, lambda s: FlowerEngine(grid, s, reporter), reporter,
                       resume=resume)


@app.main()
def main(grid: Grid, context: Context) -> None:
    settings = build_settings(dict(context.run_config), source="the run config")
    if settings.run.engine != "flower":
        raise ConfigError(f"engine = {settings.run.engine!r} runs with `python simulate.py`; "
                          "`flwr run` always uses the Flower engine (leave engine = 'flower').")
    run_on_grid(grid, settings)


def make_server_app(settings: Settings, reporter: Reporter | None = None,
                    on_results: Callable[[dict], None] | None = None,
                    resume: bool = False) -> ServerApp:
    """A ServerApp that runs ``settings`` (``resume``: continuing a killed run in ``out-dir``)
    and hands the results dictionary to ``on_results``."""
    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        results = run_on_grid(grid, settings, reporter, resume=resume)
        if on_results is not None:
            on_results(results)

    return server_app
