"""A config key's declaration (:class:`Option`) and the error every bad value raises.

Kept apart from :mod:`pflalign.run.config` (the parser) so that method files can declare their keys
without importing the parser, and the parser can collect them from the registry: no cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

Value = bool | int | float | str

#: A key's scope: ``method`` (a method entry may set it: ``fedavg(lr=0.1)``), ``run`` (shared by
#: every method of a run: the engine, the clients' resources, the faults), ``data`` (defines the
#: data every client sees), ``data-location`` (where that data is read from, not which data it is)
#: and ``output`` (changes nothing a run computes: where results go, how often checkpoints are
#: written, how much client state stays in memory). Every scope but ``method`` is run-wide.
SCOPES = ("method", "run", "data", "data-location", "output")


class ConfigError(ValueError):
    """A configuration value, key or file is invalid; the message says which and how to fix it."""


@dataclass(frozen=True)
class Option:
    """One configuration key: its default (which fixes its type), its help text and its checks."""

    key: str
    default: Value
    help: str
    group: str
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    exclusive_maximum: bool = False
    #: what the key is for (:data:`SCOPES`): which keys a method entry may set, which define the
    #: data, which change nothing a run computes
    scope: str = "method"

    @property
    def type(self) -> type:
        return type(self.default)

    def describe_range(self) -> str:
        parts = []
        if self.minimum is not None:
            parts.append(f"{'>' if self.exclusive_minimum else '>='} {self.minimum:g}")
        if self.maximum is not None:
            parts.append(f"{'<' if self.exclusive_maximum else '<='} {self.maximum:g}")
        return " and ".join(parts)
