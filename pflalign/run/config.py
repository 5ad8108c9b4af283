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

from pflalign.data.datasets import CHARACTERS
from pflalign.data.flwr_partitioners import check_flwr_partition, is_flwr
from pflalign.data.hf_source import COLUMN_KEYS, HF, hf_target, local_folder
from pflalign.data.instructions import JSONL, jsonl_path
from pflalign.data.partition import parse_angles
from pflalign.data.sources import (
    IMAGEFOLDER,
    NPZ,
    TEXT,
    check_dataset_name,
    dataset_kind,
    folder_of,
    has_natural_clients,
    npz_path,
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
    FEATURES,
    IMAGE,
    RUN_WIDE_KEYS,
    TOKENS,
    GGAParams,
    LocalTraining,
    RunConfig,
    Settings,
)


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


def parse_methods(text: str, values: Mapping[str, Value] | None = None) -> list[MethodChoice]:
    """Parse 'methods': comma-separated entries, or 'all': every method but ablation variants
    (with the run's ``values``: every one of them that can run on its model and data; see
    :func:`left_out_by_all`)."""
    entries = _split_top_level(text)
    if not entries:
        raise ConfigError("Config key 'methods' is empty; name at least one method, e.g. "
                          "'fedavg'.")
    if entries == ["all"]:
        every = [MethodChoice(label=name, name=name) for name, spec in METHODS.items()
                 if spec.variant_of is None]
        return every if values is None else [
            c for c in every if _refusal(c, values) is None]
    choices = [_parse_method_entry(entry) for entry in entries]
    labels = [c.label for c in choices]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"Config key 'methods' lists a method twice: {text!r}.")
    return choices


def build_settings(values: Mapping[str, object] | None = None,
                   source: str = "the config") -> Settings:
    """A validated :class:`Settings`: the defaults, then ``values`` (each coerced and checked), then
    the checks across keys and every method entry's :meth:`~pflalign.methods.base.Method.check`.
    Every error is one :class:`ConfigError` sentence, raised before any data is read."""
    merged: dict[str, Value] = defaults()
    for key, value in (values or {}).items():
        merged[key] = coerce(key, value, source)
    _resolve_dataset(merged)
    _check_systems(merged)
    _check_privacy(merged)
    if is_user_model(str(merged["model"])):
        merged["model"] = user.resolved(str(merged["model"]))
    _check_model_name(str(merged["model"]), "model")
    _resolve_tokenizer(merged)
    _check_cross_keys(merged)
    settings = Settings(merged, build_settings)
    choices = parse_methods(str(merged["methods"]), merged)
    if not choices:
        raise ConfigError("methods = 'all': no method can run on this model and data ("
                          + "; ".join(left_out_by_all(merged).values())[:600] + ").")
    for choice in choices:
        _check_entry(choice, merged, settings)
    return settings


def _check_entry(choice: MethodChoice, merged: Mapping[str, Value],
                 settings: Settings | None = None) -> None:
    """A method entry's checks: its model fits the data, and its method accepts its settings."""
    spec = METHODS[choice.name]
    overrides = method_overrides(spec, str(merged["model"]), dict(choice.overrides))
    _check_model_fits_data({**merged, **overrides}, choice.label)
    if overrides:  # an entry's own fraction-train or rounds changes its noise and its budget
        try:
            _check_privacy({**merged, **overrides})
        except ConfigError as refused:
            raise ConfigError(f"{choice.label}: {refused}") from None
    spec.method.check(settings if settings is not None and not overrides
                      else Settings({**merged, **overrides}, build_settings))


def _refusal(choice: MethodChoice, values: Mapping[str, Value]) -> str | None:
    try:
        _check_entry(choice, values)
    except ConfigError as refused:
        return str(refused)
    return None


def left_out_by_all(values: Mapping[str, Value]) -> dict[str, str]:
    """The methods that ``methods = 'all'`` leaves out of this run, each with its refusal."""
    every = parse_methods("all")
    return {c.label: reason for c in every if (reason := _refusal(c, values)) is not None}


def method_choices(settings: Mapping[str, Value]) -> list[MethodChoice]:
    """The method entries of ``settings``' 'methods', in order."""
    return parse_methods(str(settings["methods"]), settings)


def method_labels(settings: Mapping[str, Value]) -> list[str]:
    """The labels of the methods to run, in order."""
    return [choice.label for choice in method_choices(settings)]


#: the partitions that need no labels or images, so apply to text
TEXT_PARTITIONS = ("natural", "iid", "quantity")


_NOUNS = {IMAGE: "images", TOKENS: "token sequences", FEATURES: "feature vectors"}


def _resolve_dataset(values: dict[str, Value]) -> None:
    """The dataset names a built-in dataset or a readable file, which the config then names by
    its absolute path (the same file for every process and Ray worker, whatever its working
    directory)."""
    name = str(values["dataset"])
    path = npz_path(name)
    if path is not None:
        values["dataset"] = NPZ + str(path.resolve())
    for prefix in (IMAGEFOLDER, TEXT):
        folder = folder_of(name, prefix)
        if folder is not None:
            values["dataset"] = prefix + str(folder.resolve())
    records = jsonl_path(name)
    if records is not None:
        values["dataset"] = JSONL + str(records.resolve())
    target = hf_target(name)
    folder = None if target is None else local_folder(target)
    if folder is not None:
        values["dataset"] = HF + str(folder.resolve())
    if target is None:
        given = [k for k in COLUMN_KEYS if str(values[k]).strip()]
        if given:
            raise ConfigError(f"{given[0]} = {values[given[0]]!r} names a column of a Hugging "
                              f"Face dataset, and dataset = {values['dataset']!r} is not one "
                              f"(hf:...): clear {given[0]}.")
    check_dataset_name(str(values["dataset"]), _columns(values))


def _columns(values: Mapping[str, Value]) -> tuple[str, str, str]:
    """A Hugging Face dataset's column keys (input, label, client)."""
    return tuple(str(values[k]) for k in COLUMN_KEYS)


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


def _resolve_tokenizer(values: dict[str, Value]) -> None:
    """A text dataset's tokenizer: the model's, unless given (and then it must be the model's)."""
    if dataset_kind(str(values["dataset"]), _columns(values)) != TOKENS:
        return
    if not values["tokenizer"]:
        values["tokenizer"] = _model_tokenizer(str(values["model"]))


def _check_model_fits_data(values: Mapping[str, Value], label: str) -> None:
    """The model takes what the dataset holds (images or token sequences), tokenized as the
    run's data is."""
    model = str(values["model"])
    _check_model_name(model, "model")
    kind = dataset_kind(str(values["dataset"]), _columns(values))
    if jsonl_path(str(values["dataset"])) is not None and not is_language_model(model):
        raise ConfigError(f"Method '{label}' would run model = {model!r} on dataset = "
                          f"{values['dataset']!r}, whose instructions a language model's own "
                          f"tokenizer reads: set model = hf:<model> (hf:{SMOLLM2} offline).")
    if is_user_model(model):
        return  # a factory gets the data's shape; its model is checked when it is built
    takes = (TOKENS,) if is_language_model(model) else MODELS[model].takes
    if kind not in takes:
        fits = ", ".join(m for m, spec in MODELS.items() if kind in spec.takes)
        fits += ", or hf:<model>" if kind == TOKENS else ""
        raise ConfigError(f"Method '{label}' would run model = {model!r}, which takes "
                          f"{' or '.join(_NOUNS[t] for t in takes)}, on dataset = "
                          f"{values['dataset']!r}, which holds {_NOUNS[kind]}: set model to "
                          f"{fits}.")
    if kind == TOKENS and values["tokenizer"] != _model_tokenizer(model):
        raise ConfigError(f"Method '{label}' would run model = {model!r} on text tokenized by "
                          f"tokenizer = {values['tokenizer']!r}; a model reads only its own "
                          f"tokens: set tokenizer = {_model_tokenizer(model)!r} (or leave it "
                          "empty), and give every method entry the same model.")


def _check_systems(values: dict[str, Value]) -> None:
    """device-profiles names none, lognormal or a readable trace (made absolute, and read now,
    so that a bad one stops the run before any data is read); round-deadline and
    over-selection need profiles."""
    _check_mode(values)
    kind = str(values["device-profiles"])
    check_profiles_key(kind)
    clients = int(values["num-clients"]) + int(values["num-unseen-clients"])
    if kind not in (NONE_PROFILES, LOGNORMAL):
        path = Path(kind).expanduser().resolve()
        values["device-profiles"] = str(path)
        read_trace(path, clients)
        windows = read_windows(path, clients)
        if windows is None and values["availability"] == TRACE:
            raise ConfigError(f"availability = 'trace' reads the windows column of the trace "
                              f"file, and '{path}' has none: add one (hours of the day, e.g. "
                              "0-8;20-24) or choose availability = 'diurnal' or 'always'.")
        if windows is not None and values["availability"] != TRACE:
            raise ConfigError(f"The trace file '{path}' has availability windows, and "
                              f"availability = {values['availability']!r}: set availability = "
                              "'trace' to use them, or remove the windows column.")
    elif values["availability"] == TRACE:
        raise ConfigError(f"availability = 'trace' reads the windows column of a trace file, and "
                          f"device-profiles = {kind!r}: give a trace file with windows.")
    if kind == NONE_PROFILES:
        for key, idle in (("round-deadline", 0.0), ("over-selection", 1.0)):
            if values[key] != idle:
                raise ConfigError(f"{key} = {values[key]:g} times the clients on the simulated "
                                  "clock, which needs device profiles: set device-profiles = "
                                  "lognormal or a trace file.")
        if values["time-budget"]:
            raise ConfigError(f"time-budget = {values['time-budget']:g} reports the methods at a "
                              "simulated time, which needs device profiles: set device-profiles "
                              "= lognormal or a trace file.")
        if values["availability"] != "always":
            raise ConfigError(f"availability = {values['availability']!r} follows the clients "
                              "on the simulated clock, which needs device profiles: set "
                              "device-profiles = lognormal or a trace file.")


#: the keys of ``dp`` and their defaults (set only with dp on)
DP_KEYS = ("dp-clip", "dp-clipping", "dp-noise-multiplier", "dp-epsilon", "dp-delta",
           "dp-clip-quantile", "dp-clip-lr", "dp-count-noise", "dp-secure")


def _check_privacy(values: Mapping[str, Value]) -> None:
    """``sampling = poisson`` draws from every training client, each round on its own (no
    over-selection, availability windows or asynchronous dispatch); ``dp`` keys only with dp on,
    and a run with dp that its accountant can bound: synchronous, without gga's extra uploads,
    its dp-epsilon reachable and its adaptive clip's count noise within the budget
    (docs/privacy.md)."""
    if values["sampling"] == "poisson":
        for key, idle, why in (
                ("mode", "sync", "dispatches a client whenever one arrives"),
                ("over-selection", 1.0, "samples more clients than a round wants"),
                ("availability", "always", "samples only among the reachable clients")):
            if values[key] != idle:
                raise ConfigError(f"sampling = 'poisson' includes each training client with "
                                  f"probability fraction-train, and {key} = {values[key]!r} "
                                  f"{why}: set {key} = {idle!r} or sampling = 'fixed'.")
    default = defaults()
    if values["dp"] == "off":
        for key in DP_KEYS:
            if values[key] != default[key]:
                raise ConfigError(f"{key} = {values[key]!r} applies to differential privacy, and "
                                  "dp = 'off': set dp = 'central' or remove it.")
        return
    if values["mode"] == "async":
        raise ConfigError(f"dp = {values['dp']!r} accounts one release per synchronous round, "
                          "and mode = 'async' aggregates buffers of stale updates: set mode = "
                          "'sync'.")
    if float(values["over-selection"]) > 1:
        raise ConfigError(f"over-selection = {values['over-selection']:g} uses the first replies "
                          "to arrive, so one client's training time (its data's size) decides "
                          f"whether another's update counts, which dp = {values['dp']!r} does not "
                          "account: set over-selection = 1.")
    if values["gga"]:
        raise ConfigError(f"gga = true sends the clients' gradients to the server outside the "
                          f"clipped, noised release of dp = {values['dp']!r}: set gga = false.")
    if values["dp"] == "local":
        _check_local_privacy(values)
    if values["dp-clipping"] == "fixed":
        for key in ("dp-clip-quantile", "dp-clip-lr", "dp-count-noise"):
            if values[key] != default[key]:
                raise ConfigError(f"{key} = {values[key]!r} applies to dp-clipping = "
                                  "'adaptive', and dp-clipping = 'fixed': set dp-clipping = "
                                  "'adaptive' or remove it.")
    if values["dp-epsilon"] and values["dp-noise-multiplier"] != default["dp-noise-multiplier"]:
        raise ConfigError(f"dp-epsilon = {values['dp-epsilon']:g} sets the noise multiplier, and "
                          f"dp-noise-multiplier = {values['dp-noise-multiplier']:g} sets it too: "
                          "give one of them.")
    run = RunConfig.from_settings(values)
    multiplier = run_noise_multiplier(run)  # an unreachable dp-epsilon is one sentence here
    expected = expected_clients(run.sampling, run.fraction_train, run.num_clients)
    count = count_noise(run, expected, multiplier)
    if count and not count > multiplier / 2:
        raise ConfigError(f"dp-count-noise = {count:g} is the noise of the adaptive clip's count, "
                          f"which must exceed half the noise multiplier ({multiplier:.4g} / 2) "
                          "for the updates to keep any of the noise budget: raise it, or leave "
                          "it 0 for the default.")


def _check_local_privacy(values: Mapping[str, Value]) -> None:
    """``dp = local``: nothing of a client's own may reach the server outside its noised
    upload (the audits send its saved state; on the Flower engine no checkpoint asks for it,
    :meth:`~pflalign.round.loop.RoundLoop.write_checkpoint`), and the clip is each client's own
    (no adaptive clip, which needs the server to count)."""
    for key in ("eval-audit-fraction", "train-audit-fraction"):
        if float(values[key]) > 0:
            raise ConfigError(f"{key} = {values[key]:g} has clients send their saved state to "
                              "the server to recompute their replies, which dp = 'local' "
                              f"forbids (the server is not trusted): set {key} = 0.")
    if values["dp-clipping"] == "adaptive":
        raise ConfigError("dp-clipping = 'adaptive' has the server count the clipped updates, "
                          "and under dp = 'local' it never sees one unnoised: each client clips "
                          "to dp-clip; set dp-clipping = 'fixed'.")


#: the keys of ``mode = async`` and their values when unused
ASYNC_KEYS = {"concurrency": 0, "buffer-size": 0, "staleness-exponent": 0.5, "async-lr": 1.0}


def _check_mode(values: Mapping[str, Value]) -> None:
    """mode = async: its keys fit the run (buffer-size at most concurrency, at most the training
    clients), it runs on the simulated clock (device-profiles) or in real time on the Flower
    engine, and without the synchronous-round keys; mode = sync: no async key is set."""
    if values["mode"] != "async":
        for key, idle in ASYNC_KEYS.items():
            if values[key] != idle:
                raise ConfigError(f"{key} = {values[key]:g} applies to mode = 'async', and this "
                                  "run is synchronous: set mode = 'async' or remove it.")
        return
    clients = int(values["num-clients"])
    concurrency = int(values["concurrency"])
    if concurrency > clients:
        raise ConfigError(f"concurrency = {concurrency} keeps more clients in flight than the "
                          f"run's {clients} training clients (num-clients): lower it.")
    flying, buffer = async_sizes(clients, float(values["fraction-train"]), concurrency,
                                 int(values["buffer-size"]))
    if buffer > flying:
        raise ConfigError(f"buffer-size = {buffer} waits for more arrivals than the {flying} "
                          "clients in flight (concurrency"
                          f"{'' if concurrency else ' = 0: fraction-train of num-clients'}), so "
                          "no aggregation would ever happen: lower buffer-size or raise "
                          "concurrency.")
    for key, idle in (("round-deadline", 0.0), ("over-selection", 1.0)):
        if values[key] != idle:
            raise ConfigError(f"{key} = {values[key]:g} closes synchronous rounds, and mode = "
                              "'async' has none (every arrival is used, weighted by its "
                              "staleness): remove it or set mode = 'sync'.")
    if float(values["train-audit-fraction"]) > 0:
        raise ConfigError(f"train-audit-fraction = {values['train-audit-fraction']:g} recomputes "
                          "a synchronous round's training replies, which mode = 'async' does "
                          "not have: set it to 0 or mode = 'sync'.")
    if values["device-profiles"] == NONE_PROFILES and values["engine"] != "flower":
        raise ConfigError(f"mode = 'async' on engine = {values['engine']!r} orders arrivals on "
                          "the simulated clock, which needs device profiles: set "
                          "device-profiles = lognormal or a trace file (without them, only the "
                          "Flower engine runs it, in real time).")


def _check_cross_keys(values: Mapping[str, Value]) -> None:
    parse_tracking(str(values["tracking"]))
    workers = str(values["batched-workers"]).strip()
    if workers != "auto" and not (workers.isdigit() and int(workers) >= 1):
        raise ConfigError(f"batched-workers = {values['batched-workers']!r}: give a whole number "
                          "of worker processes (>= 1), or auto.")
    kind = dataset_kind(str(values["dataset"]), _columns(values))
    if kind == TOKENS and values["partition"] not in TEXT_PARTITIONS:
        raise ConfigError(f"partition = {values['partition']!r} splits by class label or "
                          f"rotates images, which mean nothing for dataset = "
                          f"{values['dataset']!r} (text; its label is the next character): "
                          f"choose {', '.join(TEXT_PARTITIONS)}.")
    if values["partition"] == "natural" and not has_natural_clients(str(values["dataset"]),
                                                                    _columns(values)):
        raise ConfigError(f"partition = 'natural' needs a dataset with its own clients, and "
                          f"{values['dataset']!r} has none: choose dataset = 'shakespeare', "
                          "npz:PATH with a client array, hf:... with a client-column, or "
                          "another partition.")
    if is_flwr(str(values["partition"])):
        check_flwr_partition(str(values["partition"]), str(values["partition-args"]),
                             values["num-clients"] + values["num-unseen-clients"],
                             values["seed"])
    elif str(values["partition-args"]).strip():
        raise ConfigError(f"partition-args = {values['partition-args']!r} is for partition = "
                          f"flwr:<Partitioner>, and partition = {values['partition']!r}: clear "
                          "partition-args.")
    if values["dataset"] == "synthetic" and values["partition"] != "natural":
        raise ConfigError(f"dataset = 'synthetic' generates each client's own data, so its "
                          f"clients are its partition: set partition = 'natural' (not "
                          f"{values['partition']!r}); synthetic-iid = true gives IID clients.")
    if values["dataset"] == "synthetic" and values["max-samples"]:
        raise ConfigError("max-samples subsamples a pooled dataset, and dataset = 'synthetic' "
                          "generates each client's data: set max-samples = 0 and size the "
                          "clients with min-samples-per-client, synthetic-size-power and "
                          "synthetic-max-samples.")
    if values["synthetic-max-samples"] < values["min-samples-per-client"] and (
            values["dataset"] == "synthetic"):
        raise ConfigError(f"synthetic-max-samples = {values['synthetic-max-samples']} is below "
                          f"min-samples-per-client = {values['min-samples-per-client']}; raise "
                          "it.")
    if kind == FEATURES and values["partition"] == "rotated":
        raise ConfigError(f"partition = 'rotated' rotates images, and dataset = "
                          f"{values['dataset']!r} holds feature vectors: choose another "
                          "partition.")
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
