"""Flower server side: the ServerApp and the Flower engine, thin over the round loop and the
methods in ``pflalign``.

A package is imported before any of its modules, so this sets Flower's and Ray's environment
(no telemetry, no update checks, no package installs) before any module here imports flwr.
"""

from pflalign.engines.flower_process import set_flower_environment

set_flower_environment()
