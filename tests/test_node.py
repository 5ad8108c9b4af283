"""A node's own data and state on its own disk: partition files, the partition cache, state files.

The partition file must give a client exactly what the pooled path gives it (every metric and
array bit for bit, through the same client-side handler the engines call), and a state file must
let a restarted node continue exactly where it stopped.
"""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest
import torch
from conftest import needs_fashion_mnist

import pflalign.engines.sequential as sequential
import pflalign.training.client
from pflalign.data.federated import federated_dataset
from pflalign.data.node import (
    StateStore,
    cached_node_data,
    data_fingerprint,
    export_partitions,
    load_partition,
    node_data_from_file,
    pooled_node_data,
    read_metadata,
)
from pflalign.run.config import ConfigError, build_settings
from pflalign.run.driver import run_methods
from pflalign.settings.schema import Settings
from pflalign.wire.protocol import (
    CONFIG,
    HAD_STATE,
    LABEL,
    METHOD,
    METRICS,
    MODEL,
    PROCESS_METRICS,
    ROUND,
    RUN_CONFIG,
)

pytestmark = needs_fashion_mnist

SMALL = {"num-clients": 4, "num-unseen-clients": 1, "max-samples": 800, "partition": "rotated",
         "rotation-angles": "0,30,90", "rounds": 2, "eval-every": 1, "fraction-train": 1.0,
         "local-steps": 2, "batch-size": 16, "seed": 5}


def _timing_free(value):
    """``value`` without wall-clock entries (keys naming seconds), recursively."""
    if isinstance(value, dict):
        return {k: _timing_free(v) for k, v in value.items() if "seconds" not in k}
    if isinstance(value, list):
        return [_timing_free(v) for v in value]
    return value


def test_partition_files_hold_exactly_the_pooled_splits(tmp_path):
    settings = build_settings(SMALL)
    paths = export_partitions(settings, tmp_path)
    federation = federated_dataset(settings)
    assert [p.name for p in paths] == [f"client-{i}.npz" for i in range(5)]
    assert not list(tmp_path.glob(".*"))  # no temporary file left behind
    for cid, path in enumerate(paths):
        meta, node = load_partition(path)
        pooled = federation.client_data(cid)
        for split in ("train_x", "train_y", "test_x", "test_y"):
            assert torch.equal(getattr(node.data, split), getattr(pooled, split)), split
            assert getattr(node.data, split).dtype == getattr(pooled, split).dtype
            # strides too: a 1-channel batch whose channel stride is 1 reads as channels-last,
            # which changes the convolution kernel (and its rounding)
            assert getattr(node.data, split).stride() == getattr(pooled, split).stride()
        batch = pooled.train_x[:4]
        assert torch.equal(node.data.normalize(batch.clone()), pooled.normalize(batch.clone()))
        assert meta["client-id"] == cid and meta["unseen"] == (cid == 4)
        assert meta["rotation"] == federation.partition.rotation(cid)
        assert meta["dataset"] == "fashion-mnist" and meta["num-classes"] == 10
        assert meta["input-shape"] == [1, 28, 28] and meta["num-clients"] == 5
        assert meta["fingerprint"] == data_fingerprint(settings)
        assert node.discovery() == pooled_node_data(settings, cid).discovery()


def test_handle_from_the_partition_file_is_bit_identical(tmp_path, monkeypatch):
    """Two sequential runs of every action (discovery, GGA queries, train, evaluate, state): the
    clients reading only their partition files give the same metrics as the pooled path."""
    # eval-audit-fraction = 0: the server's audit reads the server's own (pooled) copy of the
    # data by design; this test is about what the clients read
    settings = build_settings({**SMALL, "methods": "fedavg-ft,pflalign", "gga": True,
                               "eval-audit-fraction": 0.0, "gga-start": 1,
                         "gga-end": 1, "gga-candidates": 2, "out-dir": str(tmp_path / "pool")})
    pooled = run_methods(settings, sequential.SequentialEngine)

    paths = export_partitions(settings, tmp_path / "parts")
    real_handle, real_discovery = sequential.handle, sequential.discovery

    def from_file(settings_, cid):
        return node_data_from_file(paths[cid], settings_, cid)

    monkeypatch.setattr(sequential, "handle", lambda action, s, cid, *rest, node=None: real_handle(
        action, s, cid, *rest, node=from_file(s, cid)))
    monkeypatch.setattr(sequential, "discovery", lambda s, cid: real_discovery(
        s, cid, from_file(s, cid)))

    def no_pool(*_args, **_kwargs):
        raise AssertionError("a client with a partition file read the pooled dataset")

    monkeypatch.setattr(pflalign.training.client, "pooled_node_data", no_pool)
    from_files = run_methods(settings.replace({"out-dir": str(tmp_path / "files")}),
                             sequential.SequentialEngine)
    for label in ("fedavg-ft", "pflalign"):
        a, b = pooled["methods"][label], from_files["methods"][label]
        assert all(r["failures"] == 0 for r in b["rounds"]), b["rounds"]
        assert _timing_free(a["rounds"]) == _timing_free(b["rounds"])
        assert _timing_free(a["final"]) == _timing_free(b["final"])
        assert a["clients"] == b["clients"]


def test_a_partition_file_for_another_config_or_client_is_refused(tmp_path):
    settings = build_settings(SMALL)
    path = export_partitions(settings, tmp_path, clients=[1])[0]
    assert node_data_from_file(path, settings, 1).client_id == 1
    with pytest.raises(ConfigError, match="dirichlet-alpha = 0.1 in the file, 0.5 in the run"):
        node_data_from_file(path, settings.replace({"dirichlet-alpha": 0.5}), 1)
    with pytest.raises(ConfigError, match="holds client 1, but this node's partition-id is 2"):
        node_data_from_file(path, settings, 2)
    # where the files are read from does not change the data
    assert node_data_from_file(path, settings.replace({"data-root": ""}), 1).client_id == 1
    with pytest.raises(ConfigError, match="cannot be read"):
        node_data_from_file(tmp_path / "missing.npz", settings, 1)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ConfigError, match="not a readable pflalign partition file"):
        read_metadata(tmp_path / "junk.npz")


def test_the_partition_cache_is_written_once_then_read(tmp_path, monkeypatch):
    settings = build_settings(SMALL)
    first = cached_node_data(settings, 2, tmp_path)
    files = list((tmp_path / "partitions").rglob("client-2.npz"))
    assert len(files) == 1 and files[0].parent.name == data_fingerprint(settings)

    def no_pool(*_args, **_kwargs):
        raise AssertionError("the cached partition was not used")

    monkeypatch.setattr("pflalign.data.node.pooled_node_data", no_pool)
    again = cached_node_data(settings, 2, tmp_path)
    assert torch.equal(first.data.train_x, again.data.train_x)
    assert torch.equal(first.data.test_y, again.data.test_y)
    assert again.discovery() == first.discovery()


def test_state_store_round_trips_exactly_and_is_scoped_to_run_and_entry(tmp_path):
    settings = build_settings(SMALL)
    arrays = {"model/conv.weight": np.random.default_rng(0).standard_normal((3, 2, 2)),
              "fit_count": np.array(7), "seen": np.array([1, 4], dtype=np.int64),
              "#odd/name": np.array(1.5, dtype=np.float32)}
    store = StateStore(tmp_path, run_id=11, label="pflalign", settings=settings, client_id=2)
    assert store.load() is None
    store.save(arrays, server_round=3)
    loaded, meta = store.load()
    assert meta["round"] == 3 and list(loaded) == list(arrays)
    for name, array in arrays.items():
        assert loaded[name].dtype == array.dtype and loaded[name].shape == array.shape
        assert np.array_equal(loaded[name], array)
    assert not list(tmp_path.glob(".*"))  # the temporary file was moved into place
    # another run, another entry, or another config never sees it
    assert StateStore(tmp_path, 12, "pflalign", settings, 2).load() is None
    assert StateStore(tmp_path, 11, "fedavg", settings, 2).load() is None
    assert StateStore(tmp_path, 11, "pflalign", settings.replace({"lr": 0.1}), 2).load() is None
    # ... nor another client sharing the directory
    assert StateStore(tmp_path, 11, "pflalign", settings, 3).load() is None
    StateStore(tmp_path, 11, "pflalign", settings, 3).save({"x": np.ones(2)}, 1)
    assert store.load() is not None
    # ... but the output directory is not part of the key
    assert StateStore(tmp_path, 11, "pflalign",
                      settings.replace({"out-dir": "/elsewhere"}), 2).load() is not None
    # a new entry's state replaces the same client's earlier entry's file, no other client's
    StateStore(tmp_path, 11, "fedavg", settings, 2).save({"x": np.zeros(2)}, 1)
    assert len(list(tmp_path.glob("state-client2-*.npz"))) == 1
    assert len(list(tmp_path.glob("state-*.npz"))) == 2


# --- the ClientApp: a restarted node (a fresh context) resumes from its state-dir --------------
def _message(content, message_type: str, run_id: int = 42):
    from flwr.app import Message, Metadata

    return Message(content=content, metadata=Metadata(
        run_id=run_id, message_id=f"m{time.monotonic_ns()}", src_node_id=0, dst_node_id=1,
        reply_to_message_id="", group_id="", created_at=time.time(), ttl=3600.0,
        message_type=message_type))


def _context(node_config: dict, run_id: int = 42):
    from flwr.app import Context, RecordDict

    return Context(run_id=run_id, node_id=1, node_config=node_config, state=RecordDict(),
                   run_config={})


def _train_message(settings: Settings, model: dict, server_round: int):
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    return _message(RecordDict({
        CONFIG: ConfigRecord({METHOD: "pflalign", LABEL: "pflalign", ROUND: server_round}),
        RUN_CONFIG: ConfigRecord(settings.to_dict()),
        MODEL: ArrayRecord({k: torch.from_numpy(v) for k, v in model.items()})}), "train")


def test_a_restarted_node_resumes_its_state_exactly(tmp_path):
    from clients import app as client_app
    from pflalign.run.driver import initial_model

    settings = build_settings({**SMALL, "methods": "pflalign"})
    model, _ = initial_model(settings)
    node_config = {"partition-id": 1, "num-partitions": 5, "state-dir": str(tmp_path / "state")}

    def metrics_and_arrays(reply):
        metrics = {k: v for k, v in reply.content[METRICS].items()
                   if k != "client-seconds" and k not in PROCESS_METRICS}  # timings, memory
        arrays = {k: v.numpy() for k, v in reply.content[MODEL].items()}
        return metrics, arrays

    running = _context(node_config)
    first, _ = metrics_and_arrays(client_app.train(_train_message(settings, model, 1), running))
    assert first[HAD_STATE] == 0
    state_files = list((tmp_path / "state").glob("state-*.npz"))
    assert len(state_files) == 1
    # the node's partition was cached under its state-dir on the first message
    assert list((tmp_path / "state" / "partitions").rglob("client-1.npz"))

    # a node killed after round 1 leaves this file behind
    (tmp_path / "state2").mkdir()
    shutil.copy2(state_files[0], tmp_path / "state2" / state_files[0].name)
    kept, kept_arrays = metrics_and_arrays(
        client_app.train(_train_message(settings, model, 2), running))
    # the restart: the file saved after round 1, a fresh context (context.state is gone)
    restarted_config = {**node_config, "state-dir": str(tmp_path / "state2")}
    # round 2 again from the state saved after round 1: as a node restarted after round 1
    resumed, resumed_arrays = metrics_and_arrays(client_app.train(
        _train_message(settings, model, 2), _context(restarted_config)))
    assert kept[HAD_STATE] == 1 and resumed[HAD_STATE] == 1
    assert resumed == kept
    assert all(np.array_equal(resumed_arrays[k], kept_arrays[k]) for k in kept_arrays)
    # without the state-dir, the restarted node would have started afresh
    fresh, _ = metrics_and_arrays(client_app.train(
        _train_message(settings, model, 2), _context({"partition-id": 1})))
    assert fresh[HAD_STATE] == 0
    # a state saved in another run is never picked up
    other_run = client_app.train(_train_message(settings, model, 2),
                                 _context(restarted_config, run_id=43))
    assert other_run.content[METRICS][HAD_STATE] == 0


def test_a_node_with_data_path_reads_only_its_file(tmp_path, monkeypatch):
    from clients import app as client_app

    settings = build_settings({**SMALL, "methods": "pflalign"})
    path = export_partitions(settings, tmp_path, clients=[3])[0]
    context = _context({"partition-id": 3, "data-path": str(path)})
    monkeypatch.setattr("pflalign.data.node.federated_dataset", None)  # any pool access would fail
    monkeypatch.setattr("pflalign.engines.host.federated_dataset", None)
    node = client_app.node_data_of(context, settings)
    from pflalign.engines.host import discovery

    assert discovery(settings, 3, node)["num-train"] == node.data.num_train
    assert json.loads(json.dumps(node.discovery()))["partition-id"] == 3


@pytest.mark.parametrize("value", [-1, 5, 99])
def test_a_partition_id_outside_the_run_is_refused_at_discovery(value):
    from clients import app as client_app

    settings = build_settings(SMALL)
    msg = _message(_run_config_only(settings), "query")
    with pytest.raises(ValueError, match=f"{value} is outside"):
        client_app.query(msg, _context({"partition-id": value, "num-partitions": 5}))


@pytest.mark.parametrize("value", [1.5, "one", True])
def test_a_partition_id_that_is_not_an_integer_is_refused(value):
    from clients import app as client_app

    with pytest.raises(ValueError, match="is not an integer"):
        client_app.client_id_of(_context({"partition-id": value}))


def _run_config_only(settings: Settings):
    from flwr.app import ConfigRecord, RecordDict

    return RecordDict({RUN_CONFIG: ConfigRecord(settings.to_dict())})
