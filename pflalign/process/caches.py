"""Process-wide caches, in one place, with one reset.

What a process reads or builds once and reuses (the pooled dataset and its partition, a node's
partition file, the run's model template, parsed settings) is memoised with :func:`cached`,
which registers the cache here. :func:`reset` empties them all: for a test that changes the
files behind a cache, or a long-lived process that moves to another run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

_CACHES: list[functools._lru_cache_wrapper] = []


def cached(maxsize: int | None = 128) -> Callable[[F], F]:
    """``functools.lru_cache(maxsize)``, registered for :func:`reset`."""
    def wrap(function: F) -> F:
        memo = functools.lru_cache(maxsize=maxsize)(function)
        _CACHES.append(memo)
        return memo  # type: ignore[return-value]

    return wrap


def reset() -> None:
    """Empty every process-wide cache."""
    for memo in _CACHES:
        memo.cache_clear()
