"""The ServerApp. ``flwr run .`` uses the module-level ``app`` (settings from the run config);
``simulate.py`` builds one with :func:`make_server_app` around already-resolved settings."""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

import strategies  # noqa: F401  (sets the Flower environment before flwr is imported)
from pflalign.config import Settings
from pflalign.results import Reporter
from strategies.runner import run_methods

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    settings = Settings(dict(context.run_config), source="the run config")
    run_methods(grid, settings)


def make_server_app(settings: Settings, reporter: Reporter | None = None,
                    on_results: Callable[[dict], None] | None = None) -> ServerApp:
    """A ServerApp that runs ``settings`` and hands the results dictionary to ``on_results``."""
    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        results = run_methods(grid, settings, reporter)
        if on_results is not None:
            on_results(results)

    return server_app
