"""Typed hyperparameters: a method declares a frozen ``Params`` dataclass of :func:`param` fields.

A field's config key is ``<prefix>-<field>`` (underscores become hyphens), e.g. pFLAlign's
``lr`` is ``pflalign-lr``; a field can name its key explicitly (``head-layers`` is shared by FedPer
and FedRep). Defaults, bounds, choices and help live on the field, and the run config's schema,
``simulate.py --help`` and ``docs/`` are derived from them (:func:`options_of`).

:meth:`Params.from_settings` reads a validated config once; learning code then reads attributes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, Self

from pflalign.settings.options import SCOPES, Option, Value


def param(default: Value, help: str, *, key: str | None = None,
          minimum: float | None = None, maximum: float | None = None,
          exclusive_minimum: bool = False, exclusive_maximum: bool = False,
          choices: tuple[str, ...] | None = None, group: str | None = None,
          search: tuple[Value, ...] | None = None, scope: str = "method") -> Any:
    """A hyperparameter field: its default (which fixes its type), help text and checks;
    ``key`` and ``group`` replace the derived config key and its class's group. ``search`` is
    the small grid of values ``simulate.py --tune`` may try for it (None: never tuned).
    ``scope`` says what the key is for (:data:`~pflalign.settings.options.SCOPES`)."""
    if search is not None and not search:
        raise ValueError("A search space needs at least one value.")
    if scope not in SCOPES:
        raise ValueError(f"param scope must be one of {', '.join(SCOPES)}, not {scope!r}.")
    return dataclasses.field(default=default, metadata={"search": search,
        "help": help, "key": key, "group": group, "minimum": minimum, "maximum": maximum,
        "exclusive_minimum": exclusive_minimum, "exclusive_maximum": exclusive_maximum,
        "choices": choices, "scope": scope})


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
    def search_space(cls) -> dict[str, tuple[Value, ...]]:
        """Config key -> the values ``--tune`` may try, for the fields that declare a search."""
        return {cls.key_of(f): tuple(f.metadata["search"])
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
                              scope=meta["scope"]))
        return out


@dataclasses.dataclass(frozen=True)
class NoParams(Params):
    """A method without hyperparameters of its own."""
