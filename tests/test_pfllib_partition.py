"""PFLlib's Fashion-MNIST partition, regenerated (pflalign.data.pfllib), against what PFLlib's own
generator wrote (tests/data/pfllib-fashion-mnist.json)."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import needs_fashion_mnist

from pflalign.data.federated import federated_dataset
from pflalign.data.pfllib import (
    dirichlet_shares,
    label_counts,
    pfllib_clients,
    pooled_fashion_mnist,
    scaled,
    train_test,
    write_npz,
)
from pflalign.run.config import build_settings

RECORDED = json.loads((Path(__file__).parent / "data" / "pfllib-fashion-mnist.json").read_text())


@pytest.fixture(scope="module")
def pooled() -> tuple[np.ndarray, np.ndarray]:
    return pooled_fashion_mnist()


@needs_fashion_mnist
def test_the_clients_are_pfllibs_sample_for_sample_and_byte_for_byte(pooled):
    images, labels = pooled
    clients = pfllib_clients(labels)
    assert label_counts(labels, clients) == {"train": RECORDED["train"], "test": RECORDED["test"]}
    train = [len(tr) for tr, _ in clients]
    test = [len(te) for _, te in clients]
    assert (sum(train), sum(test)) == (52_493, 17_507)  # PFLlib's published totals
    assert train[:3] == [61, 240, 656] and test[:3] == [21, 80, 219]  # as its generator prints
    digest = hashlib.sha256()
    for side in (0, 1):
        for pair in clients:
            digest.update(scaled(images[pair[side]]).tobytes())
            digest.update(labels[pair[side]].astype(np.int64).tobytes())
    assert digest.hexdigest() == RECORDED["sha256"]


@needs_fashion_mnist
def test_another_seed_gives_other_clients(pooled):
    _, labels = pooled
    assert label_counts(labels, pfllib_clients(labels, seed=2))["train"] != RECORDED["train"]


@pytest.mark.parametrize("seed", [7, 8])
def test_the_dirichlet_draw_and_split_by_hand(seed):
    """Two labels of 4 samples, 2 clients, alpha 1, batch 1, train ratio 0.5: the numbers drawn
    from the state in PFLlib's order, repeated here by hand (seed 8 draws three times before
    both clients hold 2 samples, seed 7 once)."""
    labels = np.array([0, 1, 0, 1, 0, 1, 0, 1])
    rng = np.random.RandomState(seed)
    shares = dirichlet_shares(labels, rng, clients=2, alpha=1.0, train_ratio=0.5, batch_size=1)
    split = train_test(shares[0], rng, train_ratio=0.5)

    mirror = np.random.RandomState(seed)
    least, expected, draws = int(min(1 / 0.5, 8 / 2 / 2)), None, 0  # least 2
    while expected is None or min(len(s) for s in expected) < least:
        draws += 1
        expected = [[], []]
        for k in (0, 1):
            members = np.array([i for i in range(8) if labels[i] == k])
            mirror.shuffle(members)
            p = mirror.dirichlet([1.0, 1.0])
            p = np.array([p[j] if len(expected[j]) < 4 else 0.0 for j in (0, 1)])
            cut = int(p[0] / p.sum() * len(members))
            expected = [expected[0] + list(members[:cut]), expected[1] + list(members[cut:])]
    assert [s.tolist() for s in shares] == expected and draws == {7: 1, 8: 3}[seed]
    order = mirror.permutation(len(expected[0]))
    test_size = len(order) - len(order) // 2
    assert split[0].tolist() == [expected[0][i] for i in order[test_size:]]
    assert split[1].tolist() == [expected[0][i] for i in order[:test_size]]


def test_scaling_is_torchvisions_to_tensor_then_normalize():
    torch = pytest.importorskip("torch")
    values = np.arange(256, dtype=np.uint8).reshape(1, 1, 16, 16)
    theirs = (torch.from_numpy(values).float().div(255) - 0.5) / 0.5
    assert np.array_equal(scaled(values), theirs.numpy())
    assert scaled(values).min() == -1.0 and scaled(values).max() == 1.0


@needs_fashion_mnist
def test_the_written_data_keeps_each_clients_split_under_partition_natural(tmp_path):
    path = tmp_path / "pfllib.npz"
    counts = write_npz(path)
    settings = build_settings({"dataset": f"npz:{path}", "partition": "natural",
                               "num-clients": 20, "max-samples": 0, "model": "cnn"})
    federation = federated_dataset(settings)
    partition, labels = federation.partition, federation.dataset.labels
    names = [int(name) for name in partition.names]
    assert sorted(names) == list(range(20))
    for side, rows in (("train", partition.train), ("test", partition.test)):
        got = {name: np.bincount(labels[federation.pool[idx]], minlength=10).tolist()
               for name, idx in zip(names, rows, strict=True)}
        assert [got[i] for i in range(20)] == counts[side] == RECORDED[side]
    client = federation.client_data(names.index(0))  # the images as PFLlib scales them
    assert float(client.train_x.min()) == -1.0


# --- benchmarks/reproduce_pfllib.py: reading PFLlib's output, and the table ----------------------
def _runner():
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import reproduce_pfllib

    return reproduce_pfllib


def test_pfllibs_printed_accuracy_is_read_per_round_the_last_of_a_round_kept():
    runner = _runner()
    ditto = ("-------------Round number: 0-------------\nEvaluate global model\n"
             "Averaged Test Accuracy: 0.0584\nAveraged Test AUC: 0.5\n"
             "Evaluate personalized model\nAveraged Test Accuracy: 0.0612\n"
             "------------------------- time cost ------------------------- 1.0\n"
             "-------------Round number: 5-------------\nAveraged Test Accuracy: 0.8000\n"
             "Averaged Test Accuracy: 0.9034\n\nBest accuracy.\n0.9034\n")
    assert runner.pfllib_accuracy(ditto, "ditto") == {"0": 0.0612, "5": 0.9034}
    pfedme = "\n-------------Round number: 10-------------\nAverage Test Accuracy: 0.7512\n"
    assert runner.pfllib_accuracy(pfedme, "pfedme") == {"10": 0.7512}


def test_the_table_gives_each_sides_interval_and_the_welch_difference(tmp_path):
    from scipy import stats

    runner = _runner()
    ours, theirs = [0.90, 0.92, 0.94], [0.80, 0.85, 0.90]
    diff, low, high = runner.welch(ours, theirs)
    se = math.sqrt(0.0004 / 3 + 0.0025 / 3)  # the variances by hand: 0.02^2 and 0.05^2
    df = (0.0004 / 3 + 0.0025 / 3) ** 2 / ((0.0004 / 3) ** 2 / 2 + (0.0025 / 3) ** 2 / 2)
    assert diff == pytest.approx(0.07) and df == pytest.approx(2.6240, abs=1e-4)
    assert (low, high) == pytest.approx((0.07 - stats.t.ppf(0.975, df) * se,
                                         0.07 + stats.t.ppf(0.975, df) * se))
    for side, values in (("ours", ours), ("pfllib", theirs)):
        for seed, value in enumerate(values):
            path = runner.cell_path(tmp_path, side, "fedavg", seed)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"side": side, "method": "fedavg", "seed": seed,
                                        "accuracy": {"10": value - 0.1, "25": value}}))
    rows = {line.split("|")[2].strip(): line for line in runner.report(tmp_path).splitlines()
            if line.startswith("| fedavg")}
    assert set(rows) == {"10", "25"}
    assert "92.00 [" in rows["25"] and "(3)" in rows["25"] and "85.00 [" in rows["25"]
    excludes = not low <= 0 <= high
    assert ("excludes 0" in rows["25"]) == excludes and f"{100 * diff:+.2f}" in rows["25"]
    assert runner.cell_path(tmp_path, "ours", "fedavg", 0, 50).name == "fedavg-r50-seed-0.json"
