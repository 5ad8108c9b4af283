"""Experiment trackers (``tracking = tensorboard,mlflow,wandb``): a real run writes to all three,
and each store is read back with its own reader: TensorBoard's event accumulator, MLflow's client,
and W&B's offline run file (its records, parsed with W&B's own protobuf definitions). The scalars
must be the rows of results.json, the config the run's, and the outputs the files written."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from test_sources import write_features

from pflalign.outputs import tracking
from pflalign.outputs.results import slug
from pflalign.run.cli import main
from pflalign.run.config import build_settings
from pflalign.settings.options import ConfigError

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")
pytest.importorskip("wandb")


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tracked")
    write_features(folder / "f.npz")
    out = folder / "out"
    status = main(["--set", f"dataset=npz:{folder / 'f.npz'}", "--set", "model=mlp", "--set",
                   "num-clients=4", "--set", "rounds=3", "--set", "eval-every=1", "--set",
                   "engine=sequential", "--set", "tracking=tensorboard,mlflow,wandb",
                   "--methods", "fedavg,pflalign(lr=0.02)", "--out", str(out), "--quiet"])
    assert status == 0
    results = json.loads((out / "results.json").read_text())
    return out, results


def _series(results: dict, entry: str, metric: str) -> list[tuple[int, float]]:
    return [(row["round"], row[metric]) for row in results["methods"][entry]["rounds"]
            if metric in row]


def test_tensorboard_has_every_round_and_the_report(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, results = tracked_run
    (run,) = (out / "tracking" / "tensorboard").iterdir()
    events = EventAccumulator(str(run), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    # each entry's series under its file-safe name (results.slug: a hash keeps two apart)
    for entry, tag in (("fedavg", "fedavg"), ("pflalign(lr=0.02)", slug("pflalign(lr=0.02)"))):
        for metric in ("train-loss", "personal-acc", "bytes-up"):
            logged = [(e.step, e.value) for e in events.Scalars(f"{tag}/{metric}")]
            expected = _series(results, entry, metric)
            assert [s for s, _ in logged] == [s for s, _ in expected] == [1, 2, 3]
            # float32 in the event file
            assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6)
    assert "report.md" in " ".join(events.Tags()["tensors"])
    assert any(tag.startswith("plots/") for tag in events.Tags()["images"])
    # each client's final values, under its name (the file's client names), at the last round
    clients = results["methods"]["fedavg"]["clients"]
    assert {c["name"] for c in clients} <= {"ana", "bo", "cy", "dee", "ed", "flo"}
    for client in clients:
        (logged,) = events.Scalars(f"fedavg/clients/{client['name']}/personal-acc")
        assert logged.step == 3 and logged.value == pytest.approx(client["personal-acc"])


def test_mlflow_has_the_metrics_the_config_and_the_outputs(tracked_run):
    from mlflow.tracking import MlflowClient

    out, results = tracked_run
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'tracking' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("pflalign").experiment_id])
    assert run.info.run_name == "out" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "fedavg/train-loss")
    assert [(m.step, m.value) for m in history] == _series(results, "fedavg", "train-loss")
    assert run.data.params["num-clients"] == "4" and run.data.params["model"] == "mlp"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"results.json", "results.csv", "report.md", "plots"} <= artifacts
    stored = Path(run.info.artifact_uri.removeprefix("file://")) / "results.json"
    assert json.loads(stored.read_text()) == results


def _wandb_records(path: Path):
    """The records of a W&B run file: a 7-byte header, then LevelDB-log blocks of 32 KiB whose
    records (crc32, length, type: full, first, middle, last) carry protobuf ``Record``s."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, chunk = 7, b""
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if left < 7 or kind == 0:  # the rest of a block is padding
            position += left
            continue
        chunk += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            yield record
            chunk = b""


def test_wandb_offline_run_has_the_history_and_config(tracked_run):
    out, results = tracked_run
    (path,) = (out / "tracking" / "wandb").glob("offline-run-*/run-*.wandb")
    history, config, artifacts = [], {}, 0
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind == "run":
            config = {item.key: json.loads(item.value_json)
                      for item in record.run.config.update}
        artifacts += kind == "artifact"
    logged = [(row["fedavg/round"], row["fedavg/train-loss"]) for row in history
              if "fedavg/train-loss" in row]
    assert logged == _series(results, "fedavg", "train-loss")
    assert config["num-clients"] == 4 and config["rounds"] == 3
    assert artifacts == 1


def test_bad_tracking_values_are_one_sentence(monkeypatch):
    with pytest.raises(ConfigError, match="unknown tracker 'neptune'; choose from tensorboard, "
                       "mlflow, wandb"):
        build_settings({"tracking": "tensorboard,neptune"})
    real = tracking.importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec",
                        lambda name: None if name == "wandb" else real(name))
    with pytest.raises(ConfigError, match="wandb is not installed; install the trackers with "
                       "pip install 'pflalign\\[tracking\\]'"):
        build_settings({"tracking": "wandb"})


def test_a_run_that_fails_ends_its_tracker_runs_as_failed(tmp_path):
    """A sweep's second cell reads data with a bad label, which stops the run (exit 2) after
    the first cell ran (the first cell's data is read before anything is written, so a first
    cell with bad data would open no tracker run at all): the MLflow run the second cell had
    opened is FAILED, the first FINISHED, and W&B's runs exited 1 and 0."""
    import numpy as np

    labels = np.arange(40) % 2
    good, bad = tmp_path / "good.npz", tmp_path / "bad.npz"
    np.savez(good, x=np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32),
             y=labels)
    np.savez(bad, x=np.zeros((40, 4), np.float32), y=np.where(np.arange(40) == 3, -1, 1))
    out = tmp_path / "out"
    status = main(["--set", "model=mlp", "--set", "engine=sequential", "--set", "rounds=1",
                   "--set", "num-clients=2", "--set", "min-samples-per-client=5",
                   "--sweep", f"dataset=npz:{good},npz:{bad}", "--set", "tracking=mlflow,wandb",
                   "--out", str(out), "--quiet"])
    assert status == 2 and not (out / "results.json").exists()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'tracking' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("pflalign").experiment_id])
    assert sorted(run.info.status for run in runs) == ["FAILED", "FINISHED"]
    exits = sorted(r.exit.exit_code for path in (out / "tracking" / "wandb").glob(
        "offline-run-*/run-*.wandb") for r in _wandb_records(path)
        if r.WhichOneof("record_type") == "exit")
    assert exits == [0, 1]
