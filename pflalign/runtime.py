"""Process environment for Flower and Ray: no telemetry, no update checks, no package installs.

Set before ``flwr`` is imported (``clients`` and ``strategies`` call :func:`set_flower_environment`
on import). A value the user has already set in the environment wins.
"""

from __future__ import annotations

import os

FLOWER_ENVIRONMENT = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    # Ray would otherwise warn on every start that it no longer overrides accelerator variables.
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
}


def set_flower_environment(run_dir: str | None = None) -> dict[str, str]:
    """Set Flower/Ray defaults (keeping the user's own values); return what is now in effect.

    With ``run_dir``, ``FLWR_HOME`` and ``RAY_TMPDIR`` default to folders inside it.
    """
    wanted = dict(FLOWER_ENVIRONMENT)
    if run_dir is not None:
        wanted["FLWR_HOME"] = os.path.join(run_dir, "flwr-home")
        wanted["RAY_TMPDIR"] = os.path.join(run_dir, "ray")
    for key, value in wanted.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in wanted}
