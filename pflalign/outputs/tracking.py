"""Experiment trackers: ``tracking = tensorboard,mlflow,wandb`` (any of them, comma-separated).

Each run of a group of method entries (one config and seed: ``simulate.py`` without a study, or
each seed and scenario of one) is one run in each tracker, named after its folder under the
output directory. It gets:

- every round's row as scalars, one series per method entry and metric
  (``<entry>/<metric>``, at step = the round), written as the round finishes;
- the config (every key, resolved) as the run's parameters;
- when the group is written, its ``results.json`` and, where the group is the whole output,
  ``report.md``, ``results.csv`` and the plots, as artifacts (TensorBoard, which has none, gets the
  report as text and the plots as images).

Each tool writes through its own library, to a local store under ``tracking-dir`` (default
``<out-dir>/tracking``): TensorBoard event files (``torch.utils.tensorboard``) under
``tensorboard/<run>``, an MLflow store in ``mlflow.db`` (SQLite, experiment ``pflalign``; its
artifacts under ``mlartifacts``: ``mlflow ui --backend-store-uri sqlite:///.../mlflow.db`` shows
it), and W&B in offline mode under ``wandb`` (``wandb sync`` uploads it later). The simulator
needs none of them: ``pip install 'pflalign[tracking]'`` installs all three.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from pflalign.outputs.results import Reporter, slug
from pflalign.settings.options import ConfigError

#: each tracker and the module its library is imported as
TRACKERS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
EXPERIMENT = "pflalign"


def parse_tracking(text: str) -> tuple[str, ...]:
    """``tracking``'s trackers, each known and installed, or one sentence naming the fix."""
    names = tuple(dict.fromkeys(n.strip() for n in str(text).split(",") if n.strip()))
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"tracking = {text!r}: unknown tracker {name!r}; choose from "
                              f"{', '.join(TRACKERS)} (comma-separated), or leave it empty.")
        if importlib.util.find_spec(TRACKERS[name]) is None:
            raise ConfigError(f"tracking = {text!r}: {name} is not installed; install the "
                              f"trackers with pip install 'pflalign[tracking]' (or {name} "
                              "alone), or leave it out.")
    return names


def _scalars(row: Mapping[str, object]) -> dict[str, float]:
    """The finite numbers of a round's row (not the round itself: it is the step)."""
    return {key: float(value) for key, value in row.items()
            if key != "round" and isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(float(value))}


class _TensorBoard:
    def __init__(self, root: Path, run: str, config: Mapping[str, object]):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(root / "tensorboard" / run))
        self.writer.add_text("config", "\n".join(f"    {k} = {v!r}" for k, v in config.items()))

    def log_round(self, entry: str, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(f"{entry}/{key}", value, step)

    def log_files(self, files: Sequence[Path]) -> None:
        for path in files:
            if path.suffix == ".md":
                self.writer.add_text(path.name, path.read_text())
            elif path.suffix == ".png":
                import matplotlib.image

                image = matplotlib.image.imread(str(path))[..., :3]
                self.writer.add_image(f"plots/{path.stem}", image, dataformats="HWC")
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class _MLflow:
    def __init__(self, root: Path, run: str, config: Mapping[str, object]):
        from mlflow.tracking import MlflowClient

        root.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=f"sqlite:///{(root / 'mlflow.db').resolve()}")
        experiment = self.client.get_experiment_by_name(EXPERIMENT)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(
                             EXPERIMENT, (root / "mlartifacts").resolve().as_uri()))
        self.run_id = self.client.create_run(experiment_id, run_name=run).info.run_id
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in config.items()]
        for start in range(0, len(params), 100):  # MLflow takes 100 parameters a batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log_round(self, entry: str, step: int, values: Mapping[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            Metric(f"{entry}/{key}", value, now, step) for key, value in values.items()])

    def log_files(self, files: Sequence[Path]) -> None:
        for path in files:
            self.client.log_artifact(self.run_id, str(path),
                                     "plots" if path.suffix == ".png" else None)

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class _WandB:
    def __init__(self, root: Path, run: str, config: Mapping[str, object]):
        import wandb

        (root / "wandb").mkdir(parents=True, exist_ok=True)
        # offline, and quiet: the run's own terminal output is the simulator's
        self.run = wandb.init(project=EXPERIMENT, name=run, dir=str(root), mode="offline",
                              config=dict(config), reinit="create_new",
                              settings=wandb.Settings(silent=True, console="off",
                                                      save_code=False, disable_git=True))
        self.step_metric: set[str] = set()

    def log_round(self, entry: str, step: int, values: Mapping[str, float]) -> None:
        if entry not in self.step_metric:  # each entry's series against its own round
            self.run.define_metric(f"{entry}/round")
            self.run.define_metric(f"{entry}/*", step_metric=f"{entry}/round")
            self.step_metric.add(entry)
        self.run.log({f"{entry}/round": step,
                      **{f"{entry}/{key}": value for key, value in values.items()}})

    def log_files(self, files: Sequence[Path]) -> None:
        import wandb

        artifact = wandb.Artifact(f"{slug(self.run.name)}-outputs", type="results")
        for path in files:
            artifact.add_file(str(path), name=("plots/" if path.suffix == ".png" else "")
                              + path.name)
        self.run.log_artifact(artifact)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


_OPEN = {"tensorboard": _TensorBoard, "mlflow": _MLflow, "wandb": _WandB}


class Trackers:
    """One run in each of ``names``'s trackers (see the module docstring)."""

    def __init__(self, names: Sequence[str], root: str | Path, run: str,
                 config: Mapping[str, object]):
        self.root = Path(root)
        self.tools = []
        try:
            for name in names:
                self.tools.append(_OPEN[name](self.root, run, config))
        except BaseException:
            self.close(failed=True)  # the ones already open are not left running
            raise

    def log_round(self, label: str, row: Mapping[str, object]) -> None:
        values = _scalars(row)
        for tool in self.tools:
            tool.log_round(slug(label), int(row["round"]), values)

    def log_clients(self, results: Mapping[str, object]) -> None:
        """Each method entry's per-client final values, under ``<entry>/clients/<client>/<metric>``
        at its last round, each client named by its name where the data names it (else its
        id)."""
        for label, entry in dict(results.get("methods") or {}).items():
            rounds = entry.get("rounds") or []
            if not rounds:
                continue
            values = {}
            for client in entry.get("clients", []):
                who = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(client.get("name", client["id"])))
                values.update({f"clients/{who}/{key}": value
                               for key, value in _scalars(client).items()
                               if key not in ("id", "unseen")})
            for tool in self.tools:
                tool.log_round(slug(label), int(rounds[-1]["round"]), values)

    def log_outputs(self, folder: str | Path) -> None:
        """The outputs written in ``folder``: results.json, results.csv, report.md, the plots."""
        folder = Path(folder)
        files = [folder / name for name in ("results.json", "results.csv", "report.md")
                 if (folder / name).is_file()]
        files += sorted((folder / "plots").glob("*.png"))
        for tool in self.tools:
            tool.log_files(files)

    def close(self, failed: bool = False) -> None:
        """End every tool's run (as failed, after an error or a stop); a tool that cannot close
        does not keep the others open (the first such error is raised after)."""
        error = None
        for tool in self.tools:
            try:
                tool.close(failed)
            except Exception as err:  # noqa: BLE001 (each tool is closed; the first error kept)
                error = error or err
        self.tools = []
        if error is not None:
            raise error


class TrackingReporter(Reporter):
    """A reporter that also sends every round's row to the trackers."""

    def __init__(self, inner: Reporter, trackers: Trackers):
        super().__init__(quiet=inner.quiet)
        self.inner, self.trackers = inner, trackers

    def info(self, text: str) -> None:
        self.inner.info(text)

    def result(self, text: str) -> None:
        self.inner.result(text)

    def warn(self, text: str) -> None:
        self.inner.warn(text)

    def stage(self, text: str, done: int, total: int) -> None:
        self.inner.stage(text, done, total)

    def round(self, label: str, row: Mapping[str, object], rounds: int) -> None:
        self.inner.round(label, row, rounds)
        self.trackers.log_round(label, row)

    def close(self) -> None:
        self.inner.close()
