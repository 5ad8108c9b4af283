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
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import tomllib

Value = bool | int | float | str


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


def _choices_of_methods() -> tuple[str, ...]:
    from pflalign.methods import METHODS

    return tuple(METHODS)


def _choices_of_models() -> tuple[str, ...]:
    from pflalign.models import MODELS

    return tuple(MODELS)


DATASETS = ("fashion-mnist", "mnist", "cifar10", "cifar100")
PARTITIONS = ("dirichlet", "iid", "pathological", "quantity", "rotated")

OPTIONS: tuple[Option, ...] = (
    # --- run -----------------------------------------------------------------------------------
    Option("methods", "fedavg,fedavg-ft,local,pflalign",
           "Comma-separated methods to run on the same partition and seed, or 'all' (every "
           "method except ablation variants). An entry may carry its own settings: "
           "'pflalign(pflalign-lr=2,pflalign-gamma=one)'.", "run"),
    Option("seed", 0, "Seed for the partition, model initialisation, client sampling and local "
           "training; the same seed and config give the same metrics.", "run", minimum=0),
    Option("rounds", 10, "Number of federated rounds per method.", "run", minimum=1),
    Option("eval-every", 5, "Evaluate every N rounds (the last round is always evaluated).",
           "run", minimum=1),
    Option("out-dir", "results", "Directory for results.json (created if missing).", "run"),
    # --- data ----------------------------------------------------------------------------------
    Option("dataset", "fashion-mnist", "Dataset: fashion-mnist (embedded default, read from "
           "/usr/share/datasets/fashion-mnist or data-root), mnist, cifar10, cifar100 "
           "(torchvision files under data-root).", "data", choices=DATASETS),
    Option("data-root", "", "Directory holding the dataset files; empty means the Debian "
           "package's directory for fashion-mnist and ./data for the others.", "data"),
    Option("download", False, "Let torchvision download a missing dataset into data-root.",
           "data"),
    Option("max-samples", 0, "Use a random (seeded) subset of this many samples of the pooled "
           "dataset; 0 uses all of it.", "data", minimum=0),
    Option("partition", "dirichlet", "How samples are split across clients: iid, dirichlet "
           "(label skew), pathological (classes-per-client classes each), quantity "
           "(power-law client sizes), rotated (domain shift: client groups with rotated images, "
           "dirichlet labels within; see rotation-angles).", "data", choices=PARTITIONS),
    Option("num-clients", 20, "Number of training clients (Flower SuperNodes).", "data",
           minimum=1),
    Option("num-unseen-clients", 0, "Extra clients that never train and are only evaluated "
           "(generalization to new clients, reported as unseen-acc).", "data", minimum=0),
    Option("rotation-angles", "0,30,60,90", "partition=rotated: comma-separated rotation angles "
           "in degrees, one per client group (domain); clients are spread round-robin over the "
           "groups.", "data"),
    Option("rotation-unseen-groups", 1, "partition=rotated: the last this many angles are held "
           "out: only the unseen clients come from them (leave-groups-out), so unseen-acc "
           "measures generalization to a new domain. Unused when num-unseen-clients = 0.",
           "data", minimum=0),
    Option("dirichlet-alpha", 0.1, "Concentration of the per-class Dirichlet over clients; "
           "smaller is more skewed.", "data", minimum=0.0, exclusive_minimum=True),
    Option("classes-per-client", 2, "Classes each client holds under partition=pathological.",
           "data", minimum=1),
    Option("quantity-power", 1.0, "Exponent s of partition=quantity: the k-th largest client "
           "holds a share proportional to k^-s.", "data", minimum=0.0,
           exclusive_minimum=True),
    Option("min-samples-per-client", 10, "Smallest number of samples any client may hold; the "
           "partitioner retries a bounded number of times and then fails with a clear error.",
           "data", minimum=2),
    Option("test-fraction", 0.25, "Fraction of each client's samples held out as its test split "
           "(stratified by label).", "data", minimum=0.0, maximum=1.0, exclusive_minimum=True,
           exclusive_maximum=True),
    # --- model and local training --------------------------------------------------------------
    Option("model", "cnn", "Model: cnn (PFLlib's 4-layer CNN), cnn-bn (the same with batch "
           "norm), mlp, resnet18.", "train"),
    Option("batch-size", 32, "Local mini-batch size.", "train", minimum=1),
    Option("local-epochs", 1, "Local epochs per round.", "train", minimum=1),
    Option("local-steps", 0, "If > 0, cap the local optimizer steps per round at this number.",
           "train", minimum=0),
    Option("lr", 0.05, "Local learning rate (SGD).", "train", minimum=0.0,
           exclusive_minimum=True),
    Option("momentum", 0.0, "Local SGD momentum (0 is plain SGD, as in FedAvg).", "train",
           minimum=0.0, maximum=1.0, exclusive_maximum=True),
    Option("weight-decay", 0.0, "Local L2 weight decay.", "train", minimum=0.0),
    Option("local-optimizer", "sgd", "Local optimizer of the methods that train with a standard "
           "one: sgd (lr, momentum), adam (adam-lr) or genie (genie-*); a new one every round. "
           "Methods with their own local rule (scaffold, apfl, perfedavg, pfedme, pflalign) "
           "refuse anything but sgd; pflalign-genie is pFLAlign with GENIE.", "train",
           choices=("sgd", "adam", "genie")),
    Option("adam-lr", 0.001, "Step size of local-optimizer = adam.", "train", minimum=0.0,
           exclusive_minimum=True),
    Option("genie-lr", 0.3, "GENIE's step size (the paper's convergence rate eta, ALGORITHMS.md "
           "2.5), for local-optimizer = genie and pflalign-genie. The paper's 0.015 (pretrained "
           "ResNets) trains a CNN from scratch too slowly; 0.3 was best of 0.015-1.0 on "
           "configs/rotated.toml, seeds 0-1 (README).", "genie", minimum=0.0,
           exclusive_minimum=True),
    Option("genie-moving-avg", 0.95, "GENIE's EMA decay beta.", "genie", minimum=0.0,
           maximum=1.0, exclusive_maximum=True),
    Option("genie-p", 0.4, "GENIE's mask drop probability.", "genie", minimum=0.0, maximum=1.0,
           exclusive_maximum=True),
    Option("genie-precondition", True, "GENIE: apply the OSGR preconditioner r * tau (false: "
           "step on the bias-corrected EMA mean).", "genie"),
    Option("genie-noise", True, "GENIE: add noise on low-confidence coordinates.", "genie"),
    Option("genie-mask", True, "GENIE: inverted-dropout mask on the update.", "genie"),
    # --- federation ----------------------------------------------------------------------------
    Option("fraction-train", 0.4, "Fraction of training clients sampled each round (at least "
           "one), drawn reproducibly from seed.", "federation", minimum=0.0, maximum=1.0,
           exclusive_minimum=True),
    # --- method hyperparameters ----------------------------------------------------------------
    Option("finetune-epochs", 1, "fedavg-ft: local epochs of fine-tuning of the global model "
           "before each evaluation.", "fedavg-ft", minimum=1),
    Option("pflalign-lr", 3.0, "pflalign: local learning rate. The preconditioner P is far below "
           "1 (it starts at (1-beta)^2 = 0.01), so this is of order 1, not an SGD rate.",
           "pflalign", minimum=0.0, exclusive_minimum=True),
    Option("pflalign-beta", 0.9, "pflalign: EMA decay of m, v and P.", "pflalign", minimum=0.0,
           maximum=1.0, exclusive_maximum=True),
    Option("pflalign-eps", 1e-12, "pflalign: numerical constant in the denominators.",
           "pflalign", minimum=0.0, exclusive_minimum=True),
    Option("pflalign-precondition", True, "pflalign: multiply the gradient by P (false: step on "
           "the raw gradient with the SGD rate 'lr').", "pflalign"),
    Option("pflalign-gamma", "adaptive", "pflalign: weight of the offset correction: adaptive "
           "(Gaussian sign agreement), zero, half, one, or hard (sign test).", "pflalign",
           choices=("adaptive", "zero", "half", "one", "hard")),
    Option("pflalign-personalize", True, "pflalign: start each round from global + the client's "
           "offset Delta (false: Delta = 0, no personalized initialization or correction).",
           "pflalign"),
    Option("pflalign-state", "client", "pflalign: where each client's offset Delta lives: client "
           "(its own state; the server sends the global model) or server (the strategy keeps it "
           "and sends the personalized initialization and Delta in the client's message).",
           "pflalign", choices=("client", "server")),
    Option("pflalign-local-update", "pflalign", "pflalign: the PersonalizedLocalUpdate: "
           "pflalign (preconditioner P and gamma correction, ALGORITHMS.md 1.4) or genie (GENIE's "
           "rule with per-client persistent state and no offset correction, 4.2).", "pflalign",
           choices=("pflalign", "genie")),
    Option("pflalign-bn", "global", "pflalign: batch-norm buffers come from the global model "
           "(global, ALGORITHMS.md 1.13 A6) or stay on each client (local, FedBN-style).",
           "pflalign", choices=("global", "local")),
    # --- pFL baselines (each method's paper; README "Methods") ---------------------------------
    Option("fedprox-mu", 0.01, "fedprox: weight mu of the proximal term mu/2 ||w - w_global||^2 "
           "(0 is FedAvg).", "fedprox", minimum=0.0),
    Option("scaffold-server-lr", 1.0, "scaffold: global step size eta_g applied to the averaged "
           "model change.", "scaffold", minimum=0.0, exclusive_minimum=True),
    Option("ditto-lambda", 0.1, "ditto: weight lambda of the personal model's proximal pull "
           "lambda/2 ||v - w_global||^2.", "ditto", minimum=0.0),
    Option("ditto-personal-epochs", 1, "ditto: local epochs of the personal model per round.",
           "ditto", minimum=1),
    Option("head-layers", 1, "fedper, fedrep: number of final parameterised layers kept on the "
           "clients (the personal head); 1 is the classifier.", "fedper/fedrep", minimum=1),
    Option("fedrep-head-epochs", 10, "fedrep: epochs of head training (body frozen) before the "
           "body's local-epochs (head frozen).", "fedrep", minimum=1),
    Option("apfl-alpha", 0.5, "apfl: initial mixing weight alpha of the personal model in "
           "alpha v + (1 - alpha) w.", "apfl", minimum=0.0, maximum=1.0),
    Option("apfl-adaptive", True, "apfl: learn alpha per client by gradient descent (false keeps "
           "it fixed).", "apfl"),
    Option("apfl-alpha-lr", 0.05, "apfl: step size of alpha's gradient step.", "apfl",
           minimum=0.0, exclusive_minimum=True),
    Option("perfedavg-alpha", 0.01, "perfedavg: inner (adaptation) step size alpha, also used "
           "for the personalization steps at evaluation (README: alpha >= 0.02 drives the "
           "meta-model itself to chance accuracy).", "perfedavg", minimum=0.0,
           exclusive_minimum=True),
    Option("perfedavg-beta", 0.05, "perfedavg: outer (meta) step size beta.", "perfedavg",
           minimum=0.0, exclusive_minimum=True),
    Option("perfedavg-eval-steps", 1, "perfedavg: SGD steps of personalization from the global "
           "model before evaluation.", "perfedavg", minimum=1),
    Option("pfedme-lambda", 15.0, "pfedme: Moreau-envelope weight lambda.", "pfedme",
           minimum=0.0, exclusive_minimum=True),
    Option("pfedme-k", 5, "pfedme: gradient steps K on the inner problem per mini-batch.",
           "pfedme", minimum=1),
    Option("pfedme-personal-lr", 0.05, "pfedme: step size of the inner (personal) steps.",
           "pfedme", minimum=0.0, exclusive_minimum=True),
    Option("pfedme-beta", 1.0, "pfedme: server mixing beta in (1 - beta) w + beta avg(w_i) "
           "(1 is FedAvg's average).", "pfedme", minimum=0.0, exclusive_minimum=True),
    Option("fedala-eta", 1.0, "fedala: step size of the aggregation weights W.", "fedala",
           minimum=0.0, exclusive_minimum=True),
    Option("fedala-rand-percent", 80, "fedala: percent of the client's train split used to "
           "learn W each round.", "fedala", minimum=1, maximum=100),
    Option("fedala-layers", 1, "fedala: number of final parameterised layers merged with learned "
           "weights (lower layers take the global model).", "fedala", minimum=1),
    Option("fedala-threshold", 0.1, "fedala: the first adaptation stops when the std of the last "
           "fedala-num-pre-loss losses is below this.", "fedala", minimum=0.0,
           exclusive_minimum=True),
    Option("fedala-num-pre-loss", 10, "fedala: number of recent losses in the stopping rule.",
           "fedala", minimum=2),
    # --- GGA annealed warm start (any method; ALGORITHMS.md 4.3 item 1) -------------------------
    Option("gga", False, "Federated annealed warm start: in rounds gga-start..gga-end the server "
           "proposes gga-candidates perturbed global models (from a seed), the round's clients "
           "return per-candidate losses and gradient sketches, and the server moves to the "
           "candidate on which the clients' gradients agree most (within the loss tolerance) "
           "before training.", "gga"),
    Option("gga-start", 2, "First round of the annealing window.", "gga", minimum=1),
    Option("gga-end", 4, "Last round of the annealing window (inclusive).", "gga", minimum=1),
    Option("gga-candidates", 8, "Candidates proposed per annealing round.", "gga", minimum=1),
    Option("gga-rho", 0.03, "Candidates perturb the featurizer (all trainable parameters but "
           "the classifier) by U(-rho, rho) noise (best of 0.001-0.1 on configs/rotated.toml, "
           "seeds 0-1; at 0.1 no candidate passes the loss tolerance).", "gga", minimum=0.0,
           exclusive_minimum=True),
    Option("gga-tolerance", 0.1, "A candidate is accepted only if its mean loss exceeds the "
           "anchor's by less than this.", "gga"),
    Option("gga-objective", "min", "Clients' agreement on a candidate: min (GGA's rule) or mean "
           "pairwise cosine of their gradients.", "gga", choices=("min", "mean")),
    Option("gga-sketch-dim", 1024, "Gradients are uploaded as count sketches of this many entries "
           "(a sparse random projection that preserves cosines in expectation); 0 uploads the "
           "full gradient.", "gga", minimum=0),
    Option("gga-batch-size", 64, "Samples of its train split on which each client evaluates the "
           "candidates.", "gga", minimum=1),
    # --- simulation engine ---------------------------------------------------------------------
    Option("client-resources-num-cpus", 1.0, "CPU cores per simulated client (Ray resource; "
           "also the client's torch thread count).", "simulation", minimum=0.0,
           exclusive_minimum=True),
    Option("client-resources-num-gpus", 0.0, "GPUs per simulated client (fractions share a "
           "GPU); clients use cuda when this is > 0 and a GPU exists.", "simulation",
           minimum=0.0),
)

OPTIONS_BY_KEY: dict[str, Option] = {o.key: o for o in OPTIONS}
_DYNAMIC_CHOICES: dict[str, Callable[[], tuple[str, ...]]] = {"model": _choices_of_models}


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

    choices = opt.choices or (_DYNAMIC_CHOICES[key]() if key in _DYNAMIC_CHOICES else None)
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
                 "test-fraction", "client-resources-num-cpus", "client-resources-num-gpus")


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
    from pflalign.methods import METHODS

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
    from pflalign.methods import METHODS

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
    """A complete, validated configuration (every key of the schema present and checked)."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, object] | None = None, source: str = "the config"):
        merged: dict[str, Value] = defaults()
        for key, value in (values or {}).items():
            merged[key] = coerce(key, value, source)
        _check_cross_keys(merged)
        self._values = merged

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
        return int(self["num-clients"]) + int(self["num-unseen-clients"])


def parse_angles(text: str) -> tuple[float, ...]:
    """'rotation-angles' as a tuple of finite floats (at least one)."""
    try:
        angles = tuple(float(a) for a in str(text).split(",") if a.strip())
    except ValueError:
        raise ConfigError(f"Config key 'rotation-angles' = {text!r} must be comma-separated "
                          "numbers of degrees, e.g. '0,30,60,90'.") from None
    if not angles or not all(math.isfinite(a) for a in angles):
        raise ConfigError(f"Config key 'rotation-angles' = {text!r} needs at least one finite "
                          "angle, e.g. '0,30,60,90'.")
    return angles


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
    from pflalign.methods import METHODS, method_overrides

    refusing = []
    for choice in parse_methods(str(values["methods"])):
        spec = METHODS[choice.name]
        overrides = method_overrides(spec, values, dict(choice.overrides))
        if not spec.local_optimizer and overrides.get(
                "local-optimizer", values["local-optimizer"]) != "sgd":
            refusing.append(choice.label)
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
