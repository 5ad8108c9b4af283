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
class OnlyWith:
    """A rule "this key only with ``key`` = one of ``values``" (or a value starting with
    ``prefix``): otherwise the key must keep its default. The refusal, the help text's last
    sentence, the docs and the key lists of a config section are all derived from it
    (:func:`pflalign.run.config.check_only_with`).

    The refusal reads ``"<this key> = <value> <why>: <fix>."``; ``why`` and ``fix`` may name
    ``{other}``, the value of ``key``, and ``{name}``, this key; ``shown`` is how the value is
    written (``"r"``: repr, ``"g"``: a number's shortest form)."""

    key: str
    values: tuple[Value, ...] = ()
    #: a prefix, or several (``("hf:", "csv:")``)
    prefix: str | tuple[str, ...] = ""
    #: or: every value of ``key`` but these
    besides: tuple[Value, ...] = ()
    why: str = ""
    fix: str = ""
    shown: str = "r"

    def allows(self, other: Value) -> bool:
        """Whether ``key`` = ``other`` lets this key be set."""
        if self.besides:
            return other not in self.besides
        return other in self.values or bool(self.prefix and str(other).startswith(self.prefix))

    @property
    def prefixes(self) -> tuple[str, ...]:
        return (self.prefix,) if isinstance(self.prefix, str) and self.prefix else (
            tuple(self.prefix) if self.prefix else ())

    def describe(self) -> str:
        """The help text's sentence: ``Only with dp = central or local.``"""
        if self.besides:
            return f"Only with {self.key} other than {' or '.join(map(str, self.besides))}."
        named = [str(v).lower() if isinstance(v, bool) else str(v) for v in self.values]
        named += [f"{p}<...>" for p in self.prefixes]
        return f"Only with {self.key} = {' or '.join(named)}."

    def refusal(self, name: str, value: Value, other: Value) -> str:
        """The one sentence that refuses ``name = value`` while ``key = other``."""
        shown = format(value, "g") if self.shown == "g" and not isinstance(value, str) else (
            repr(value))
        why, fix = (text.format(other=repr(other), name=name) for text in (self.why, self.fix))
        return f"{name} = {shown} {why}: {fix}."


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
    #: the rules "only with ..." this key keeps (:class:`OnlyWith`), checked in order
    only_with: tuple[OnlyWith, ...] = ()

    @property
    def type(self) -> type:
        return type(self.default)

    @property
    def full_help(self) -> str:
        """The help text, with a sentence per "only with" rule: what ``--help``, the docs and
        a printed config show."""
        return " ".join([self.help, *(rule.describe() for rule in self.only_with)])

    def describe_range(self) -> str:
        parts = []
        if self.minimum is not None:
            parts.append(f"{'>' if self.exclusive_minimum else '>='} {self.minimum:g}")
        if self.maximum is not None:
            parts.append(f"{'<' if self.exclusive_maximum else '<='} {self.maximum:g}")
        return " and ".join(parts)
