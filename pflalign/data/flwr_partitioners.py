"""flwr-datasets' partitioners: ``partition = flwr:<Partitioner>``, with ``partition-args``.

The partitioner is flwr-datasets' own class of that name (``DirichletPartitioner``,
``IidPartitioner``, ``ShardPartitioner``, ``PathologicalPartitioner``, ...), built with the
user's arguments (``partition-args``: ``alpha=0.5,min_partition_size=5``) and three that pflalign
gives where the class takes them: ``num_partitions`` (num-clients + num-unseen-clients),
``partition_by`` (the labels' column) and ``seed`` (the run's). It is given a
``datasets.Dataset`` of the pool's labels (column ``label``) and each row's place in the pool
(column ``row``), and each client's rows are read back through its public ``load_partition``;
they are then split into train and test as every other partition's are.

flwr-datasets is an optional extra, ``pip install "pflalign[flwr-partitioners]"``: every release
of it requires ``datasets < 5``, whose releases require ``huggingface_hub < 2``, so it is kept
out of the ``hf`` and ``test`` extras (which take ``datasets`` 5 beside the language models'
``huggingface_hub`` 2).
"""

from __future__ import annotations

import inspect
import tomllib

import numpy as np

from pflalign.settings.options import ConfigError

FLWR = "flwr:"
INSTALL = 'pip install "pflalign[flwr-partitioners]"'
#: the columns of the table a partitioner is given
LABEL, ROW = "label", "row"
#: the arguments pflalign gives a partitioner itself, and what it gives
_GIVEN = {"num_partitions": "num-clients + num-unseen-clients", "partition_by": "the labels",
          "seed": "the run's seed"}


def is_flwr(scheme: str) -> bool:
    """Whether ``partition`` names a flwr-datasets partitioner."""
    return scheme.startswith(FLWR)


def partitioner_class(scheme: str) -> type:
    """flwr-datasets' partitioner class that ``partition = flwr:NAME`` names, or one sentence."""
    name = scheme[len(FLWR):].strip()
    if not name:
        raise ConfigError("partition = 'flwr:' needs a partitioner's class name: partition = "
                          "'flwr:DirichletPartitioner'.")
    try:
        from flwr_datasets import partitioner as module
    except ImportError:
        raise ConfigError(f"partition = {scheme!r} uses flwr-datasets, which is not installed: "
                          f"{INSTALL}.") from None
    base = module.Partitioner
    known = sorted(n for n in dir(module) if n != "Partitioner" and isinstance(
        getattr(module, n), type) and issubclass(getattr(module, n), base))
    if name not in known:
        raise ConfigError(f"partition = {scheme!r}: flwr-datasets has no partitioner {name!r}; "
                          f"choose one of {', '.join(known)}.")
    return getattr(module, name)


def _split_pairs(text: str) -> list[str]:
    """``text`` cut at the commas outside brackets and quotes."""
    parts, current, depth, quote = [], [], 0, ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def parse_args(text: str) -> dict[str, object]:
    """``partition-args``: comma-separated ``name=value`` pairs, each value a TOML literal
    (``0.5``, ``10``, ``true``, ``"random"``, ``[0.1, 0.2]``) or else a bare word (``random``)."""
    args: dict[str, object] = {}
    for item in _split_pairs(text):
        name, sep, raw = (part.strip() for part in item.partition("="))
        if not sep or not name.isidentifier() or not raw:
            raise ConfigError(f"partition-args = {text!r}: {item!r} is not name=value; write "
                              "them as 'alpha=0.5,min_partition_size=5'.")
        if name in args:
            raise ConfigError(f"partition-args = {text!r} gives {name!r} twice; give it once.")
        try:
            args[name] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            args[name] = raw  # a bare word
    return args


def _arguments(cls: type, scheme: str, text: str, total: int, seed: int) -> dict[str, object]:
    """The user's arguments and pflalign's, each one the class takes, or one sentence."""
    args = parse_args(text)
    for key in args:
        if key in _GIVEN:
            raise ConfigError(f"partition-args gives {key}, which pflalign gives "
                              f"{cls.__name__} itself ({_GIVEN[key]}); leave it out.")
    params = {n: p for n, p in inspect.signature(cls.__init__).parameters.items()
              if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    takes_any = any(p.kind is p.VAR_KEYWORD
                    for p in inspect.signature(cls.__init__).parameters.values())
    unknown = [k for k in args if k not in params]
    if unknown and not takes_any:
        accepted = [n for n in params if n not in _GIVEN]
        raise ConfigError(f"partition-args: {cls.__name__} takes no argument {unknown[0]!r}; it "
                          f"takes {', '.join(accepted) or 'none'}.")
    given = {"num_partitions": total, "partition_by": LABEL, "seed": seed}
    full = {**args, **{k: v for k, v in given.items() if k in params}}
    missing = [n for n, p in params.items() if p.default is p.empty and n not in full]
    if missing:
        raise ConfigError(f"partition = {scheme!r} needs {', '.join(missing)}: give "
                          f"{'it' if len(missing) == 1 else 'them'} in partition-args, e.g. "
                          f"partition-args = '{missing[0]}=...'.")
    return full


def build_partitioner(scheme: str, text: str, total: int, seed: int):
    """The partitioner ``partition = flwr:NAME`` and ``partition-args`` describe, for ``total``
    clients and the run's ``seed``: built (its arguments checked), not yet given data."""
    cls = partitioner_class(scheme)
    full = _arguments(cls, scheme, text, total, seed)
    try:
        return cls(**full)
    except Exception as err:  # a third party's checks of its arguments: any error is theirs
        raise ConfigError(f"partition = {scheme!r} refuses partition-args = {text!r} "
                          f"({type(err).__name__}: {err}); change partition-args.") from None


def check_flwr_partition(scheme: str, text: str, total: int, seed: int) -> None:
    """At config time: the partitioner exists and takes these arguments (nothing is read)."""
    build_partitioner(scheme, text, total, seed)


def flwr_partition(labels: np.ndarray, total: int, scheme: str, text: str, seed: int,
                   min_samples: int) -> list[np.ndarray]:
    """Each client's rows of the pool (``labels``), as flwr-datasets' partitioner gives them
    (its ``load_partition(i)`` for client ``i``), sorted."""
    from pflalign.data.hf_source import column_values, library

    partitioner = build_partitioner(scheme, text, total, seed)
    datasets = library()
    table = datasets.Dataset.from_dict({LABEL: np.asarray(labels, dtype=np.int64),
                                        ROW: np.arange(len(labels), dtype=np.int64)})
    try:
        partitioner.dataset = table
        made = partitioner.num_partitions
        if made != total:
            raise ConfigError(f"partition = {scheme!r} makes {made} partitions and the run has "
                              f"{total} clients (num-clients + num-unseen-clients); make them "
                              "agree.")
        parts = [np.sort(column_values(partitioner.load_partition(i), ROW).astype(np.int64))
                 for i in range(total)]
    except ConfigError:
        raise
    except Exception as err:  # the partitioner's own refusal of this data and these arguments
        raise ConfigError(f"partition = {scheme!r} could not split the {len(labels)} samples "
                          f"over {total} clients ({type(err).__name__}: {err}); change "
                          "partition-args or num-clients.") from None
    assigned = np.concatenate(parts)
    if len(np.unique(assigned)) != len(assigned):
        raise ConfigError(f"partition = {scheme!r} gives some samples to more than one client; "
                          "choose a partitioner that splits the samples.")
    smallest = int(np.argmin([len(p) for p in parts]))
    if len(parts[smallest]) < min_samples:
        raise ConfigError(f"partition = {scheme!r} leaves client {smallest} with "
                          f"{len(parts[smallest])} samples, below min-samples-per-client = "
                          f"{min_samples}; change partition-args or num-clients, or lower "
                          "min-samples-per-client.")
    return parts
