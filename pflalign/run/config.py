"""The config parser: files, overrides and method entries in, a validated :class:`Settings` out.

The schema is the declarations' (:mod:`pflalign.settings.schema` and each method's ``Params``).
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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pflalign.data.clients import CLIENTS, clients_kind, parse_input_shape
from pflalign.data.datasets import CHARACTERS
from pflalign.data.flwr_partitioners import check_flwr_partition, is_flwr
from pflalign.data.hf_source import HF, hf_target, local_folder
from pflalign.data.instructions import JSONL, jsonl_path
from pflalign.data.partition import parse_angles
from pflalign.data.sources import (
    IMAGEFOLDER,
    NPZ,
    TABLES,
    TEXT,
    check_dataset_name,
    dataset_kind,
    folder_of,
    has_natural_clients,
    npz_path,
    table_path,
)
from pflalign.methods.registry import METHODS, method_overrides
from pflalign.models import user
from pflalign.models.language import SMOLLM2, is_language_model, source_of
from pflalign.models.registry import MODELS
from pflalign.models.user import is_user_model
from pflalign.outputs.tracking import parse_tracking
from pflalign.server.buffered import async_sizes
from pflalign.server.clock import LOGNORMAL, TRACE, check_profiles_key, read_trace, read_windows
from pflalign.server.clock import NONE as NONE_PROFILES
from pflalign.server.privacy import count_noise, run_noise_multiplier
from pflalign.server.sampling import expected_clients
from pflalign.settings.options import ConfigError, Option, Value
from pflalign.settings.schema import (
    COLLUDING_ATTACKS,
    DATASETS,
    FEATURES,
    FOLLOW_DATA,
    IMAGE,
    RUN_WIDE_KEYS,
    TOKENS,
    GGAParams,
    LocalTraining,
    RunConfig,
    Settings,
)
from pflalign.training.scores import SCORES, require_sklearn


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


def _is_choice(value: object, choices: tuple[str, ...]) -> bool:
    """``value`` is one of ``choices``, or names one of a family a choice written
    ``prefix:<Name>`` stands for (``flwr:<Partitioner>``: ``flwr:DirichletPartitioner``; the
    name itself is checked with the other keys)."""
    if value in choices:
        return True
    families = [c[:c.index(":<") + 1] for c in choices if c.endswith(">") and ":<" in c]
    return isinstance(value, str) and any(value.startswith(f) for f in families)


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
    if choices is not None and not _is_choice(value, choices):
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
            key, value = parse_override(item, f"the method entry {entry!r}")
            if key in RUN_WIDE_KEYS:
                raise ConfigError(f"Method entry {entry!r} overrides '{key}', which is shared by "
                                  "all methods of a run; set it for the whole run instead.")
            overrides.append((key, value))
    label = name if not overrides else (
        f"{name}(" + ",".join(f"{k}={toml_literal(v)}" for k, v in overrides) + ")")
    return MethodChoice(label=label, name=name, overrides=tuple(overrides))


def parse_methods(text: str, values: Mapping[str, Value] | None = None,
                  settings: Settings | None = None) -> list[MethodChoice]:
    """Parse 'methods': comma-separated entries, or 'all': every method but ablation variants
    (with the run's ``values``: every one of them that can run on its model and data, each
    entry's checks run once, on ``settings`` where given; see :func:`left_out_by_all`)."""
    entries = _split_top_level(text)
    if not entries:
        raise ConfigError("Config key 'methods' is empty; name at least one method, e.g. "
                          "'fedavg'.")
    if entries == ["all"]:
        every = [MethodChoice(label=name, name=name) for name, spec in METHODS.items()
                 if spec.variant_of is None]
        return every if values is None else [
            c for c in every if _refusal(c, values, settings) is None]
    choices = [_parse_method_entry(entry) for entry in entries]
    labels = [c.label for c in choices]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"Config key 'methods' lists a method twice: {text!r}.")
    return choices


def build_settings(values: Mapping[str, object] | None = None,
                   source: str = "the config", follow: frozenset | None = None,
                   dataset_set: bool | None = None) -> Settings:
    """A validated :class:`Settings`: the defaults, then ``values`` (each coerced and checked), then
    the paths made absolute, the "only with" rules, the checks across keys (each section's on its
    typed view) and every method entry's :meth:`~pflalign.methods.base.Method.check`. The method
    entries are parsed once and kept in the settings (:attr:`Settings.entries`). Every error is
    one :class:`ConfigError` sentence, raised before any data is read.

    The partition and the model follow the data (:func:`_follow_data`) where the user did not
    choose them: ``follow`` names those keys (by default, when ``values`` set the dataset, the
    ones it does not set; :meth:`Settings.replace` passes those its changes leave). Only a layer
    that sets the dataset (``dataset_set``; by default, whether ``values`` holds it) looks at
    the data for this, so a copy with other changes reads no data files again."""
    merged: dict[str, Value] = defaults()
    for key, value in (values or {}).items():
        merged[key] = coerce(key, value, source)
    merged.update(_resolved(RunConfig.from_settings(merged)))
    if dataset_set is None:
        dataset_set = "dataset" in (values or {})
    if follow is None:
        follow = frozenset(FOLLOW_DATA) - set(values or {}) if dataset_set else frozenset()
    notes = _follow_data(merged, follow) if dataset_set else []
    check_only_with(merged)
    run, gga = RunConfig.from_settings(merged), GGAParams.from_settings(merged)
    for check in SECTION_CHECKS:
        check(run, gga)
    settings = Settings(merged, build_settings)
    choices = parse_methods(run.methods, merged, settings)
    if not choices:
        raise ConfigError("methods = 'all': no method can run on this model and data ("
                          + "; ".join(left_out_by_all(merged).values())[:600] + ").")
    if not _every_method(run.methods):  # 'all' kept the entries that passed these checks
        for choice in choices:
            _check_entry(choice, merged, settings)
    settings.entries = tuple(choices)
    settings.notes = tuple(notes)
    return settings


#: the model a dataset's samples get when the user did not choose one that takes them
DATA_MODELS = {IMAGE: "cnn", FEATURES: "mlp", TOKENS: "char-lstm"}


def _follow_data(merged: dict[str, Value], follow: frozenset) -> list[str]:
    """Set the partition and the model that the data calls for, where ``follow`` names them:
    ``natural`` for a dataset that defines its clients, and for samples the model cannot take,
    the model that takes them (:data:`DATA_MODELS`). Returns a line for each, and one when the
    user's own partition pools a dataset's clients."""
    run = RunConfig.from_settings(merged)
    notes = []
    if run.partition != "natural" and has_natural_clients(run.dataset, _columns(run)):
        if "partition" in follow:
            merged["partition"] = "natural"
            notes.append(f"partition = natural: dataset = {run.dataset!r} defines its clients"
                         + ("." if run.dataset in ("synthetic", CLIENTS) else
                            " (set partition to pool them and split the pool instead)."))
        elif run.dataset not in ("synthetic", CLIENTS):  # these refuse it in one sentence
            notes.append(f"dataset = {run.dataset!r} defines its clients, and partition = "
                         f"{run.partition!r} pools them and splits the pool (set partition = "
                         "natural to keep them).")
    kind = _kind(run)
    model = run.model
    if ("model" in follow and not is_user_model(model) and not is_language_model(model)
            and model in MODELS and kind not in MODELS[model].takes
            and jsonl_path(run.dataset) is None):
        merged["model"] = DATA_MODELS[kind]
        if kind == TOKENS and run.tokenizer == _model_tokenizer(model):
            merged["tokenizer"] = _model_tokenizer(DATA_MODELS[kind])
        notes.append(f"model = {DATA_MODELS[kind]}: dataset = {run.dataset!r} holds "
                     f"{_NOUNS[kind]}, which model = {model!r} does not take.")
    return notes


def _resolved(run: RunConfig) -> dict[str, Value]:
    """The values that name files made absolute (the same file for every process and Ray
    worker, whatever its working directory), each read now so that a bad one stops the run
    before any data: the dataset, a user's model, a trace of device profiles, the cache folder;
    and a text dataset's tokenizer, the model's unless given."""
    out: dict[str, Value] = {"dataset": _resolve_dataset(run)}
    if is_user_model(run.model):
        out["model"] = user.resolved(run.model)
    check_profiles_key(run.device_profiles)
    if run.device_profiles not in (NONE_PROFILES, LOGNORMAL):
        out["device-profiles"] = str(Path(run.device_profiles).expanduser().resolve())
    if run.cache_dir:
        out["cache-dir"] = str(Path(run.cache_dir).expanduser().resolve())
    model = str(out.get("model", run.model))
    if not run.tokenizer and dataset_kind(str(out["dataset"]), _columns(run)) == TOKENS:
        out["tokenizer"] = _model_tokenizer(model)
    return out


def check_only_with(values: Mapping[str, Value]) -> None:
    """Every key that keeps an "only with" rule (:class:`~pflalign.settings.options.OnlyWith`)
    is at its default unless the rule holds; the first that is not, in schema order, is refused
    in its rule's one sentence."""
    for option in OPTIONS:
        for rule in option.only_with:
            value = values[option.key]
            if value != option.default and not rule.allows(values[rule.key]):
                raise ConfigError(rule.refusal(option.key, value, values[rule.key]))


def _check_entry(choice: MethodChoice, merged: Mapping[str, Value],
                 settings: Settings | None = None) -> None:
    """A method entry's checks: its model fits the data, and its method accepts its settings."""
    spec = METHODS[choice.name]
    overrides = method_overrides(spec, RunConfig.from_settings(merged).model,
                                 dict(choice.overrides))
    entry = {**merged, **overrides}
    _check_model_fits_data(RunConfig.from_settings(entry), choice.label)
    if overrides:  # an entry's own fraction-train or rounds changes its noise and its budget
        try:
            _check_privacy(RunConfig.from_settings(entry), GGAParams.from_settings(entry))
        except ConfigError as refused:
            raise ConfigError(f"{choice.label}: {refused}") from None
    spec.method.check(settings if settings is not None and not overrides
                      else Settings({**merged, **overrides}, build_settings))


def _every_method(text: str) -> bool:
    """Whether 'methods' is ``all``."""
    return _split_top_level(text) == ["all"]


def _refusal(choice: MethodChoice, values: Mapping[str, Value],
             settings: Settings | None = None) -> str | None:
    try:
        _check_entry(choice, values, settings)
    except ConfigError as refused:
        return str(refused)
    return None


def left_out_by_all(values: Mapping[str, Value]) -> dict[str, str]:
    """The methods that ``methods = 'all'`` leaves out of this run, each with its refusal."""
    every = parse_methods("all")
    return {c.label: reason for c in every if (reason := _refusal(c, values)) is not None}


def method_choices(settings: Mapping[str, Value]) -> list[MethodChoice]:
    """The method entries of ``settings``' 'methods', in order: those :func:`build_settings`
    parsed and kept (parsed again only for a bare mapping)."""
    entries = getattr(settings, "entries", None)
    if entries is not None:
        return list(entries)
    return parse_methods(RunConfig.from_settings(settings).methods, settings)


def method_labels(settings: Mapping[str, Value]) -> list[str]:
    """The labels of the methods to run, in order."""
    return [choice.label for choice in method_choices(settings)]


#: the partitions that need no labels or images, so apply to text
TEXT_PARTITIONS = ("natural", "iid", "quantity")


_NOUNS = {IMAGE: "images", TOKENS: "token sequences", FEATURES: "feature vectors"}


def _resolve_dataset(run: RunConfig) -> str:
    """The dataset: a built-in one, or a readable file or folder named by its absolute path."""
    name = run.dataset
    path = npz_path(name)
    if path is not None:
        name = NPZ + str(path.resolve())
    table = table_path(name)
    if table is not None:
        name = next(p for p in TABLES if name.startswith(p)) + str(table.resolve())
    for prefix in (IMAGEFOLDER, TEXT):
        folder = folder_of(name, prefix)
        if folder is not None:
            name = prefix + str(folder.resolve())
    records = jsonl_path(name)
    if records is not None:
        name = JSONL + str(records.resolve())
    target = hf_target(name)
    folder = None if target is None else local_folder(target)
    if folder is not None:
        name = HF + str(folder.resolve())
    check_dataset_name(name, _columns(run), run.task)
    return name


def _kind(run: RunConfig) -> str:
    """What the run's samples are (images, token sequences or feature vectors); under
    ``dataset = clients``, what input-shape says."""
    if run.dataset == CLIENTS:
        return clients_kind(parse_input_shape(run.input_shape))
    return dataset_kind(run.dataset, _columns(run))


def _columns(run: RunConfig) -> tuple[str, str, str, str]:
    """A Hugging Face dataset's or a table's column keys (input, label, client, split)."""
    return run.input_column, run.label_column, run.client_column, run.split_column


def _check_model_name(model: str, key: str) -> None:
    if is_user_model(model):
        user.factory(model)  # importable, and names a callable: one sentence if not
        return
    if model not in MODELS and not is_language_model(model):
        raise ConfigError(f"Config key '{key}' = {model!r} is not a model: choose one of "
                          f"{', '.join(MODELS)}, hf:<model> for a pretrained language "
                          f"model with LoRA adapters (hf:{SMOLLM2} offline), or "
                          "py:module:factory for your own (docs/usage.md).")
    if is_language_model(model):
        source_of(model)  # a missing folder, file or package is one sentence, before any data


def _model_tokenizer(model: str) -> str:
    return model if is_language_model(model) else CHARACTERS


def _check_model_fits_data(run: RunConfig, label: str) -> None:
    """The model takes what the dataset holds (images or token sequences), tokenized as the
    run's data is."""
    model = run.model
    _check_model_name(model, "model")
    kind = _kind(run)
    if jsonl_path(run.dataset) is not None and not is_language_model(model):
        raise ConfigError(f"Method '{label}' would run model = {model!r} on dataset = "
                          f"{run.dataset!r}, whose instructions a language model's own "
                          f"tokenizer reads: set model = hf:<model> (hf:{SMOLLM2} offline).")
    if is_user_model(model):
        return  # a factory gets the data's shape; its model is checked when it is built
    takes = (TOKENS,) if is_language_model(model) else MODELS[model].takes
    if kind not in takes:
        fits = ", ".join(m for m, spec in MODELS.items() if kind in spec.takes)
        fits += ", or hf:<model>" if kind == TOKENS else ""
        raise ConfigError(f"Method '{label}' would run model = {model!r}, which takes "
                          f"{' or '.join(_NOUNS[t] for t in takes)}, on dataset = "
                          f"{run.dataset!r}, which holds {_NOUNS[kind]}: set model to "
                          f"{fits}.")
    if kind == TOKENS and run.tokenizer != _model_tokenizer(model):
        raise ConfigError(f"Method '{label}' would run model = {model!r} on text tokenized by "
                          f"tokenizer = {run.tokenizer!r}; a model reads only its own "
                          f"tokens: set tokenizer = {_model_tokenizer(model)!r} (or leave it "
                          "empty), and give every method entry the same model.")


def _check_systems(run: RunConfig, gga: GGAParams | None = None) -> None:
    """The systems section: device-profiles names none, lognormal or a readable trace (read
    now, so that a bad one stops the run before any data is read), whose availability windows
    go with availability = trace; mode = async fits the run."""
    _check_mode(run)
    kind = run.device_profiles
    clients = run.num_clients + run.num_unseen_clients
    if kind not in (NONE_PROFILES, LOGNORMAL):
        path = Path(kind)
        read_trace(path, clients)
        windows = read_windows(path, clients)
        if windows is None and run.availability == TRACE:
            raise ConfigError(f"availability = 'trace' reads the windows column of the trace "
                              f"file, and '{path}' has none: add one (hours of the day, e.g. "
                              "0-8;20-24) or choose availability = 'diurnal' or 'always'.")
        if windows is not None and run.availability != TRACE:
            raise ConfigError(f"The trace file '{path}' has availability windows, and "
                              f"availability = {run.availability!r}: set availability = "
                              "'trace' to use them, or remove the windows column.")
    elif run.availability == TRACE:
        raise ConfigError(f"availability = 'trace' reads the windows column of a trace file, and "
                          f"device-profiles = {kind!r}: give a trace file with windows.")


def _default(key: str) -> Value:
    """A key's declared default (its idle value)."""
    return OPTIONS_BY_KEY[key].default


def _check_privacy(run: RunConfig, gga: GGAParams) -> None:
    """The privacy section, and the sampling it needs: ``sampling = poisson`` draws from every
    training client, each round on its own (no over-selection, availability windows or
    asynchronous dispatch); and a run with dp that its accountant can bound: synchronous,
    without gga's extra uploads, its dp-epsilon reachable and its adaptive clip's count noise
    within the budget (docs/privacy.md). The dp keys' "only with" rules are the schema's
    (:func:`check_only_with`)."""
    if run.sampling == "poisson":
        for key, value, why in (
                ("mode", run.mode, "dispatches a client whenever one arrives"),
                ("over-selection", run.over_selection, "samples more clients than a round wants"),
                ("availability", run.availability, "samples only among the reachable clients")):
            idle = _default(key)
            if value != idle:
                raise ConfigError(f"sampling = 'poisson' includes each training client with "
                                  f"probability fraction-train, and {key} = {value!r} "
                                  f"{why}: set {key} = {idle!r} or sampling = 'fixed'.")
    if run.dp == "off":
        return
    if run.mode == "async":
        raise ConfigError(f"dp = {run.dp!r} accounts one release per synchronous round, "
                          "and mode = 'async' aggregates buffers of stale updates: set mode = "
                          "'sync'.")
    if run.over_selection > 1:
        raise ConfigError(f"over-selection = {run.over_selection:g} uses the first replies "
                          "to arrive, so one client's training time (its data's size) decides "
                          f"whether another's update counts, which dp = {run.dp!r} does not "
                          "account: set over-selection = 1.")
    if gga.enabled:
        raise ConfigError(f"gga = true sends the clients' gradients to the server outside the "
                          f"clipped, noised release of dp = {run.dp!r}: set gga = false.")
    if run.dp == "local":
        _check_local_privacy(run)
    if run.dp == "distributed":
        _check_distributed_privacy(run)
    if run.dp_epsilon and run.dp_noise_multiplier != _default("dp-noise-multiplier"):
        raise ConfigError(f"dp-epsilon = {run.dp_epsilon:g} sets the noise multiplier, and "
                          f"dp-noise-multiplier = {run.dp_noise_multiplier:g} sets it too: "
                          "give one of them.")
    multiplier = run_noise_multiplier(run)  # an unreachable dp-epsilon is one sentence here
    expected = expected_clients(run.sampling, run.fraction_train, run.num_clients)
    count = count_noise(run, expected, multiplier)
    if count and not count > multiplier / 2:
        raise ConfigError(f"dp-count-noise = {count:g} is the noise of the adaptive clip's count, "
                          f"which must exceed half the noise multiplier ({multiplier:.4g} / 2) "
                          "for the updates to keep any of the noise budget: raise it, or leave "
                          "it 0 for the default.")


def _check_distributed_privacy(run: RunConfig) -> None:
    """``dp = distributed``: the clients' noise is only private inside secure aggregation's sum,
    the clip is each client's own, and the server is not trusted with a client's state (the
    audits, as under local DP)."""
    if run.secure_aggregation != "secagg+":
        raise ConfigError("dp = 'distributed' has each client add its share of the noise, which "
                          "alone is too little to hide its update: only secure aggregation's "
                          "sum carries the noise of all of them; set secure-aggregation = "
                          "'secagg+' (or dp = 'central').")
    if run.dp_clipping == "adaptive":
        raise ConfigError("dp-clipping = 'adaptive' has the server count the clipped updates, "
                          "and under dp = 'distributed' it sees only their noised sum: each "
                          "client clips to dp-clip; set dp-clipping = 'fixed'.")
    _check_audits(run)


def _check_audits(run: RunConfig) -> None:
    """No audit under a dp whose server is not trusted: it would send a client's saved state."""
    for key, value in (("eval-audit-fraction", run.eval_audit_fraction),
                       ("train-audit-fraction", run.train_audit_fraction)):
        if value > 0:
            raise ConfigError(f"{key} = {value:g} has clients send their saved state to "
                              f"the server to recompute their replies, which dp = {run.dp!r} "
                              f"forbids (the server is not trusted): set {key} = 0.")


def _check_local_privacy(run: RunConfig) -> None:
    """``dp = local``: nothing of a client's own may reach the server outside its noised
    upload (the audits send its saved state; on the Flower engine no checkpoint asks for it,
    :meth:`~pflalign.round.loop.RoundLoop.write_checkpoint`), and the clip is each client's own
    (no adaptive clip, which needs the server to count)."""
    _check_audits(run)
    if run.dp_clipping == "adaptive":
        raise ConfigError("dp-clipping = 'adaptive' has the server count the clipped updates, "
                          "and under dp = 'local' it never sees one unnoised: each client clips "
                          "to dp-clip; set dp-clipping = 'fixed'.")


def _check_mode(run: RunConfig) -> None:
    """mode = async: its keys fit the run (buffer-size at most concurrency, at most the training
    clients), it runs on the simulated clock (device-profiles) or in real time on the Flower
    engine, and without the synchronous-round keys. (Its keys' "only with mode = async" rule is
    the schema's, :func:`check_only_with`.)"""
    if run.mode != "async":
        return
    clients = run.num_clients
    if run.concurrency > clients:
        raise ConfigError(f"concurrency = {run.concurrency} keeps more clients in flight than the "
                          f"run's {clients} training clients (num-clients): lower it.")
    flying, buffer = async_sizes(clients, run.fraction_train, run.concurrency, run.buffer_size)
    if buffer > flying:
        raise ConfigError(f"buffer-size = {buffer} waits for more arrivals than the {flying} "
                          "clients in flight (concurrency"
                          f"{'' if run.concurrency else ' = 0: fraction-train of num-clients'}), "
                          "so no aggregation would ever happen: lower buffer-size or raise "
                          "concurrency.")
    for key, value in (("round-deadline", run.round_deadline),
                       ("over-selection", run.over_selection)):
        if value != _default(key):
            raise ConfigError(f"{key} = {value:g} closes synchronous rounds, and mode = "
                              "'async' has none (every arrival is used, weighted by its "
                              "staleness): remove it or set mode = 'sync'.")
    if run.train_audit_fraction > 0:
        raise ConfigError(f"train-audit-fraction = {run.train_audit_fraction:g} recomputes "
                          "a synchronous round's training replies, which mode = 'async' does "
                          "not have: set it to 0 or mode = 'sync'.")
    if run.device_profiles == NONE_PROFILES and run.engine != "flower":
        raise ConfigError(f"mode = 'async' on engine = {run.engine!r} orders arrivals on "
                          "the simulated clock, which needs device profiles: set "
                          "device-profiles = lognormal or a trace file (without them, only the "
                          "Flower engine runs it, in real time).")


def _check_model(run: RunConfig, gga: GGAParams | None = None) -> None:
    """The model section: the model names a registered model, a language model or a factory of
    one's own (each method entry's model is checked against the data in :func:`_check_entry`)."""
    _check_model_name(run.model, "model")


def _check_outputs(run: RunConfig, gga: GGAParams | None = None) -> None:
    """The outputs section: the trackers named exist; save-models = best chooses by validation
    data, over whole evaluations."""
    parse_tracking(run.tracking)
    if run.save_models == "best" and run.evaluate_on != "validation":
        raise ConfigError("save-models = 'best' chooses the round by its evaluation, which would "
                          f"then be on test data (evaluate-on = {run.evaluate_on!r}): set "
                          "evaluate-on = 'validation', or save-models = 'final'.")
    if run.save_models == "best" and run.eval_fraction < 1:
        raise ConfigError(f"save-models = 'best' compares whole evaluations, and eval-fraction = "
                          f"{run.eval_fraction:g} evaluates a sample of the clients before the "
                          "last round: set eval-fraction = 1, or save-models = 'final'.")


def _check_engine(run: RunConfig, gga: GGAParams | None = None) -> None:
    """The engine section: the batched engine's workers are a count or auto."""
    workers = run.batched_workers.strip()
    if workers != "auto" and not (workers.isdigit() and int(workers) >= 1):
        raise ConfigError(f"batched-workers = {run.batched_workers!r}: give a whole number "
                          "of worker processes (>= 1), or auto.")


def _check_data(run: RunConfig, gga: GGAParams | None = None) -> None:
    """The data section: the partition fits the dataset (text, images, feature vectors, natural
    clients, generated clients, the clients' own data), and rotations leave training clients."""
    kind = _kind(run)
    if kind == TOKENS and run.partition not in TEXT_PARTITIONS:
        raise ConfigError(f"partition = {run.partition!r} splits by class label or "
                          f"rotates images, which mean nothing for dataset = "
                          f"{run.dataset!r} (text; its label is the next character): "
                          f"choose {', '.join(TEXT_PARTITIONS)}.")
    if run.partition == "natural" and not has_natural_clients(run.dataset, _columns(run)):
        folder = str(run.dataset).startswith("imagefolder:")
        raise ConfigError(f"partition = 'natural' needs a dataset with its own clients, and "
                          f"{run.dataset!r} has none: "
                          + ("lay the images out one folder per client, DIR/<client>/<class>/"
                             "<image>, or choose another partition." if folder else
                             "choose dataset = 'shakespeare', npz:PATH with a client array, "
                             "imagefolder:DIR with one folder per client (DIR/<client>/<class>/"
                             "<image>), hf:... with a client-column, or another partition."))
    if run.eval_metrics.strip():
        _check_scores(run, kind)
    if run.task == "regression":
        _check_regression(run)
    if is_flwr(run.partition):
        check_flwr_partition(run.partition, run.partition_args,
                             run.num_clients + run.num_unseen_clients, run.seed)
    if run.dataset == CLIENTS:
        _check_clients_data(run)
    if run.dataset == "synthetic" and run.partition != "natural":
        raise ConfigError(f"dataset = 'synthetic' generates each client's own data, so its "
                          f"clients are its partition: set partition = 'natural' (not "
                          f"{run.partition!r}); synthetic-iid = true gives IID clients.")
    if run.dataset == "synthetic" and run.max_samples:
        raise ConfigError("max-samples subsamples a pooled dataset, and dataset = 'synthetic' "
                          "generates each client's data: set max-samples = 0 and size the "
                          "clients with min-samples-per-client, synthetic-size-power and "
                          "synthetic-max-samples.")
    if run.synthetic_max_samples < run.min_samples_per_client and run.dataset == "synthetic":
        raise ConfigError(f"synthetic-max-samples = {run.synthetic_max_samples} is below "
                          f"min-samples-per-client = {run.min_samples_per_client}; raise it.")
    if kind == FEATURES and run.partition == "rotated":
        raise ConfigError(f"partition = 'rotated' rotates images, and dataset = "
                          f"{run.dataset!r} holds feature vectors: choose another "
                          "partition.")
    if run.partition == "rotated":
        angles = parse_angles(run.rotation_angles)
        held_out = run.rotation_unseen_groups if run.num_unseen_clients else 0
        if held_out >= len(angles):
            raise ConfigError(f"rotation-unseen-groups = {held_out} leaves no angle of "
                              f"rotation-angles = {run.rotation_angles!r} for the training "
                              "clients; hold out fewer groups or add angles.")


#: the partitions that need no class labels, so apply to a regression's targets
REGRESSION_PARTITIONS = ("natural", "iid", "quantity")


def _check_regression(run: RunConfig) -> None:
    """task = regression: float targets from an npz file or a table, a partition that needs no
    classes, no classification scores, no annealing on a classifier's loss; scikit-learn."""
    if npz_path(run.dataset) is None and table_path(run.dataset) is None:
        raise ConfigError(f"task = 'regression' reads float targets from dataset = npz:PATH, "
                          f"csv:PATH or parquet:PATH, and dataset = {run.dataset!r} is none of "
                          "them.")
    if run.partition not in REGRESSION_PARTITIONS:
        raise ConfigError(f"partition = {run.partition!r} splits the samples by class, and "
                          "task = 'regression' has no classes: choose "
                          f"{', '.join(REGRESSION_PARTITIONS)}.")
    if run.eval_metrics.strip():
        raise ConfigError(f"eval-metrics = {run.eval_metrics!r} scores a classifier's classes, "
                          "and task = 'regression' has none (it reports personal-mse, -mae and "
                          "-r2): remove eval-metrics.")
    require_sklearn()


def _check_scores(run: RunConfig, kind: str) -> None:
    """eval-metrics names known scores, of a classifier (not a next-token model), with
    scikit-learn installed."""
    names = [s.strip() for s in run.eval_metrics.split(",") if s.strip()]
    unknown = [s for s in names if s not in SCORES]
    if unknown:
        raise ConfigError(f"eval-metrics names {unknown[0]!r}; choose from {', '.join(SCORES)}.")
    if kind == TOKENS or is_language_model(run.model):
        raise ConfigError(f"eval-metrics = {run.eval_metrics!r} scores a classifier's classes, "
                          f"and dataset = {run.dataset!r} is text (each target is the next "
                          "token; its perplexity is reported): remove eval-metrics.")
    require_sklearn()


def _check_gga(run: RunConfig, gga: GGAParams) -> None:
    """The GGA section: the annealing window runs forwards."""
    if gga.enabled and gga.end < gga.start:
        raise ConfigError(f"gga-end = {gga.end} is before gga-start = {gga.start}; the "
                          "annealing window is gga-start..gga-end.")


def _check_robustness(run: RunConfig, gga: GGAParams | None = None) -> None:
    """The robustness section: the injected attacks and faults fit the run."""
    if run.malicious_clients > run.num_clients:
        raise ConfigError(f"malicious-clients = {run.malicious_clients} exceeds "
                          f"num-clients = {run.num_clients}.")
    if run.malicious_clients > 0 and run.attackers > 0:
        raise ConfigError(f"malicious-clients = {run.malicious_clients} and attackers = "
                          f"{run.attackers:g} both say how many clients attack: set one.")
    attacking = run.malicious_clients > 0 or run.attackers > 0
    if attacking != (run.attack != "none"):
        raise ConfigError(f"attackers = {run.attackers:g}, malicious-clients = "
                          f"{run.malicious_clients} and attack = {run.attack!r} do not go "
                          "together: set attackers (or malicious-clients) and attack (some "
                          "clients and what they do), or neither.")
    if run.attack == "backdoor":
        kind = DATASETS.get(run.dataset)
        if run.task == "regression" or (kind is not None and kind != IMAGE):
            raise ConfigError(f"attack = 'backdoor' adds a trigger patch to images and relabels "
                              f"them, and this run's data ({run.dataset!r}, task = "
                              f"{run.task!r}) is not image classification: choose another "
                              "attack.")
    if run.attack in COLLUDING_ATTACKS:
        if run.mode == "async" or run.device_profiles != "none":
            raise ConfigError(f"attack = {run.attack!r} colludes on one round's honest updates "
                              "of the attackers, each trained from the same global model; "
                              "mode = 'async' and device-profiles send clients different "
                              "models and work: run it with mode = 'sync' and "
                              "device-profiles = 'none'.")
    if run.client_failure_rate + run.client_dropout_rate >= 1:
        raise ConfigError("client-failure-rate + client-dropout-rate must be below 1, got "
                          f"{run.client_failure_rate + run.client_dropout_rate:g}.")


def _check_clients_data(run: RunConfig) -> None:
    """``dataset = clients``: the server builds the model from num-classes and input-shape, the
    clients' own loaders are their partition, and nothing needs the server's copy of the data
    (:mod:`pflalign.data.clients`)."""
    parse_input_shape(run.input_shape)
    no_copy = "the audits recompute replies from the server's copy of the data, and the server " \
              "holds none"
    if run.num_classes < 2:
        raise ConfigError(f"dataset = 'clients' builds the model with num-classes = "
                          f"{run.num_classes}: give the number of classes the clients' labels "
                          "take (at least 2).")
    for key, value, needed, why in (
            ("partition", run.partition, "natural",
             "the clients' own loaders are their partition"),
            ("engine", run.engine, "flower", "only a Flower ClientApp holds the clients' data"),
            ("max-samples", run.max_samples, 0, "there is no pooled dataset to subsample"),
            ("evaluate-on", run.evaluate_on, "test",
             "each client's testloader is its evaluation split"),
            ("eval-audit-fraction", run.eval_audit_fraction, 0.0, no_copy),
            ("train-audit-fraction", run.train_audit_fraction, 0.0, no_copy)):
        if value != needed:
            raise ConfigError(f"dataset = 'clients' needs {key} = {needed!r} ({why}), and "
                              f"{key} = {value!r}: set {key} = {needed!r}.")


#: each section's checks, in the order they run (the local training's are each method's own
#: :meth:`~pflalign.methods.base.Method.check`, with the entry's overrides)
SECTION_CHECKS = (_check_systems, _check_privacy, _check_model, _check_outputs, _check_engine,
                  _check_data, _check_gga, _check_robustness)


def load_toml(path: str | Path) -> dict[str, Value]:
    """Read a flat run-config TOML file (no tables); unknown keys are reported by Settings."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"Config file '{path}' is a directory; pass a TOML file to --config "
                          f"(for example {path / 'config.toml'}, if that is where it is).")
    if not path.is_file():
        raise ConfigError(f"Config file '{path}' does not exist; pass an existing TOML file to "
                          "--config.")
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"Config file '{path}' is not UTF-8 text (byte {err.start} is "
                          f"{err.object[err.start:err.start + 1]!r}); TOML files are UTF-8: "
                          "save it as UTF-8.") from None
    except OSError as err:
        raise ConfigError(f"Config file '{path}' cannot be read: {err.strerror}.") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"Config file '{path}' is not valid TOML: {err}.") from err
    for key, value in data.items():
        if isinstance(value, dict | list):
            raise ConfigError(f"Config file '{path}': key '{key}' holds a table or list; run "
                              "configs are flat 'key = value' pairs (write lists as "
                              "comma-separated strings).")
    return data


def parse_override(text: str, source: str | None = None) -> tuple[str, Value]:
    """Parse one ``key=value`` override (``source``: where it was written, for errors; default
    ``--set key=value``). Values are TOML literals; string keys take the raw text."""
    if "=" not in text:
        raise ConfigError(f"Override '{text}' is not of the form key=value"
                          + (f" (in {source})." if source else "."))
    key, raw = (part.strip() for part in text.split("=", 1))
    if key not in OPTIONS_BY_KEY:
        raise _unknown_key_error(key, source or f"--set {text}")
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
    settings = build_settings(values, source=source)
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
        lines.append(f"# {opt.full_help}")
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
