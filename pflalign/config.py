"""Run configuration: one schema, the single source of truth for every key and default.

Configs are flat ``key = value`` TOML in Flower's run-config style (hyphenated keys), so the same
file serves ``python simulate.py --config FILE`` and ``flwr run . --run-config FILE``. Values are
``bool``, ``int``, ``float`` or ``str`` (Flower's ``UserConfigValue``); lists are written as
comma-separated strings (``methods = "fedavg,local"``).

Every value is validated here, before any data is read or Ray is started, and every error is one
sentence naming the key, the value and the fix.
"""

from __future__ import annotations

import difflib
import math
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from pflalign.annealing import GGAParams
from pflalign.methods import METHODS, method_overrides
from pflalign.models import MODELS
from pflalign.options import ConfigError, Option, Value
from pflalign.params import Params, param
from pflalign.partition import parse_angles
from pflalign.train import LocalTraining

ENGINES = ("flower", "sequential", "batched")
DATASETS = ("fashion-mnist", "mnist", "cifar10", "cifar100")
PARTITIONS = ("dirichlet", "iid", "pathological", "quantity", "rotated")
AGGREGATIONS = ("mean", "trimmed-mean", "median")
ATTACKS = ("none", "signflip", "scale", "noise", "labelflip", "inflate-count", "fake-eval",
           "hang")


@dataclass(frozen=True)
class RunConfig(Params):
    """The run-wide settings: what runs, on which data and clients, on which engine. A method
    entry may not override those in :data:`RUN_WIDE_KEYS` (the data, the clients, the engine)."""

    methods: str = param(
        'fedavg,fedavg-ft,local,pflalign',
        "Comma-separated methods to run on the same partition and seed, or 'all' (every "
        'method except ablation variants). An entry may carry its own settings: '
        "'pflalign(pflalign-lr=2,pflalign-gamma=one)'.",
        group='run')
    seed: int = param(
        0,
        'Seed for the partition, model initialisation, client sampling and local training; '
        'the same seed and config give the same metrics.',
        minimum=0, group='run')
    rounds: int = param(
        10,
        'Number of federated rounds per method.',
        minimum=1, group='run')
    eval_every: int = param(
        5,
        'Evaluate every N rounds (the last round is always evaluated).',
        minimum=1, group='run')
    out_dir: str = param(
        'results',
        'Directory for results.json (created if missing).',
        group='run')
    dataset: str = param(
        'fashion-mnist',
        'Dataset: fashion-mnist (embedded default, read from '
        '/usr/share/datasets/fashion-mnist or data-root), mnist, cifar10, cifar100 '
        '(torchvision files under data-root).',
        choices=DATASETS, group='data')
    data_root: str = param(
        '',
        "Directory holding the dataset files; empty means the Debian package's directory for "
        'fashion-mnist and ./data for the others.',
        group='data')
    download: bool = param(
        False,
        'Let torchvision download a missing dataset into data-root.',
        group='data')
    max_samples: int = param(
        0,
        'Use a random (seeded) subset of this many samples of the pooled dataset; 0 uses all '
        'of it.',
        minimum=0, group='data')
    partition: str = param(
        'dirichlet',
        'How samples are split across clients: iid, dirichlet (label skew), pathological '
        '(classes-per-client classes each), quantity (power-law client sizes), rotated '
        '(domain shift: client groups with rotated images, dirichlet labels within; see '
        'rotation-angles).',
        choices=PARTITIONS, group='data')
    num_clients: int = param(
        20,
        'Number of training clients (Flower SuperNodes).',
        minimum=1, group='data')
    num_unseen_clients: int = param(
        0,
        'Extra clients that never train and are only evaluated (generalization to new '
        'clients, reported as unseen-acc).',
        minimum=0, group='data')
    rotation_angles: str = param(
        '0,30,60,90',
        'partition=rotated: comma-separated rotation angles in degrees, one per client group '
        '(domain); clients are spread round-robin over the groups.',
        group='data')
    rotation_unseen_groups: int = param(
        1,
        'partition=rotated: the last this many angles are held out: only the unseen clients '
        'come from them (leave-groups-out), so unseen-acc measures generalization to a new '
        'domain. Unused when num-unseen-clients = 0.',
        minimum=0, group='data')
    dirichlet_alpha: float = param(
        0.1,
        'Concentration of the per-class Dirichlet over clients; smaller is more skewed.',
        minimum=0.0, exclusive_minimum=True, group='data')
    classes_per_client: int = param(
        2,
        'Classes each client holds under partition=pathological.',
        minimum=1, group='data')
    quantity_power: float = param(
        1.0,
        'Exponent s of partition=quantity: the k-th largest client holds a share proportional '
        'to k^-s.',
        minimum=0.0, exclusive_minimum=True, group='data')
    min_samples_per_client: int = param(
        10,
        'Smallest number of samples any client may hold; the partitioner retries a bounded '
        'number of times and then fails with a clear error.',
        minimum=2, group='data')
    test_fraction: float = param(
        0.25,
        "Fraction of each client's samples held out as its test split (stratified by label).",
        minimum=0.0, maximum=1.0, exclusive_minimum=True, exclusive_maximum=True, group='data')
    evaluate_on: str = param(
        'test',
        "The split every evaluation reports on: test (each client's test split) or validation "
        "(a split of validation-fraction carved, stratified and seeded, from each client's "
        "training data, which then trains on the rest; the test split is never built). "
        "Tuning (simulate.py --tune) runs its trials with validation.",
        choices=('test', 'validation'), group='data')
    validation_fraction: float = param(
        0.2,
        "evaluate-on = validation: the fraction of each client's training split held out for "
        'validation (at least one sample per client).',
        minimum=0.0, maximum=1.0, exclusive_minimum=True, exclusive_maximum=True, group='data')
    fraction_train: float = param(
        0.4,
        'Fraction of training clients sampled each round (at least one), drawn reproducibly '
        'from seed.',
        minimum=0.0, maximum=1.0, exclusive_minimum=True, group='federation')
    engine: str = param(
        'flower',
        'How the clients run: flower (a Flower simulation on Ray, the same ClientApp and '
        'ServerApp as a deployment), sequential (every client in turn in this process, '
        'without Ray or Flower) or batched (a round\'s clients trained together in this process, '
        'in cohorts of cohort-size, on the GPU when client-resources-num-gpus > 0); the same '
        'metrics.',
        choices=ENGINES, group='simulation')
    cohort_size: int = param(
        64,
        'engine = batched: clients trained or evaluated together in one cohort (their models '
        'and optimizer states are stacked: memory grows with it).',
        minimum=1, group='simulation')
    batched_backend: str = param(
        'auto',
        'engine = batched: how a step computes the cohort\'s gradients: loop (one client at a '
        'time, the sequential engine\'s metrics bit for bit), vmap (one torch.func.vmap call for '
        'the cohort) or auto (vmap on a GPU, loop on the CPU, where it measured faster).',
        choices=('auto', 'loop', 'vmap'), group='simulation')
    memory_budget_gb: float = param(
        1.0,
        'engines sequential and batched: GB of client state (offsets, optimizer states, personal '
        'models) kept in memory; beyond it the least recently used clients\' state is spilled to '
        'files under out-dir and memory-mapped back when needed (0: no cap).',
        minimum=0.0, group='simulation')
    client_resources_num_cpus: float = param(
        1.0,
        "CPU cores per simulated client (Ray resource; also the client's torch thread count).",
        minimum=0.0, exclusive_minimum=True, group='simulation')
    client_resources_num_gpus: float = param(
        0.0,
        'GPUs per simulated client (fractions share a GPU); clients use cuda when this is > 0 '
        'and a GPU exists.',
        minimum=0.0, group='simulation')
    round_timeout: float = param(
        600.0,
        'Seconds the server waits for a round\'s replies; a client that has not replied by then '
        'counts as failed (the server names the clients it waits for every 30 s).',
        minimum=0.0, exclusive_minimum=True, group='robustness')
    aggregation: str = param(
        'mean',
        'How client models are combined, for every method that averages models: mean '
        '(weighted by num-examples), trimmed-mean (per coordinate, dropping trim-fraction of '
        'the values at each end; unweighted) or median (per coordinate; unweighted). Yin et '
        'al. 2018, "Byzantine-robust distributed learning".',
        choices=AGGREGATIONS, group='robustness')
    trim_fraction: float = param(
        0.2,
        'aggregation=trimmed-mean: fraction of the clients\' values dropped at each end of '
        'every coordinate.',
        minimum=0.0, maximum=0.5, exclusive_maximum=True, group='robustness')
    update_norm_bound: float = param(
        10.0,
        'Reject a training reply whose update (its model minus the global model) has a norm '
        'above this many times the round\'s median update norm; 0 turns the check off.',
        minimum=0.0, group='robustness')
    client_failure_rate: float = param(
        0.0,
        'Fault injection: probability that a sampled client\'s training call raises (seeded '
        'by seed, round and client).',
        minimum=0.0, maximum=1.0, exclusive_maximum=True, group='robustness')
    client_dropout_rate: float = param(
        0.0,
        'Fault injection: probability that a sampled client does not reply to training before '
        'round-timeout (seeded by seed, round and client).',
        minimum=0.0, maximum=1.0, exclusive_maximum=True, group='robustness')
    malicious_clients: int = param(
        0,
        'Fault injection: how many training clients (chosen by seed) run the attack.',
        minimum=0, group='robustness')
    attack: str = param(
        'none',
        'What malicious clients do: signflip (upload the global model minus their update), '
        'scale (the global model plus attack-scale times their update), noise (a random update '
        'of attack-scale times their update\'s norm), labelflip (train on labels c -> C-1-c), '
        'inflate-count (report attack-scale times their num-examples), fake-eval (report '
        'attack-scale times their num-test, all correct), hang (never reply).',
        choices=ATTACKS, group='robustness')
    attack_scale: float = param(
        10.0,
        'The factor of attack=scale, noise, inflate-count and fake-eval.',
        minimum=0.0, exclusive_minimum=True, group='robustness')
    model: str = param(
        'cnn',
        "Model: cnn (PFLlib's 4-layer CNN), cnn-bn (the same with batch norm), mlp, resnet18.",
        choices=tuple(MODELS), group='train')
    checkpoint_every: int = param(
        5,
        'Write a checkpoint (server state, every client\'s state, the finished rounds) every N '
        'rounds, so that `simulate.py --resume DIR` continues a killed run exactly; 0 = never.',
        minimum=0, group='run')


def _method_options() -> list[Option]:
    """The keys of every registered method's Params; a key shared by several methods (e.g.
    ``head-layers``) is declared once, identically."""
    seen: dict[str, Option] = {}
    for spec in METHODS.values():
        for option in spec.method.Params.options():
            if option.key in seen and seen[option.key] != option:
                raise RuntimeError(f"Config key '{option.key}' is declared differently by two "
                                   "methods' Params.")
            seen.setdefault(option.key, option)
    return list(seen.values())


#: the run config's schema, derived from the dataclasses that declare the keys
OPTIONS: tuple[Option, ...] = (*RunConfig.options(), *LocalTraining.options(), *_method_options(),
                               *GGAParams.options())

OPTIONS_BY_KEY: dict[str, Option] = {o.key: o for o in OPTIONS}


def defaults() -> dict[str, Value]:
    """Every key with its default value, in schema order."""
    return {o.key: o.default for o in OPTIONS}


def _unknown_key_error(key: str, source: str) -> ConfigError:
    close = difflib.get_close_matches(key, OPTIONS_BY_KEY, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else "; see `simulate.py --print-config`."
    return ConfigError(f"Unknown config key '{key}' in {source}{hint}")


def coerce(key: str, value: object, source: str = "the config") -> Value:
    """Check one value against its option's type, choices and range; return it in the right type."""
    if key not in OPTIONS_BY_KEY:
        raise _unknown_key_error(key, source)
    opt = OPTIONS_BY_KEY[key]
    want = opt.type
    if want is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"Config key '{key}' expects true or false, got {value!r} "
                              f"(from {source}).")
    elif want is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"Config key '{key}' expects an integer, got {value!r} "
                              f"(from {source}).")
    elif want is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"Config key '{key}' expects a number, got {value!r} "
                              f"(from {source}).")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"Config key '{key}' must be finite, got {value!r} "
                              f"(from {source}).")
    elif not isinstance(value, str):
        raise ConfigError(f"Config key '{key}' expects a string, got {value!r} (from {source}).")

    choices = opt.choices
    if choices is not None and value not in choices:
        raise ConfigError(f"Config key '{key}' = {value!r} is not one of: "
                          f"{', '.join(choices)} (from {source}).")
    if isinstance(value, int | float) and not isinstance(value, bool):
        too_low = opt.minimum is not None and (
            value <= opt.minimum if opt.exclusive_minimum else value < opt.minimum)
        too_high = opt.maximum is not None and (
            value >= opt.maximum if opt.exclusive_maximum else value > opt.maximum)
        if too_low or too_high:
            raise ConfigError(f"Config key '{key}' = {value!r} is out of range: it must be "
                              f"{opt.describe_range()} (from {source}).")
    return value


# Keys a method entry may not override: they define the shared data, clients and engine.
RUN_WIDE_KEYS = ("methods", "seed", "out-dir", "dataset", "data-root", "download", "max-samples",
                 "partition", "num-clients", "num-unseen-clients", "dirichlet-alpha",
                 "rotation-angles", "rotation-unseen-groups",
                 "classes-per-client", "quantity-power", "min-samples-per-client",
                 "test-fraction", "evaluate-on", "validation-fraction", "engine", "cohort-size",
                 "batched-backend", "memory-budget-gb",
                 "client-resources-num-cpus",
                 "client-resources-num-gpus", "round-timeout", "client-failure-rate",
                 "client-dropout-rate", "malicious-clients", "attack", "attack-scale")


@dataclass(frozen=True)
class MethodChoice:
    """One entry of 'methods': a registered method, optionally with its own config overrides.

    Written ``name`` or ``name(key=value, key=value)``, e.g. ``pflalign(pflalign-lr=2)``; the
    whole entry is its label in tables and results.
    """

    label: str
    name: str
    overrides: tuple[tuple[str, Value], ...] = ()


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for char in text:
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0:
            raise ConfigError(f"Config key 'methods' has an unmatched ')': {text!r}.")
        current.append(char)
    if depth:
        raise ConfigError(f"Config key 'methods' has an unclosed '(': {text!r}.")
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _parse_method_entry(entry: str) -> MethodChoice:
    name, _, rest = entry.partition("(")
    name = name.strip()
    if name not in METHODS:
        close = difflib.get_close_matches(name, METHODS, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"Unknown method '{name}' in 'methods'; known methods: "
                          f"{', '.join(METHODS)}.{hint}")
    overrides: list[tuple[str, Value]] = []
    if rest:
        if not rest.rstrip().endswith(")"):
            raise ConfigError(f"Method entry {entry!r} must end with ')'.")
        for item in _split_top_level(rest.rstrip()[:-1]):
            key, value = parse_override(item)
            if key in RUN_WIDE_KEYS:
                raise ConfigError(f"Method entry {entry!r} overrides '{key}', which is shared by "
                                  "all methods of a run; set it for the whole run instead.")
            overrides.append((key, value))
    label = name if not overrides else (
        f"{name}(" + ",".join(f"{k}={toml_literal(v)}" for k, v in overrides) + ")")
    return MethodChoice(label=label, name=name, overrides=tuple(overrides))


def parse_methods(text: str) -> list[MethodChoice]:
    """Parse 'methods': comma-separated entries, or 'all' (every method but ablation variants)."""
    entries = _split_top_level(text)
    if not entries:
        raise ConfigError("Config key 'methods' is empty; name at least one method, e.g. "
                          "'fedavg'.")
    if entries == ["all"]:
        return [MethodChoice(label=name, name=name) for name, spec in METHODS.items()
                if spec.variant_of is None]
    choices = [_parse_method_entry(entry) for entry in entries]
    labels = [c.label for c in choices]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"Config key 'methods' lists a method twice: {text!r}.")
    return choices


class Settings(Mapping[str, Value]):
    """A complete, validated configuration (every key of the schema present and checked).

    The typed views (:attr:`run`, :attr:`training`, :attr:`gga`, and a method's Params through
    its registry entry) are what code reads; the mapping is the edge, for files and messages."""

    __slots__ = ("_values", "run", "training", "gga")

    def __init__(self, values: Mapping[str, object] | None = None, source: str = "the config"):
        merged: dict[str, Value] = defaults()
        for key, value in (values or {}).items():
            merged[key] = coerce(key, value, source)
        _check_cross_keys(merged)
        self._values = merged
        #: the run-wide settings
        self.run = RunConfig.from_settings(merged)
        #: the run's local training (an entry's own, after its overrides)
        self.training = LocalTraining.from_settings(merged)
        #: the GGA warm start
        self.gga = GGAParams.from_settings(merged)

    def __getitem__(self, key: str) -> Value:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Settings({self._values!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Settings) and self._values == other._values

    def __hash__(self) -> int:
        return hash(tuple(self._values.items()))

    def to_dict(self) -> dict[str, Value]:
        return dict(self._values)

    def replace(self, changes: Mapping[str, object], source: str = "an override") -> Settings:
        """A new Settings with some keys changed (and everything re-validated)."""
        return Settings({**self._values, **changes}, source=source)

    @property
    def methods(self) -> list[str]:
        """The labels of the methods to run, in order."""
        return [choice.label for choice in self.method_choices]

    @property
    def method_choices(self) -> list[MethodChoice]:
        return parse_methods(str(self["methods"]))

    @property
    def num_nodes(self) -> int:
        """Number of Flower SuperNodes: the training clients plus the unseen clients."""
        return self.run.num_clients + self.run.num_unseen_clients


def _check_cross_keys(values: Mapping[str, Value]) -> None:
    if values["gga"] and values["gga-end"] < values["gga-start"]:
        raise ConfigError(f"gga-end = {values['gga-end']} is before gga-start = "
                          f"{values['gga-start']}; the annealing window is gga-start..gga-end.")
    if values["partition"] == "rotated":
        angles = parse_angles(str(values["rotation-angles"]))
        held_out = int(values["rotation-unseen-groups"]) if values["num-unseen-clients"] else 0
        if held_out >= len(angles):
            raise ConfigError(f"rotation-unseen-groups = {held_out} leaves no angle of "
                              f"rotation-angles = {values['rotation-angles']!r} for the training "
                              "clients; hold out fewer groups or add angles.")
    if values["malicious-clients"] > values["num-clients"]:
        raise ConfigError(f"malicious-clients = {values['malicious-clients']} exceeds "
                          f"num-clients = {values['num-clients']}.")
    if (values["malicious-clients"] > 0) != (values["attack"] != "none"):
        raise ConfigError(f"malicious-clients = {values['malicious-clients']} and attack = "
                          f"{values['attack']!r} do not go together: set both (some clients and "
                          "what they do) or neither.")
    if values["client-failure-rate"] + values["client-dropout-rate"] >= 1:
        raise ConfigError("client-failure-rate + client-dropout-rate must be below 1, got "
                          f"{values['client-failure-rate'] + values['client-dropout-rate']:g}.")
    refusing, not_robust = [], []
    for choice in parse_methods(str(values["methods"])):
        spec = METHODS[choice.name]
        overrides = method_overrides(spec, values, dict(choice.overrides))
        if (overrides.get("aggregation", values["aggregation"]) != "mean"
                and not spec.method.robust_aggregation):
            not_robust.append(choice.label)
        if not spec.local_optimizer and overrides.get(
                "local-optimizer", values["local-optimizer"]) != "sgd":
            refusing.append(choice.label)
    if not_robust:
        raise ConfigError(f"aggregation = {values['aggregation']!r} is not defined for "
                          f"{', '.join(not_robust)}: its server update is not an average of "
                          "models; use aggregation = 'mean' for it, e.g. "
                          "'scaffold(aggregation=mean)'.")
    if refusing:
        raise ConfigError(f"local-optimizer = {values['local-optimizer']!r} does not apply to "
                          f"{', '.join(refusing)} (own local update rule); set it per method "
                          "instead, e.g. 'fedavg(local-optimizer=genie)', or use pflalign-genie.")


def load_toml(path: str | Path) -> dict[str, Value]:
    """Read a flat run-config TOML file (no tables); unknown keys are reported by Settings."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Config file '{path}' does not exist; pass an existing TOML file to "
                          "--config.")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"Config file '{path}' is not valid TOML: {err}.") from err
    for key, value in data.items():
        if isinstance(value, dict | list):
            raise ConfigError(f"Config file '{path}': key '{key}' holds a table or list; run "
                              "configs are flat 'key = value' pairs (write lists as "
                              "comma-separated strings).")
    return data


def parse_override(text: str) -> tuple[str, Value]:
    """Parse one ``key=value`` override. Values are TOML literals; string keys take the raw text."""
    if "=" not in text:
        raise ConfigError(f"Override '{text}' is not of the form key=value.")
    key, raw = (part.strip() for part in text.split("=", 1))
    if key not in OPTIONS_BY_KEY:
        raise _unknown_key_error(key, f"--set {text}")
    if OPTIONS_BY_KEY[key].type is str:
        if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
            raw = raw[1:-1]
        return key, raw
    try:
        value: object = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # not a TOML literal: coerce() reports the type mismatch
    return key, coerce(key, value, f"--set {text}")


def resolve(config_file: str | Path | None = None, overrides: Iterable[str] = (),
            extra: Mapping[str, object] | None = None) -> Settings:
    """Defaults, then the config file, then ``--set`` overrides, then ``extra`` (e.g. --methods)."""
    values: dict[str, object] = {}
    source = "the defaults"
    if config_file is not None:
        values.update(load_toml(config_file))
        source = str(config_file)
    settings = Settings(values, source=source)
    changes = dict(parse_override(text) for text in overrides)
    changes.update(extra or {})
    return settings.replace(changes, source="the command line") if changes else settings


def format_settings(settings: Mapping[str, Value]) -> str:
    """TOML text of a full config, grouped and commented, suitable as a config file."""
    lines: list[str] = []
    group = None
    for opt in OPTIONS:
        if opt.group != group:
            group = opt.group
            lines.append(f"\n# --- {group} ---")
        lines.append(f"# {opt.help}")
        lines.append(f"{opt.key} = {toml_literal(settings[opt.key])}")
    return "\n".join(lines).lstrip("\n") + "\n"


def toml_literal(value: Value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float):
        return repr(value)
    return str(value)
