"""Typed hyperparameters: a method declares a frozen ``Params`` dataclass of :func:`param` fields.

A field's config key is ``<prefix>-<field>`` (underscores become hyphens), e.g. pFLAlign's
``lr`` is ``pflalign-lr``; a field can name its key explicitly (``head-layers`` is shared by FedPer
and FedRep). Defaults, bounds, choices and help live on the field, and the run config's schema,
``simulate.py --help`` and ``docs/`` are derived from them (:func:`options_of`).

:meth:`Params.from_settings` reads a validated config once; learning code then reads attributes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar, Self

from pflalign.settings.options import SCOPES, OnlyWith, Option, Value

#: a tuned value this close to an end of its range, as a share of the range's width (log scale
#: for a log range), is flagged: the optimum may lie beyond the range
EDGE_MARGIN = 0.05


@dataclasses.dataclass(frozen=True)
class Search:
    """What ``simulate.py --tune`` may try for a key: a continuous range ``[low, high]``, sampled
    on a log scale when ``log`` (learning rates, penalty weights: :func:`log_range`), or a set of
    ``choices`` (:func:`choice`). Optuna's distributions are built from it
    (:mod:`pflalign.run.tuning`)."""

    low: float | None = None
    high: float | None = None
    log: bool = False
    choices: tuple[Value, ...] = ()

    def __post_init__(self) -> None:
        if self.choices:
            if self.low is not None or self.high is not None:
                raise ValueError("A search is a range or a set of choices, not both.")
            if len(set(self.choices)) != len(self.choices):
                raise ValueError("A search's choices must differ.")
            return
        if self.low is None or self.high is None or not self.low < self.high:
            raise ValueError("A search range needs low < high.")
        if self.log and self.low <= 0:
            raise ValueError("A log-scaled search range needs low > 0.")

    def contains(self, value: Value) -> bool:
        """Whether ``value`` is a point of the space (a method's default starts the search
        only then)."""
        if self.choices:
            return value in self.choices
        return (isinstance(value, int | float) and not isinstance(value, bool)
                and self.low <= value <= self.high)  # type: ignore[operator]

    def describe(self) -> str:
        """``log-uniform [0.005, 0.2]``, ``uniform [0.8, 0.95]`` or ``{0.0, 0.1, 1.0}``."""
        if self.choices:
            return "{" + ", ".join(map(str, self.choices)) + "}"
        return f"{'log-uniform' if self.log else 'uniform'} [{self.low:g}, {self.high:g}]"

    def edge(self, value: Value, margin: float = EDGE_MARGIN) -> str | None:
        """``'low'`` or ``'high'`` when ``value`` lies within ``margin`` of the range's width of
        that end (the width in log scale for a log range), else None; a set of choices has no
        edge. A tuned choice there may be held back by the range rather than by the method."""
        if self.choices or not isinstance(value, int | float) or isinstance(value, bool):
            return None
        lo, hi, at = float(self.low), float(self.high), float(value)  # type: ignore[arg-type]
        if self.log:
            if at <= 0:
                return None
            lo, hi, at = math.log(lo), math.log(hi), math.log(at)
        where = (at - lo) / (hi - lo)
        return "low" if where <= margin else "high" if where >= 1 - margin else None

    @classmethod
    def parse(cls, text: str) -> Search | None:
        """The range that :meth:`describe` wrote as ``text`` (``log-uniform [0.005, 0.2]``), or
        None for a set of choices or anything else."""
        scale, _, bounds = text.strip().partition(" ")
        if scale not in ("uniform", "log-uniform") or not (
                bounds.startswith("[") and bounds.endswith("]")):
            return None
        try:
            low, high = (float(b) for b in bounds[1:-1].split(","))
            return cls(low, high, log=scale == "log-uniform")
        except ValueError:
            return None

    def to_json(self) -> dict[str, object]:
        if self.choices:
            return {"choices": list(self.choices)}
        return {"low": self.low, "high": self.high, "log": self.log}


def edges(space: Mapping[str, object], chosen: Mapping[str, Value]) -> dict[str, str]:
    """Each tuned key whose chosen value lies at an end of its range (:meth:`Search.edge`):
    key -> ``'low'`` or ``'high'``. ``space`` holds the searches or, as results record them,
    their descriptions (a grid of values, as studies recorded before Optuna tuned, has no
    edge)."""
    found = {}
    for key, search in space.items():
        if not isinstance(search, Search):
            search = Search.parse(search) if isinstance(search, str) else None
        side = search.edge(chosen[key]) if search is not None and key in chosen else None
        if side:
            found[key] = side
    return found


def log_range(low: float, high: float) -> Search:
    """A continuous search over ``[low, high]``, sampled uniformly in log scale."""
    return Search(float(low), float(high), log=True)


def uniform_range(low: float, high: float) -> Search:
    """A continuous search over ``[low, high]``, sampled uniformly."""
    return Search(float(low), float(high))


def choice(*values: Value) -> Search:
    """A search over a fixed set of values."""
    return Search(choices=tuple(values))


def param(default: Value, help: str, *, key: str | None = None,
          minimum: float | None = None, maximum: float | None = None,
          exclusive_minimum: bool = False, exclusive_maximum: bool = False,
          choices: tuple[str, ...] | None = None, group: str | None = None,
          search: Search | None = None, scope: str = "method",
          only_with: OnlyWith | tuple[OnlyWith, ...] = ()) -> Any:
    """A hyperparameter field: its default (which fixes its type), help text and checks;
    ``key`` and ``group`` replace the derived config key and its class's group. ``search`` is
    the declared space ``simulate.py --tune`` searches for it (None: never tuned).
    ``scope`` says what the key is for (:data:`~pflalign.settings.options.SCOPES`);
    ``only_with``: the rules under which it may leave its default
    (:class:`~pflalign.settings.options.OnlyWith`)."""
    if search is not None and not isinstance(search, Search):
        raise ValueError("A search space is a Search (log_range, uniform_range or choice).")
    if scope not in SCOPES:
        raise ValueError(f"param scope must be one of {', '.join(SCOPES)}, not {scope!r}.")
    return dataclasses.field(default=default, metadata={"search": search,
        "help": help, "key": key, "group": group, "minimum": minimum, "maximum": maximum,
        "exclusive_minimum": exclusive_minimum, "exclusive_maximum": exclusive_maximum,
        "choices": choices, "scope": scope,
        "only_with": only_with if isinstance(only_with, tuple) else (only_with,)})


class Params:
    """Mixin for a frozen dataclass of :func:`param` fields."""

    #: the config-key prefix of the fields (usually the method's name)
    prefix: ClassVar[str] = ""
    #: the group the keys are listed under in ``--print-config`` and the docs
    group: ClassVar[str] = ""

    @classmethod
    def key_of(cls, field: dataclasses.Field) -> str:
        explicit = field.metadata.get("key")
        if explicit:
            return explicit
        name = field.name.rstrip("_").replace("_", "-")
        return f"{cls.prefix}-{name}" if cls.prefix else name

    @classmethod
    def keys(cls) -> dict[str, str]:
        """Field name -> config key."""
        return {f.name: cls.key_of(f) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]

    @classmethod
    def from_settings(cls, settings: Mapping[str, Value]) -> Self:
        """The fields' values from a validated config (every key present)."""
        return cls(**{name: settings[key] for name, key in cls.keys().items()})

    @classmethod
    def search_space(cls) -> dict[str, Search]:
        """Config key -> the space ``--tune`` searches, for the fields that declare one."""
        return {cls.key_of(f): f.metadata["search"]
                for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                if f.metadata.get("search") is not None}

    @classmethod
    def options(cls) -> list[Option]:
        """The config schema's entries for these fields."""
        out = []
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            meta = f.metadata
            group = meta["group"] or cls.group or cls.prefix
            out.append(Option(cls.key_of(f), f.default, meta["help"], group,
                              choices=meta["choices"], minimum=meta["minimum"],
                              maximum=meta["maximum"],
                              exclusive_minimum=meta["exclusive_minimum"],
                              exclusive_maximum=meta["exclusive_maximum"],
                              scope=meta["scope"], only_with=meta["only_with"]))
        return out


@dataclasses.dataclass(frozen=True)
class NoParams(Params):
    """A method without hyperparameters of its own."""
