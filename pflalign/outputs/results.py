"""results.json and the terminal report: per-round progress lines and the comparison table."""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

import numpy as np

from pflalign.settings.options import ConfigError

_PACKAGES = ("pflalign", "torch", "torchvision", "flwr", "ray", "numpy")


def versions() -> dict[str, str]:
    """The interpreter, the platform, the packages a run depends on, and the commit of the
    pflalign source that ran (:func:`source_commit`; absent outside a git checkout)."""
    found = {"python": platform.python_version(), "platform": platform.platform()}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    commit = source_commit()
    if commit is not None:
        found["commit"] = commit
    return found


@functools.cache
def source_commit() -> str | None:
    """The git commit of the checkout this package runs from, with ``+modified`` when its
    tracked files differ from it; None when it is not a git checkout (an installed wheel) or git
    is missing. Asked once per process."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+modified" if dirty.stdout.strip() else "")


def new_results(config: Mapping[str, object], partition_summary: Mapping[str, object]) -> dict:
    return {"config": dict(config), "versions": versions(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "methods": {},
            "partition": dict(partition_summary)}


def json_safe(value: object) -> object:
    """``value`` with non-finite floats as None (JSON has no NaN), through dicts and lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


#: results.json lists at most this many clients in ``partition.clients`` and in each method's
#: ``clients``; a longer list is written whole to a gzip-compressed JSON file beside it
CLIENTS_IN_RESULTS = 10_000
#: the stream of the seeded draw of the clients a bounded list keeps
KEPT_CLIENTS_STREAM = 23
#: the compressed lists this process wrote, by path: the list (its id and length) written there
_written_lists: dict[Path, tuple[int, int]] = {}


def _write_whole(path: Path, clients: list) -> None:
    """``clients`` to ``path`` as gzip JSON, unless this process wrote this very list there."""
    if _written_lists.get(path) == (id(clients), len(clients)) and path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:  # one string through the C encoder (json.dump's many small writes took 60 s at a
        # million clients); json_safe's walk only where a value is not finite
        text = json.dumps(clients, separators=(",", ":"), allow_nan=False)
    except ValueError:
        text = json.dumps(json_safe(clients), separators=(",", ":"))
    tmp.write_bytes(gzip.compress(text.encode(), compresslevel=6))
    os.replace(tmp, path)
    _written_lists[path] = (id(clients), len(clients))


def _bounded_run(out: Path, run: Mapping[str, object], seed: int, where: str = "",
                 ) -> Mapping[str, object]:
    """One run's ``partition.clients`` and entries' ``clients`` as results.json keeps them: all
    of a list up to :data:`CLIENTS_IN_RESULTS`; beyond that the records of the clients one draw
    keeps (:data:`CLIENTS_IN_RESULTS` ids of the long lists' clients, by the seed: the same
    clients in every list), with the whole list written to ``out/where...json.gz`` and
    ``clients-total``, ``clients-file`` (relative to ``out``) beside it."""
    partition = run.get("partition")
    methods = run.get("methods")
    lists: dict[tuple[str, ...], list] = {}
    if isinstance(partition, Mapping) and len(partition.get("clients") or ()) > (
            CLIENTS_IN_RESULTS):
        lists[("partition",)] = partition["clients"]
    if isinstance(methods, Mapping):
        for label, entry in methods.items():
            if isinstance(entry, Mapping) and len(entry.get("clients") or ()) > (
                    CLIENTS_IN_RESULTS):
                lists[("methods", label)] = entry["clients"]
    if not lists:
        if (not where and isinstance(partition, Mapping) and partition.get("clients")
                and "clients-file" not in partition):  # an earlier run's whole list
            (out / "partition.json.gz").unlink(missing_ok=True)
        return run
    ids = np.unique(np.concatenate([np.fromiter((c["id"] for c in clients), np.int64)
                                    for clients in lists.values()]))
    rng = np.random.default_rng([seed, KEPT_CLIENTS_STREAM])
    kept = set(rng.choice(ids, CLIENTS_IN_RESULTS, replace=False).tolist())
    bounded_run = dict(run)
    if isinstance(methods, Mapping):
        bounded_run["methods"] = dict(methods)
    for key, clients in lists.items():
        name = (f"{where}partition.json.gz" if key == ("partition",)
                else f"{where}clients/{slug(key[1])}.json.gz")
        _write_whole(out / name, clients)
        record = dict(partition if key == ("partition",) else methods[key[1]])
        record.update({"clients": [c for c in clients if c["id"] in kept],
                       "clients-total": len(clients), "clients-file": name})
        if key == ("partition",):
            bounded_run["partition"] = record
        else:
            bounded_run["methods"][key[1]] = record
    return bounded_run


def bounded(out: Path, results: Mapping[str, object]) -> Mapping[str, object]:
    """``results`` (a run, or a study and each of its runs) with its per-client lists bounded
    (:func:`_bounded_run`); a study's runs' whole lists go to ``runs-clients/<n>/``."""
    seed = int((results.get("config") or {}).get("seed") or 0)
    if results.get("kind") == "study" and isinstance(results.get("runs"), list):
        runs = [_bounded_run(out, run, int(run.get("seed") or 0), f"runs-clients/{n}/")
                if isinstance(run, Mapping) else run
                for n, run in enumerate(results["runs"])]
        return {**results, "runs": runs}
    return _bounded_run(out, results, seed)


def write_results(out_dir: str | Path, results: Mapping[str, object]) -> Path:
    """Write ``out_dir/results.json`` atomically (a crash never leaves a half-written file),
    with its per-client lists bounded (:func:`bounded`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(json_safe(bounded(out, results)), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def prepare_output(out_dir: str | Path, overwrite: bool = False, create: bool = True) -> Path:
    """Before a run starts: create ``out_dir`` and check that ``results.json`` can be written
    there (a probe file is written and removed), and that it would not replace an earlier
    run's results unless ``overwrite``. Returns the path results will be written to; raises
    :class:`~pflalign.settings.options.ConfigError` with a one-line reason otherwise. With
    ``create`` false nothing is written: the earlier results are checked, and the nearest folder
    that exists must be writable."""
    out = Path(out_dir)
    path = out / "results.json"
    if path.exists() and not overwrite:
        raise ConfigError(f"'{path}' already exists; pass --overwrite to replace it, or choose "
                          "another directory with --out.")
    if not create:
        existing = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"Cannot write results to '{out}' ('{existing}' is not a writable "
                              "folder); choose a writable directory with --out.")
        return path
    probe = out / f".pflalign-write-test-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"Cannot write results to '{out}' ({err.strerror or err}); choose a "
                          "writable directory with --out.") from err
    return path


def _pct(value: object) -> str:
    return f"{100 * value:6.2f}" if isinstance(value, float) and math.isfinite(value) else "     -"


def _mb(value: object) -> str:
    return f"{value / 1e6:.1f}MB" if isinstance(value, int | float) else "-"


#: an entry's rounds left after its first, in seconds, above which the run says how long they
#: will take and which keys bound a round's work
LONG_RUN_SECONDS = 120.0


def estimate_line(method: str, row: Mapping[str, object], rounds: int) -> str | None:
    """After an entry's first round, when the rest would take more than
    :data:`LONG_RUN_SECONDS` at that round's pace: how long, and the keys that bound a round's
    work (None otherwise)."""
    if row.get("round") != 1 or rounds < 2 or "round-seconds" not in row:
        return None
    seconds = float(row["round-seconds"])  # type: ignore[arg-type]
    rest = seconds * (rounds - 1)
    if rest <= LONG_RUN_SECONDS:
        return None
    return (f"[{method}] round 1 took {seconds:.0f} s, so the other {rounds - 1} rounds take "
            f"about {_duration(rest)}; local-steps (optimizer steps per round), local-epochs, "
            "fraction-train and max-samples bound a round's work.")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def round_line(method: str, row: Mapping[str, object], rounds: int) -> str:
    """One progress line for a finished round."""
    parts = [f"[{method}] round {row['round']:>3}/{rounds}"]
    if "train-loss" in row:
        parts.append(f"loss {row['train-loss']:.4f}")
    for key, label in (("personal-acc", "personal"), ("global-acc", "global"),
                       ("unseen-acc", "unseen")):
        if key in row:
            parts.append(f"{label} {_pct(row[key]).strip()}%")
    for key, label in (("personal-mse", "personal mse"), ("personal-r2", "R2"),
                       ("global-mse", "global mse")):  # task = regression
        if key in row:
            parts.append(f"{label} {row[key]:.4g}")
    parts.append(f"{row['round-seconds']:.1f}s")
    parts.append(f"up {_mb(row['bytes-up'])} down {_mb(row['bytes-down'])}")
    for key in ("failures", "timeouts", "rejected", "eval-failures", "rolled-back"):
        if row.get(key):
            parts.append(f"{key} {row[key]}")
    if row.get("evaluated", 0) < row.get("eval-clients", 0):
        parts.append(f"evaluated {row['evaluated']} of {row['eval-clients']}")
    return "  ".join(parts)


TABLE_COLUMNS = (
    ("personal-acc", "personal"), ("personal-acc-unweighted", "unweighted"),
    ("personal-acc-std", "std"), ("personal-acc-bottom10", "bottom10"),
    ("global-acc", "global"), ("unseen-acc", "unseen"),
)


#: ... under task = regression
REGRESSION_COLUMNS = (
    ("personal-mse", "mse"), ("personal-mae", "mae"), ("personal-r2", "R2"),
    ("global-mse", "global mse"), ("unseen-mse", "unseen mse"),
)


def _number(value: object) -> str:
    return "-" if value is None else f"{value:.4g}"


def comparison_table(methods: Mapping[str, Mapping[str, object]]) -> str:
    """The final metrics of each method side by side (accuracies in %; a regression's errors
    and R^2 as they are)."""
    width = max([len("method"), *map(len, methods)])
    regression = any("personal-mse" in r.get("final", {}) for r in methods.values())
    columns = REGRESSION_COLUMNS if regression else TABLE_COLUMNS
    show = _number if regression else _pct
    # a language model's runs: the personal perplexity beside the token accuracies
    ppl = any("personal-ppl" in r.get("final", {}) for r in methods.values())
    head = f"{'method':<{width}}  " + "  ".join(f"{label:>10}" for _, label in columns)
    head += f"  {'ppl':>8}" if ppl else ""
    head += f"  {'evaluated':>9}  {'s/round':>8}  {'MB up':>8}  {'MB down':>8}"
    lines = [head, "-" * len(head)]
    partial = []
    for name, result in methods.items():
        final = result.get("final", {})
        cells = "  ".join(f"{show(final.get(key)):>10}" for key, _ in columns)
        if ppl:
            value = final.get("personal-ppl")
            cells += f"  {'-' if value is None else f'{value:.2f}':>8}"
        up, down = final.get("bytes-up", 0) / 1e6, final.get("bytes-down", 0) / 1e6
        evaluated, asked = final.get("evaluated"), final.get("eval-clients")
        count = f"{evaluated}/{asked}" if asked is not None else "-"
        if asked is not None and evaluated < asked:
            partial.append(f"{name}: evaluated {evaluated} of {asked} clients in its last "
                           "evaluation; its accuracies cover those only.")
        lines.append(f"{name:<{width}}  {cells}  {count:>9}  "
                     f"{final.get('seconds-per-round', 0):8.2f}  {up:8.1f}  {down:8.1f}")
    return "\n".join(lines + partial + budget_lines(methods) + privacy_notes(methods)
                     + sample_notes(methods) + audit_notes(methods))


def budget_lines(methods: Mapping[str, Mapping[str, object]]) -> list[str]:
    """Each method at the run's simulated-time budget (``time-budget``), when there is one."""
    at = {name: result.get("final", {}).get("at-time-budget") for name, result in methods.items()}
    at = {name: value for name, value in at.items() if value}
    if not at:
        return []
    budget = next(iter(at.values()))["budget"]
    lines = [f"At the time budget of {budget:g} simulated s (the last evaluation by then):"]
    for name, value in at.items():
        if "round" not in value:
            lines.append(f"  {name}: no evaluation within the budget")
            continue
        accs = ", ".join(f"{k} {_pct(value[k]).strip()}%" for k in ("personal-acc", "global-acc",
                                                             "unseen-acc") if k in value)
        lines.append(f"  {name}: {accs} (round {value['round']}, sim-time "
                     f"{value['sim-time']:.0f} s)")
    return lines


def privacy_notes(methods: Mapping[str, Mapping[str, object]]) -> list[str]:
    """The privacy each method's run spent (``dp``; docs/privacy.md): its epsilon at the run's
    delta, from its last round."""
    finals = {name: result.get("final", {}) for name, result in methods.items()}
    spent = {name: final["dp-epsilon"] for name, final in finals.items()
             if final.get("dp-epsilon") is not None}
    if not spent:
        return []
    return ["Differential privacy: " + "; ".join(
        f"{name} spent epsilon {value:.3g}" + (
            f" (against the server, which knows who took part: "
            f"{finals[name]['dp-epsilon-server']:.3g})"
            if finals[name].get("dp-epsilon-server") is not None else "")
        for name, value in spent.items()) + " (at the run's dp-delta, user-level)."]


def sample_notes(methods: Mapping[str, Mapping[str, object]]) -> list[str]:
    """What a final evaluation of a sample (``eval-clients``) says of the whole population:
    each method's pooled accuracy (a regression's error) with its 95% interval."""
    notes = []
    for name, result in methods.items():
        final = result.get("final", {})
        if "eval-population" not in final:
            continue
        for key, scale, unit in (("personal-acc", 100, "%"), ("unseen-acc", 100, "%"),
                                 ("personal-mse", 1, ""), ("unseen-mse", 1, "")):
            low, high = final.get(f"{key}-ci-low"), final.get(f"{key}-ci-high")
            if key in final and low is not None:
                notes.append(
                    f"{name}: {key} {scale * final[key]:.4g}{unit} from {final['evaluated']:,} "
                    f"sampled of {final['eval-population']:,} clients (eval-clients); 95% "
                    f"interval for the whole population [{scale * low:.4g}, "
                    f"{scale * high:.4g}]{unit}.")
    return notes


def audit_notes(methods: Mapping[str, Mapping[str, object]]) -> list[str]:
    """What the evaluation audit (:mod:`pflalign.round.features.audit`) says of the table's
    accuracies."""
    finals = {name: result.get("final", {}) for name, result in methods.items()}
    audited = {name: final["eval-audited"] for name, final in finals.items()
               if "eval-audited" in final}
    if not audited:
        return []
    unaudited = [name for name, count in audited.items() if count == 0]
    notes = []
    if unaudited:
        notes.append(f"{', '.join(unaudited)}: accuracies are self-reported by the clients (the "
                     "server recomputed none of the last evaluation; eval-audit-fraction = 0).")
    for name, final in finals.items():
        if final.get("eval-audit-rejected"):
            notes.append(f"{name}: {final['eval-audit-rejected']} of {final['eval-audited']} "
                         "clients' last evaluations disagreed with the server's recomputation "
                         "and are left out.")
    if len(unaudited) < len(audited):
        rows = "the other rows" if unaudited else "every row above"
        notes.append(f"Audit: the server recomputed the last evaluation of every client that "
                     f"replied, for {rows} (eval-audit-fraction samples the earlier rounds).")
    return notes


def slug(label: str) -> str:
    """A safe file name for a label (a method entry's, a scenario's, a setting's): ``fedavg``
    stays ``fedavg``; a label with other characters (``pflalign(pflalign-lr=2)``) gets them
    replaced and a short hash of the label appended, so two labels never share a file."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-.")[:80] or "entry"
    if name == label:
        return name
    digest = hashlib.sha256(json.dumps(label, sort_keys=True).encode()).hexdigest()
    return f"{name}-{digest[:8]}"


class Reporter:
    """Prints progress to the terminal (stdout, flushed), unless quiet."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet

    def info(self, text: str) -> None:
        if not self.quiet:
            print(text, flush=True)

    def result(self, text: str) -> None:
        """Final results: printed even when quiet."""
        print(text, flush=True)

    def warn(self, text: str) -> None:
        print(f"WARNING: {text}", file=sys.stderr, flush=True)

    def round(self, label: str, row: Mapping[str, object], rounds: int) -> None:
        """A method entry finished a round (after its first, an estimate of the rest when that
        is long: :func:`estimate_line`)."""
        self.info(round_line(label, row, rounds))
        estimate = estimate_line(label, row, rounds)
        if estimate:
            self.info(estimate)

    def stage(self, text: str, done: int, total: int) -> None:
        """A study moves on to its next group of cells (``done`` of ``total`` cells finished)."""
        self.info(text)

    def close(self) -> None:
        """The run is over (a live display stops)."""


class LiveReporter(Reporter):
    """On a terminal: a suite-level bar over a study's cells and one live line for the running
    method entry (round, latest metrics, ETA), drawn with rich; warnings and results print above
    them. Use :func:`make_reporter` to get it only where stdout is a terminal."""

    def __init__(self) -> None:
        super().__init__(quiet=False)
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.console = Console(highlight=False)
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), console=self.console, transient=False)
        self.suite = None
        self.line = self.progress.add_task("starting", total=None)
        self.started: dict[str, float] = {}
        self.progress.start()

    def info(self, text: str) -> None:
        self.console.print(text, markup=False)

    def result(self, text: str) -> None:
        self.console.print(text, markup=False)

    def warn(self, text: str) -> None:
        self.console.print(f"WARNING: {text}", markup=False, style="yellow")

    def round(self, label: str, row: Mapping[str, object], rounds: int) -> None:
        now = time.perf_counter()
        number = int(row["round"])  # type: ignore[call-overload]
        start = self.started.setdefault(label, now - float(row["round-seconds"]))  # type: ignore[arg-type]
        if number == 1:
            start = self.started[label] = now - float(row["round-seconds"])  # type: ignore[arg-type]
        eta = (now - start) / number * (rounds - number)
        parts = [f"[{label}] round {number}/{rounds}"]
        if "train-loss" in row:
            parts.append(f"loss {row['train-loss']:.4f}")
        if "personal-acc" in row:
            parts.append(f"personal {_pct(row['personal-acc']).strip()}%")
        parts.append(f"ETA {eta:.0f}s")
        self.progress.update(self.line, description="  ".join(parts), total=rounds,
                             completed=number)
        estimate = estimate_line(label, row, rounds)
        if estimate:
            self.console.print(estimate, markup=False)

    def stage(self, text: str, done: int, total: int) -> None:
        if self.suite is None:
            self.suite = self.progress.add_task("cells", total=total)
        self.progress.update(self.suite, completed=done, description="study cells")
        self.console.print(text, markup=False)

    def close(self) -> None:
        self.progress.stop()


def make_reporter(quiet: bool = False) -> Reporter:
    """A :class:`LiveReporter` when stdout is a terminal (and not quiet), else plain lines."""
    if not quiet and sys.stdout.isatty() and os.environ.get("TERM") != "dumb":
        return LiveReporter()
    return Reporter(quiet=quiet)
