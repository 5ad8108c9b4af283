"""Flower ClientApp side: Message in, a method's client rule in ``pflalign``, Message out.

A package is imported before any of its modules, so this sets Flower's and Ray's environment
(no telemetry, no update checks, no package installs) before any module here imports flwr.
"""

from pflalign.engines.flower_process import set_flower_environment

set_flower_environment()

from clients.answer import answer  # noqa: E402  (after the environment is set)

__all__ = ["answer"]
