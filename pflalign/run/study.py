"""Studies: a config over several seeds, scenarios and sweep settings, with fair tuning and resume.

A *study* runs every method of a config on each *cell group* (scenario × sweep setting × seed) and
writes one ``results.json`` over all of them, a tidy ``results.csv``, and a report with plots
(:mod:`pflalign.outputs.report`). It is what ``simulate.py --seeds / --suite / --sweep / --tune``
build:

- **Seeds.** ``seed`` fixes the partition, the initial model, the sampling and every client's
  batches, so every method of a group sees the same ones, and a method's results over seeds are
  *paired* with the reference method's (:mod:`pflalign.outputs.stats`).
- **Scenarios.** ``configs/scenarios/*.toml`` are named settings; ``--suite`` runs them all, and
  ``--suite language`` those of ``configs/scenarios/language/``.
- **Sweeps.** ``--sweep key=v1,v2`` runs every value (a grid over several keys), one row each,
  with no selection.
- **Tuning** (``--tune N``): each method gets the same budget of N trials of the same rounds from
  its declared search space (:attr:`pflalign.methods.MethodSpec.search_space`), sampled by
  Optuna (:mod:`pflalign.run.tuning`: its configured values first, then seeded random points,
  then TPE), on every scenario of the study. Every trial runs on the *tuning seeds* with
  ``evaluate-on = validation``: each client's test split is never built, and the trial's score
  is its final ``personal-acc`` on a validation split carved from each client's training data
  (:func:`pflalign.data.federated.validation_partition`). Each scenario's best trial (ties: the
  earlier) is then run on the evaluation seeds, which must be disjoint from the tuning seeds.
- **Resume.** Each group's entries live in their own directory with their own ``results.json``
  and checkpoints, and the tuning's trials in its Optuna storage; ``simulate.py --resume DIR``
  reads the plan saved in ``DIR/plan.json`` and recomputes nothing that finished
  (:func:`pflalign.run.driver.run_methods` with ``resume``).

A study of one scenario, one seed and no sweep or tuning is a plain run: its ``results.json`` is
the run's own, written in the output directory as always.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pflalign.methods.registry import METHODS
from pflalign.outputs.report import COMPARABLE_METRICS, setting_label
from pflalign.outputs.results import Reporter, bounded, slug, write_results
from pflalign.outputs.stats import higher_is_better, is_fraction
from pflalign.outputs.tracking import Trackers, TrackingReporter, parse_tracking
from pflalign.run import tuning
from pflalign.run.config import (
    MethodChoice,
    build_settings,
    load_toml,
    method_choices,
    method_labels,
    parse_methods,
    parse_override,
    toml_literal,
)
from pflalign.settings.options import ConfigError, Value
from pflalign.settings.params import Search, edges
from pflalign.settings.schema import Settings

#: the version of the results.json layout (a single run's and a study's)
SCHEMA_VERSION = 2
#: where the named scenarios live
SCENARIO_DIR = Path(__file__).resolve().parents[2] / "configs" / "scenarios"
#: ``--suite NAME`` -> the folder of its scenarios: the default suite is sized for a 2-core
#: machine (Fashion-MNIST and synthetic data); ``language`` holds federated Shakespeare and a
#: LoRA language model, hours each on 2 cores
SUITES = {"default": SCENARIO_DIR, "language": SCENARIO_DIR / "language"}
DEFAULT_SUITE = "default"
#: the metric tuning optimizes (on validation data) and tables lead with, unless --metric names
#: another of :data:`~pflalign.outputs.report.COMPARABLE_METRICS`
METRIC = "personal-acc"
#: ... and a regression's (task = regression), lower is better
REGRESSION_METRIC = "personal-mse"
PLAN_FILE = "plan.json"

#: runs one cell group: (its settings, reporter, resume) -> its results (run_methods' dict)
GroupRunner = Callable[[Settings, Reporter, bool], dict]


def scenario_names(suite: str = DEFAULT_SUITE) -> list[str]:
    """The scenarios of a suite (:data:`SUITES`), sorted."""
    if suite not in SUITES:
        raise ConfigError(f"Unknown suite '{suite}'; the suites are: {', '.join(SUITES)}.")
    return sorted(p.stem for p in SUITES[suite].glob("*.toml"))


def scenario_file(name: str) -> Path:
    """A scenario's file, from whichever suite holds it."""
    for folder in SUITES.values():
        path = folder / f"{name}.toml"
        if path.is_file():
            return path
    known = "; ".join(f"{suite}: {', '.join(scenario_names(suite)) or 'none'}"
                      for suite in SUITES)
    raise ConfigError(f"Unknown scenario '{name}'; the scenarios are ({known}), files in "
                      f"{SCENARIO_DIR}.")


def parse_seeds(text: str, what: str = "--seeds") -> tuple[int, ...]:
    """'0,1,2' or '0-4' (or a mix) as distinct non-negative integers, in order."""
    seeds: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match:
            raise ConfigError(f"{what} takes non-negative integers such as '0,1,2' or '0-4'; "
                              f"got {text!r}.")
        low, high = int(match[1]), int(match[2] or match[1])
        if high < low:
            raise ConfigError(f"{what}: the range '{part}' is empty.")
        seeds += [s for s in range(low, high + 1) if s not in seeds]
    if not seeds:
        raise ConfigError(f"{what} names no seed; give e.g. '0,1,2'.")
    return tuple(seeds)


def parse_sweep(items: Sequence[str]) -> dict[str, tuple[Value, ...]]:
    """``key=v1,v2`` items as key -> validated values (a grid over all keys)."""
    sweep: dict[str, tuple[Value, ...]] = {}
    for item in items:
        key, _, raw = item.partition("=")
        key = key.strip()
        if not raw.strip():
            raise ConfigError(f"--sweep {item!r} is not of the form key=v1,v2.")
        if key in ("methods", "seed", "out-dir"):
            raise ConfigError(f"--sweep cannot vary '{key}' (use --methods or --seeds).")
        if key in sweep:
            raise ConfigError(f"--sweep names '{key}' twice.")
        values = tuple(parse_override(f"{key}={v.strip()}")[1] for v in raw.split(",")
                       if v.strip())
        if len(set(values)) != len(values):
            raise ConfigError(f"--sweep {item!r} lists a value twice.")
        sweep[key] = values
    return sweep


@dataclass
class Plan:
    """What a study runs; saved as ``plan.json`` so that ``--resume`` runs the same."""

    #: scenario name ("" for the config given) -> its full config values
    scenarios: dict[str, dict[str, Value]]
    seeds: tuple[int, ...]
    sweep: dict[str, tuple[Value, ...]] = field(default_factory=dict)
    #: the method the others are paired against (None: fedavg when it runs, else the first)
    reference: str | None = None
    tune: int = 0
    tune_seeds: tuple[int, ...] = ()
    out_dir: str = "results"
    command: str = ""
    #: the metric the statistics, the ranks and the tuning use (its direction and scale are
    #: :func:`pflalign.outputs.stats.higher_is_better` and ``metric_scale``)
    metric: str = METRIC
    #: what the config parser decided that the user did not set (:attr:`Settings.notes`), for
    #: the command to print; not saved
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.scenarios:
            raise ConfigError("A study needs at least one scenario.")
        if self.metric == METRIC and self.settings(next(iter(self.scenarios))).run.task == \
                "regression":
            self.metric = REGRESSION_METRIC  # a regression has no accuracy
        if self.metric not in COMPARABLE_METRICS:
            raise ConfigError(f"--metric {self.metric!r} is not a metric a run reports at its "
                              f"end; choose one of {', '.join(COMPARABLE_METRICS)}.")
        labels = method_labels(self.settings(next(iter(self.scenarios))))
        if self.reference is None:
            self.reference = "fedavg" if "fedavg" in labels else labels[0]
        if self.reference not in labels:
            raise ConfigError(f"--reference {self.reference!r} is not one of the methods run "
                              f"({', '.join(labels)}).")
        if self.tune:
            overlap = sorted(set(self.seeds) & set(self.tune_seeds))
            if overlap:
                raise ConfigError(f"The tuning seeds and the evaluation seeds overlap "
                                  f"({', '.join(map(str, overlap))}); a method must not be "
                                  "evaluated on the seeds it was tuned on: pick disjoint "
                                  "--tune-seeds.")
            if not self.tune_seeds:
                raise ConfigError("--tune needs at least one tuning seed (--tune-seeds).")
            tuning.require_optuna()
            searched = {k for c in method_choices(self.settings(next(iter(self.scenarios))))
                        for k in METHODS[c.name].search_space}
            clash = sorted(searched & set(self.sweep))
            if clash:
                raise ConfigError(f"--sweep varies {', '.join(clash)}, which --tune chooses "
                                  "(the tuned value would win); sweep other keys, or tune "
                                  "without that sweep.")

    @property
    def single(self) -> bool:
        """One scenario, one seed, no sweep or tuning: a plain run."""
        return (len(self.scenarios) == 1 and len(self.seeds) == 1 and not self.sweep
                and not self.tune)

    def settings(self, scenario: str) -> Settings:
        return build_settings(self.scenarios[scenario], source=f"scenario '{scenario}'"
                        if scenario else "the config")

    def settings_list(self) -> list[dict[str, Value]]:
        """The sweep's settings, in grid order ([{}] without a sweep)."""
        keys = list(self.sweep)
        return [dict(zip(keys, values, strict=True))
                for values in itertools.product(*self.sweep.values())] or [{}]

    def to_json(self) -> dict:
        return {"schema-version": SCHEMA_VERSION, "scenarios": self.scenarios,
                "seeds": list(self.seeds), "sweep": {k: list(v) for k, v in self.sweep.items()},
                "reference": self.reference, "tune": self.tune,
                "tune-seeds": list(self.tune_seeds), "out-dir": self.out_dir,
                "command": self.command, "metric": self.metric}

    @classmethod
    def from_json(cls, data: Mapping) -> Plan:
        return cls(scenarios=dict(data["scenarios"]), seeds=tuple(data["seeds"]),
                   sweep={k: tuple(v) for k, v in data["sweep"].items()},
                   reference=data["reference"], tune=int(data["tune"]),
                   tune_seeds=tuple(data["tune-seeds"]), out_dir=data["out-dir"],
                   command=data.get("command", ""), metric=data.get("metric", METRIC))

    @classmethod
    def load(cls, directory: str | Path) -> Plan:
        path = Path(directory) / PLAN_FILE
        if not path.is_file():
            raise ConfigError(f"--resume {directory}: there is no {PLAN_FILE} there; it is "
                              "written when a run starts, so this is not a run's output "
                              "directory.")
        try:
            plan = cls.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"'{path}' cannot be read ({err}).") from err
        plan.out_dir = str(directory)
        return plan

    def save(self) -> Path:
        out = Path(self.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / PLAN_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        tmp.replace(path)
        return path


def scenario_values(name: str, overrides: Sequence[str],
                    extra: Mapping[str, object]) -> dict[str, Value]:
    """A scenario's full config values: its file, then ``--set`` overrides, then ``extra``."""
    return scenario_settings(name, overrides, extra).to_dict()


def scenario_settings(name: str, overrides: Sequence[str],
                      extra: Mapping[str, object]) -> Settings:
    """A scenario's settings: its file, then ``--set`` overrides, then ``extra``."""
    base = build_settings(load_toml(scenario_file(name)), source=f"scenario '{name}'")
    changes: dict[str, object] = dict(parse_override(text) for text in overrides)
    changes.update(extra)
    return base.replace(changes, source="the command line") if changes else base


# --- trials -------------------------------------------------------------------------------------
def method_space(choice: MethodChoice, settings: Settings,
                 ) -> tuple[dict[str, Search], dict[str, Value]]:
    """A method entry's search space (less the keys its entry fixes) and its configured values
    of those keys (its entry's, else the config's)."""
    fixed = dict(choice.overrides)
    space = {k: v for k, v in METHODS[choice.name].search_space.items() if k not in fixed}
    return space, {k: fixed.get(k, settings[k]) for k in space}


def method_budget(space: Mapping[str, Search], budget: int) -> int:
    """Trials a method entry gets: ``budget``, or one (its configured values) without a
    space."""
    return budget if space else 1


def entry(choice: MethodChoice, params: Mapping[str, Value]) -> str:
    """The method entry of ``choice`` with ``params`` added to its own overrides."""
    merged = {**dict(choice.overrides), **params}
    if not merged:
        return choice.name
    return f"{choice.name}(" + ",".join(f"{k}={toml_literal(v)}" for k, v in merged.items()) + ")"


def entry_label(choice: MethodChoice, params: Mapping[str, Value]) -> str:
    """The label :func:`pflalign.run.config.parse_methods` gives :func:`entry`'s text."""
    return parse_methods(entry(choice, params))[0].label


# --- running -------------------------------------------------------------------------------------
@dataclass
class Progress:
    """Counts finished cells (method × seed × setting) across a study, for the suite-level line."""

    total: int
    done: int = 0
    #: cells found finished by an earlier run (they took no time in this one)
    kept: int = 0
    started: float = field(default_factory=time.perf_counter)

    def line(self, what: str) -> str:
        elapsed = time.perf_counter() - self.started
        eta = ""
        if self.done > self.kept:
            left = elapsed / (self.done - self.kept) * (self.total - self.done)
            eta = f", about {_duration(left)} left"
        return (f"==> [{self.done}/{self.total} cells, {_duration(elapsed)} elapsed{eta}] "
                f"{what}")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def _group_done(directory: Path, labels: Sequence[str]) -> dict | None:
    """A group's results when every entry has finished, else None."""
    path = directory / "results.json"
    if not path.is_file():
        return None
    try:
        results = json.loads(path.read_text())
    except ValueError:
        return None
    if results.get("interrupted") or any(label not in results.get("methods", {})
                                         for label in labels):
        return None
    return results


class Study:
    """Runs a :class:`Plan` over a group runner (an engine), writing as it goes."""

    def __init__(self, plan: Plan, run_group: GroupRunner, reporter: Reporter | None = None,
                 resume: bool = False):
        self.plan = plan
        self.run_group = run_group
        self.reporter = reporter or Reporter()
        self.resume = resume
        self.out = Path(plan.out_dir)
        per_group = len(method_choices(plan.settings(next(iter(plan.scenarios)))))
        groups = len(plan.scenarios) * len(plan.settings_list()) * len(plan.seeds)
        tuning = 0
        if plan.tune:
            for name in plan.scenarios:
                settings = plan.settings(name)
                tuning += sum(method_budget(method_space(c, settings)[0], plan.tune)
                              for c in method_choices(settings)) * len(plan.tune_seeds)
        self.progress = Progress(total=groups * per_group + tuning)
        #: the trackers' run of the output directory itself (a plain run), open until its
        #: report is written
        self.tracked: Trackers | None = None

    # one group of cells ---------------------------------------------------------------------
    def group(self, settings: Settings, directory: Path, what: str) -> dict:
        labels = method_labels(settings)
        finished = _group_done(directory, labels)
        if finished is not None and self.resume:
            self.progress.done += len(labels)
            self.progress.kept += len(labels)
            self.reporter.stage(self.progress.line(f"{what}: finished earlier, kept"),
                                self.progress.done, self.progress.total)
            return finished
        self.reporter.stage(self.progress.line(f"{what}: {len(labels)} method entries"),
                            self.progress.done, self.progress.total)
        trackers = self.open_trackers(settings, directory)
        reporter = self.reporter if trackers is None else TrackingReporter(self.reporter,
                                                                            trackers)
        try:
            results = self.run_group(settings.replace({"out-dir": str(directory)}), reporter,
                                     self.resume)
        except BaseException:
            if trackers is not None:  # an error or a stop: the trackers' runs end as failed
                trackers.close(failed=True)
                self.tracked = None
            raise
        if trackers is not None:
            trackers.log_clients(results)  # each client's final values, by name
        if trackers is not None and directory != self.out:
            try:
                trackers.log_outputs(directory)  # the group's results.json
            finally:
                trackers.close()
        self.progress.done += len(labels)
        return results

    def open_trackers(self, settings: Settings, directory: Path, run: str | None = None,
                      ) -> Trackers | None:
        """One run in each of ``tracking``'s trackers for the group in ``directory`` (the
        output directory's itself, for a plain run, stays open in :attr:`tracked` until the
        report is written)."""
        names = parse_tracking(str(settings["tracking"]))
        if not names:
            return None
        root = Path(str(settings["tracking-dir"]) or self.out / "tracking")
        if run is None:
            relative = directory.relative_to(self.out).as_posix()
            run = slug(self.out.resolve().name if relative == "." else relative)
        trackers = Trackers(names, root, run, settings.to_dict())
        if directory == self.out:
            self.tracked = trackers
        return trackers

    def close_trackers(self, failed: bool = False) -> None:
        """After the output directory's report is written: it goes to the trackers too (not
        after a failure, whose error is the one raised)."""
        tracked, self.tracked = self.tracked, None
        if tracked is None:
            return
        if failed:
            tracked.close(failed=True)
            return
        try:
            tracked.log_outputs(self.out)
        finally:
            tracked.close()

    def run(self) -> dict:
        """Run everything; return the study's results document (also written to disk)."""
        plan = self.plan
        if not self.resume:
            plan.save()
        if plan.single:
            name = next(iter(plan.scenarios))
            settings = plan.settings(name).replace({"seed": plan.seeds[0]})
            try:
                results = self.group(settings, self.out, f"seed {plan.seeds[0]}")
                doc = finish_single(self.out, results, name)
            except BaseException:
                self.close_trackers(failed=True)
                raise
            self.close_trackers()
            return doc
        tuned = self.tune() if plan.tune else {}
        runs = []
        for name in plan.scenarios:
            base = plan.settings(name)
            methods = method_choices(base)
            chosen = tuned.get(name, {})
            if chosen:
                base = base.replace({"methods": ",".join(
                    entry(c, chosen[c.label]["chosen"]) for c in methods)})
            for setting in plan.settings_list():
                for seed in plan.seeds:
                    settings = base.replace({**setting, "seed": seed}, follow_data=False)
                    where = self.out / "runs" / slug(name or "config")
                    if setting:
                        where = where / slug(setting_label(setting))
                    what = " ".join(filter(None, (f"scenario {name}" if name else "",
                                                  setting_label(setting), f"seed {seed}")))
                    results = self.group(settings, where / f"seed-{seed}", what)
                    runs.append(study_run(results, name, seed, setting, methods, chosen))
        doc = {"schema-version": SCHEMA_VERSION, "kind": "study", "command": plan.command,
               "protocol": self.protocol(tuned), "runs": runs}
        doc = finish_study(self.out, doc, plan.reference)
        if self.open_trackers(plan.settings(next(iter(plan.scenarios))), self.out,
                              run=slug(self.out.resolve().name) + "-study") is not None:
            self.close_trackers()  # the study's summary, report and plots, as a run of its own
        return doc

    # tuning -----------------------------------------------------------------------------------
    def tune(self) -> dict[str, dict[str, dict]]:
        """scenario -> method label -> {space, default, chosen, trials}; every trial scored on
        validation data of the tuning seeds (:mod:`pflalign.run.tuning`)."""
        plan, out = self.plan, {}
        for name in plan.scenarios:
            settings = plan.settings(name)
            folder = self.out / "tuning" / slug(name or "config")
            choices = method_choices(settings)
            table: dict[str, dict] = {}
            searches: dict[str, tuning.MethodSearch] = {}
            for choice in choices:
                space, configured = method_space(choice, settings)
                searches[choice.label] = tuning.MethodSearch(
                    folder / tuning.STORAGE_FILE, choice.label, space, configured,
                    method_budget(space, plan.tune), plan.tune_seeds[0],
                    maximize=higher_is_better(plan.metric))
                table[choice.label] = {"space": {k: s.describe() for k, s in space.items()},
                                       "default": configured, "trials": []}
            for number in range(plan.tune):
                active = [c for c in choices if number < searches[c.label].budget]
                if not active:
                    break
                points = {c.label: searches[c.label].point(number) for c in active}
                labels = {c.label: entry_label(c, points[c.label]) for c in active}
                group = settings.replace({
                    "methods": ",".join(entry(c, points[c.label]) for c in active),
                    "evaluate-on": "validation"})
                scores: dict[str, list[float | None]] = {c.label: [] for c in active}
                for seed in plan.tune_seeds:
                    where = folder / f"trial-{number}" / f"seed-{seed}"
                    what = " ".join(filter(None, (f"tuning {name}" if name else "tuning",
                                                  f"trial {number + 1}/{plan.tune}",
                                                  f"seed {seed}", "(validation)")))
                    results = self.group(group.replace({"seed": seed}), where, what)
                    for c in active:
                        final = results["methods"][labels[c.label]]["final"]
                        score = trial_score(final, plan.metric)
                        if final.get("eval-rejected"):  # trial_score fails it
                            self.reporter.warn(
                                f"tuning {labels[c.label]}" + (f" ({name})" if name else "")
                                + f" seed {seed}: the final evaluation rejected "
                                f"{final['eval-rejected']} of {final.get('eval-clients')} "
                                "clients' replies (non-finite or malformed), so its "
                                f"{plan.metric} covers only the clients that answered; the "
                                "trial counts as failed.")
                        scores[c.label].append(score)
                for c in active:
                    valid = [s for s in scores[c.label] if s is not None]
                    score = float(np.mean(valid)) if len(valid) == len(scores[c.label]) else None
                    searches[c.label].tell(number, score)
                    table[c.label]["trials"].append({
                        "params": points[c.label], "label": labels[c.label],
                        "scores": scores[c.label], "score": score})
            sign = 1.0 if higher_is_better(plan.metric) else -1.0
            for label, row in table.items():
                best = max(row["trials"], key=lambda t: -math.inf if t["score"] is None
                           else sign * t["score"])  # max keeps the first of equal scores
                row["chosen"] = dict(best["params"])
                self.reporter.info(f"tuned {label}" + (f" ({name})" if name else "") + ": "
                                   + (setting_label(row["chosen"]) or "nothing to tune")
                                   + (f", validation {plan.metric} "
                                      + _score_text(plan.metric, best["score"])
                                      if best["score"] is not None else ""))
                at_edge = edges(searches[label].space, row["chosen"]) if best["score"] is not None \
                    else {}  # every trial failed: no choice to speak of
                for key, side in at_edge.items():
                    self.reporter.warn(
                        f"tuned {label}" + (f" ({name})" if name else "") + f": {key} = "
                        f"{row['chosen'][key]:.4g} lies at the {side} end of its range "
                        f"{row['space'][key]}, so the optimum may lie beyond it; widen the "
                        "range (report.md lists the trials beside it).")
            out[name] = table
        return out

    def protocol(self, tuned: Mapping[str, Mapping[str, dict]]) -> dict:
        plan = self.plan
        protocol: dict = {"seeds": list(plan.seeds), "reference": plan.reference,
                          "metric": plan.metric, "scenarios": list(plan.scenarios),
                          "sweep": {k: list(v) for k, v in plan.sweep.items()},
                          "ci": "95% t-interval over seeds (n-1 degrees of freedom); paired "
                                "differences per seed against the reference", "tune": None}
        if plan.tune:
            protocol["tune"] = {
                "trials": plan.tune, "tune-seeds": list(plan.tune_seeds),
                "validation-fraction": plan.settings(next(iter(plan.scenarios)))[
                    "validation-fraction"],
                "objective": f"mean final validation {plan.metric} over the tuning seeds "
                             "(evaluate-on = validation; test data is never read); a trial "
                             "fails when its final evaluation rejected any client's reply "
                             "(its metric would leave those clients out)",
                "draw": "Optuna: the method's configured values first (when in its space), "
                        f"then seeded random points (the first "
                        f"{tuning.startup_trials(plan.tune)} in all), then TPE; "
                        "the same trials and rounds for every method, no pruning",
                "storage": f"tuning/<scenario>/{tuning.STORAGE_FILE}",
                "scenarios": {name: {label: {k: row[k] for k in
                                             ("space", "default", "chosen", "trials")}
                                     for label, row in table.items()}
                              for name, table in tuned.items()}}
            if len(tuned) == 1:
                protocol["tune"]["methods"] = protocol["tune"]["scenarios"][next(iter(tuned))]
        return protocol


def _score_text(metric: str, score: float) -> str:
    """A score as the tables print it: an accuracy in %, anything else as it is."""
    return f"{100 * score:.2f}%" if is_fraction(metric) else f"{score:.4g}"


def trial_score(final: Mapping[str, Value], metric: str) -> float | None:
    """A tuning trial's score on one tuning seed: the run's final ``metric``, or None (a failed
    trial) when it is not finite or when the final evaluation rejected any client's reply. A
    rejected reply (a non-finite loss: a personalized model that diverged; or a malformed one)
    leaves that client out of the metric, so a setting that diverges on the hardest clients
    would score as if it had solved the easy ones (a learning rate that diverges on 27 of 30
    clients scored 100% on the other 3). Clients that did not answer at all (failures and
    timeouts: a systems-heterogeneity setting) leave the trial as it is: that is the setting's
    availability, the same for every trial."""
    score = final.get(metric)
    if not _finite(score) or final.get("eval-rejected"):
        return None
    return float(score)  # type: ignore[arg-type]


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def study_run(results: Mapping, scenario: str, seed: int, setting: Mapping[str, Value],
              choices: Sequence[MethodChoice], chosen: Mapping[str, dict]) -> dict:
    """A group's results as one of a study's runs: keyed by the method entries' own labels
    (a tuned entry's chosen values are under its "hyperparameters")."""
    run = {k: v for k, v in results.items() if k != "methods"}
    run.update({"scenario": scenario, "seed": seed, "setting": dict(setting), "methods": {}})
    for choice in choices:
        params = chosen.get(choice.label, {}).get("chosen", {})
        label = entry_label(choice, params) if chosen else choice.label
        result = dict(results["methods"][label])
        if chosen:
            result["hyperparameters"] = dict(params)
        run["methods"][choice.label] = result
    return run


def finish_single(out: Path, results: dict, scenario: str) -> dict:
    """A plain run: its results.json gains the schema fields, then the CSV and the report."""
    results = {"schema-version": SCHEMA_VERSION, "kind": "run", "scenario": scenario,
               **{k: v for k, v in results.items() if k not in ("schema-version", "kind")}}
    results = dict(bounded(out, results))  # the CSV and the report read what results.json holds
    write_results(out, results)
    write_outputs(out, results)
    return results


def finish_study(out: Path, doc: dict, reference: str) -> dict:
    from pflalign.outputs.report import summarize_study

    doc["summary"] = summarize_study(doc, reference=reference)
    doc = dict(bounded(out, doc))  # the CSV and the report read what results.json holds
    write_results(out, doc)
    write_outputs(out, doc)
    return doc


def write_outputs(out: Path, doc: Mapping) -> None:
    """results.csv and the report (report.md and plots/) next to results.json."""
    from pflalign.outputs.report import write_csv, write_report

    write_csv(out / "results.csv", doc)
    if wants_report(doc):
        write_report(out, doc)


def wants_report(doc: Mapping) -> bool:
    """Whether the run's ``report`` key asks for report.md and its plots."""
    config = doc.get("config") or next(iter(doc.get("runs") or []), {}).get("config") or {}
    return bool(config.get("report", True))
