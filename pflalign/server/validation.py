"""Reply validation: what the round loop accepts from a client, as a policy it calls.

Every reply is checked against what its client declared at discovery (its id and sample
counts), the model's keys, shapes and dtypes, finiteness, the range of every count and loss,
and an update-norm bound (against the round's median, or with fewer than three uploads the
recent rounds' accepted norms); a reply that fails is skipped with one
warning naming the client (:class:`ReplyValidator`). :func:`non_finite` tells the round loop
when an aggregate must be rolled back.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pflalign.server.aggregation import FlatSpec
from pflalign.server.runtime import ServerRuntime
from pflalign.wire.messages import Reply
from pflalign.wire.protocol import (
    ARRAYS_FACTOR,
    ARRAYS_SLACK,
    LARGEST,
    LOSS_BOUND_FACTOR,
    MODEL,
    NUM_EXAMPLES,
    NUM_TEST,
    PARTITION_ID,
    Metric,
)
from pflalign.wire.state import ServerState, State, state_key


class ClientFailure(Exception):
    """A reply that cannot be used; the message says which client and why. ``nonfinite_loss``:
    it was refused because a loss it reported is NaN or infinite."""

    def __init__(self, text: str, nonfinite_loss: bool = False):
        super().__init__(text)
        self.nonfinite_loss = nonfinite_loss


@dataclass
class Collected:
    """The usable replies of one exchange, sorted by client id, and how many were not usable:
    ``failed`` (the client raised or did not reply in time; ``timed_out`` of them the latter)
    and ``rejected`` (the reply failed validation)."""

    good: list[tuple[dict[str, float], dict[str, State]]]
    failed: int = 0
    timed_out: int = 0
    rejected: int = 0
    nonfinite_loss: int = 0


class ReplyValidator:
    """The checks every reply meets, for one method entry's server; ``warn`` reports each
    skipped reply in one line naming the client."""

    def __init__(self, server: ServerRuntime, warn: Callable[[str], None]):
        self.server = server
        self.warn = warn

    @property
    def loss_bound(self) -> float:
        """The largest loss a reply may report: :data:`~pflalign.wire.protocol.LOSS_BOUND_FACTOR`
        times log(classes), the cross-entropy of a uniform guess over the task's classes."""
        classes = self.server.num_classes
        return LOSS_BOUND_FACTOR * math.log(classes) if classes > 1 else LARGEST

    def validate(self, reply: Reply, arrays: Mapping[str, FlatSpec],
                 schema: Mapping[str, Metric], records: Collection[str] = (),
                 ) -> tuple[dict[str, float], dict[str, State]]:
        """The reply's metrics and array records, checked against ``schema`` (every metric the
        reply may carry: the required ones must be there, no other may), the array records
        ``arrays`` (required, each of its spec) and ``records`` (allowed, checked by the caller),
        and what the client declared at discovery; :class:`ClientFailure` otherwise."""
        who = reply.who
        if reply.error is not None:
            raise ClientFailure(f"{who} {reply.error}")
        metrics = reply.metrics
        for key, value in metrics.items():  # first: a non-finite loss may mean a broken model
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
                    value):
                known = schema.get(key)
                raise ClientFailure(f"{who} reported a non-finite or non-scalar "
                                    f"{quote(str(key), 60)}: {quote(value)}",
                                    nonfinite_loss=known is not None and known.loss)
        missing = [k for k, m in schema.items() if m.required and k not in metrics]
        if missing:
            raise ClientFailure(f"{who} replied without the metric"
                                f"{'s' if len(missing) > 1 else ''} {quote_names(missing)}")
        unknown = [k for k in metrics if k not in schema]
        if unknown:
            raise ClientFailure(f"{who} replied with {len(unknown)} metric"
                                f"{'s' if len(unknown) > 1 else ''} this action does not have: "
                                f"{quote_names(unknown)}")
        for key, value in metrics.items():
            problem = self._out_of_range(schema[key], value, metrics)
            if problem:
                raise ClientFailure(f"{who} reported {key} = {value:.6g}, {problem}")
        if reply.sender != int(metrics[PARTITION_ID]):
            raise ClientFailure(f"{who} reported partition-id {metrics[PARTITION_ID]}, which "
                                "is not the id it was discovered with")
        info = self.server.clients.get(reply.sender)
        declared = {NUM_EXAMPLES: info.num_train, NUM_TEST: info.num_test} if info else {}
        for key, value in declared.items():
            if key in metrics and metrics[key] != value:
                raise ClientFailure(f"{who} reported {key} = {metrics[key]:g}, but declared "
                                    f"{value} at discovery")
        extra = [name for name in reply.arrays if name not in arrays and name not in records]
        if extra:
            raise ClientFailure(f"{who} replied with {len(extra)} array record"
                                f"{'s' if len(extra) > 1 else ''} this action does not have: "
                                f"{quote_names(extra)}")
        checked: dict[str, State] = {}
        for name, spec in arrays.items():
            if name not in reply.arrays:
                what = "its model arrays" if name == MODEL else f"the array record '{name}'"
                raise ClientFailure(f"{who} replied without {what}")
            problem = spec.problem_with(reply.arrays[name])
            if problem:
                what = "update" if name == MODEL else f"'{name}' record"
                raise ClientFailure(f"{who}'s {what} was rejected: {problem}")
            checked[name] = reply.arrays[name]
        for name in records:
            if name in reply.arrays:
                checked[name] = reply.arrays[name]
        return metrics, checked  # type: ignore[return-value]

    def _out_of_range(self, metric: Metric, value: float, metrics: Mapping[str, float],
                      ) -> str | None:
        """Why ``value`` cannot be this metric (None when it can)."""
        if metric.integer and value != int(value):
            return "expected an integer"
        high = metric.high
        if metric.loss:
            high = min(high, self.loss_bound)
        if metric.count:
            high = min(high, metrics.get(NUM_TEST, 0))
        if not metric.low <= value <= high:
            return f"expected {metric.low:g} .. {high:g}"
        return None

    def collect(self, replies: Iterable[Reply], arrays: Mapping[str, FlatSpec],
                schema: Mapping[str, Metric], records: Collection[str] = ()) -> Collected:
        """The validated (metrics, array records) pairs sorted by client id, and the counts of
        failed and rejected replies; each unusable reply is warned about by client id.
        ``records``: array records a reply may carry beside ``arrays``, checked by the caller
        (an evaluation reply's saved model)."""
        collected = Collected(good=[])
        for reply in replies:
            try:
                collected.good.append(self.validate(reply, arrays, schema, records))
            except ClientFailure as failure:
                self.warn(f"{failure}; the reply is skipped.")
                if reply.error is not None and not reply.refused:
                    collected.failed += 1
                    collected.timed_out += reply.timed_out
                else:
                    collected.rejected += 1
                    collected.nonfinite_loss += failure.nonfinite_loss
        collected.good.sort(key=lambda pair: int(pair[0][PARTITION_ID]))
        return collected


def quote(value: object, limit: int = 120) -> str:
    """``repr(value)``, cut to ``limit`` characters (a warning never echoes a whole reply)."""
    text = repr(value) if not isinstance(value, list | tuple) or len(value) < 64 else (
        f"a {type(value).__name__} of {len(value)} items")
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def quote_names(keys: Sequence[str], shown: int = 5) -> str:
    """A few of ``keys``, quoted and cut short."""
    text = ", ".join(quote(str(k), 60) for k in keys[:shown])
    return text + (f" and {len(keys) - shown} more" if len(keys) > shown else "")


#: the characters a state array's name may use (model keys, field names and their separators)
_NAME = re.compile(r"[A-Za-z0-9_.:#/-]{1,300}")
#: per-tensor optimizer state kept beside a model key (pFLAlign's v and P, GENIE's moments)
_MOMENTS = tuple(state_key("", field) for field in ("v", "P", "m", "s", "step"))


def state_limit(model: Mapping[str, np.ndarray]) -> int:
    """The most bytes a client's saved state (or a reply's arrays) may hold for a run of
    ``model``: :data:`~pflalign.wire.protocol.ARRAYS_FACTOR` x its bytes + ``ARRAYS_SLACK``."""
    return ARRAYS_FACTOR * sum(np.asarray(v).nbytes for v in model.values()) + ARRAYS_SLACK


def state_problem(state_class: type, arrays: Mapping[str, np.ndarray],
                  model: Mapping[str, np.ndarray]) -> str | None:
    """Why ``arrays`` cannot be a client's saved state of ``state_class`` for a run of
    ``model`` (None when it can): a name that is not a field of the class or not a plain name,
    a tensor kept for a model entry with another shape or dtype, a NaN or infinite value, or
    more than :data:`~pflalign.wire.protocol.ARRAYS_FACTOR` x the model's bytes."""
    limit = state_limit(model)
    total = 0
    for name, value in arrays.items():
        if not _NAME.fullmatch(str(name)) or ".." in str(name):
            return f"the array name {quote(str(name), 80)} is not a state name"
        array = np.asarray(value)
        total += array.nbytes
        if total > limit:
            return (f"it holds more than {limit:,} bytes ({ARRAYS_FACTOR} x the model's, "
                    "the most any method keeps)")
        if array.dtype.kind not in "fiub":
            return f"array {quote(str(name), 80)} has dtype {array.dtype}"
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            return f"array {quote(str(name), 80)} contains NaN or infinite values"
        key = str(name).partition("/")[2]
        if key.startswith("#"):
            key = key.partition("/")[2]
        # the model entry the tensor is kept for: its name, or its name and a moment's suffix
        entries = [(key, "")] + [(key[:-len(s)], s) for s in _MOMENTS if key.endswith(s)]
        for entry, suffix in entries:
            if entry in model and not (suffix == state_key("", "step") and array.ndim == 0):
                expected = np.asarray(model[entry])
                if array.shape != expected.shape or (
                        array.dtype.kind == "f" and array.dtype != expected.dtype):
                    return (f"array {quote(str(name), 80)} has shape {array.shape} and dtype "
                            f"{array.dtype}; the model's {quote(entry, 80)} has "
                            f"{expected.shape}, {expected.dtype}")
                break
    try:
        state_class.from_arrays(arrays)  # type: ignore[attr-defined]
    except (ValueError, TypeError, KeyError) as err:
        return f"it is not a {state_class.__name__}: {str(err)[:160]}"
    return None


def float_spec(state: Mapping[str, np.ndarray]) -> FlatSpec:
    """The floating-point entries of ``state``."""
    return FlatSpec.of({k: v for k, v in state.items() if np.asarray(v).dtype.kind == "f"})


def non_finite(state: ServerState) -> str | None:
    """Where ``state`` holds a NaN or infinite value (None when it holds none)."""
    for key, value in state.to_arrays().items():
        value = np.asarray(value)
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            return f"'{key}' holds NaN or infinite values"
    return None
