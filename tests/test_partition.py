import time

import numpy as np
import pytest
from conftest import needs_fashion_mnist

from pflalign.data.datasets import ClientData
from pflalign.data.partition import (
    dirichlet_partition,
    iid_partition,
    make_partition,
    pathological_partition,
    quantity_partition,
    split_train_test,
)
from pflalign.run.config import ConfigError


def _assert_exact_cover(parts, n):
    everything = np.concatenate(parts)
    assert len(everything) == n
    assert np.array_equal(np.sort(everything), np.arange(n))


def _mean_label_entropy(parts, labels, num_classes=10):
    entropies = []
    for idx in parts:
        p = np.bincount(labels[idx], minlength=num_classes) / len(idx)
        p = p[p > 0]
        entropies.append(float(-(p * np.log(p)).sum()))
    return float(np.mean(entropies))


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "pathological", "quantity"])
def test_every_sample_assigned_exactly_once_including_train_test_split(scheme, labels_10k):
    part = make_partition(labels_10k, 10, scheme=scheme, num_clients=15, num_unseen=3, seed=4)
    assert part.num_clients == 18
    _assert_exact_cover(list(part.train) + list(part.test), len(labels_10k))
    assert all(len(t) >= 1 for t in part.test) and all(len(t) >= 1 for t in part.train)


def test_label_skew_grows_as_alpha_shrinks(labels_10k):
    rng = np.random.default_rng
    entropy = {alpha: _mean_label_entropy(
        dirichlet_partition(labels_10k, 20, alpha, rng(0))[0], labels_10k)
        for alpha in (0.05, 0.1, 1.0, 100.0)}
    assert entropy[0.05] < entropy[0.1] < entropy[1.0] < entropy[100.0]
    assert entropy[100.0] > 0.95 * np.log(10)  # near-uniform labels
    assert entropy[0.1] < 0.5 * np.log(10)  # strongly skewed


def test_pathological_gives_exactly_k_classes_per_client(labels_10k):
    for k in (1, 2, 3):
        parts = pathological_partition(labels_10k, 20, k, np.random.default_rng(1))
        _assert_exact_cover(parts, len(labels_10k))
        assert [len(np.unique(labels_10k[p])) for p in parts] == [k] * 20


def test_pathological_rejects_more_classes_than_exist(labels_10k):
    with pytest.raises(ConfigError, match="classes-per-client"):
        pathological_partition(labels_10k, 5, 11, np.random.default_rng(0))


def test_partition_is_deterministic_in_the_seed(labels_10k):
    kwargs = dict(scheme="dirichlet", num_clients=10, alpha=0.3)
    a = make_partition(labels_10k, 10, seed=7, **kwargs)
    b = make_partition(labels_10k, 10, seed=7, **kwargs)
    c = make_partition(labels_10k, 10, seed=8, **kwargs)
    pairs = zip(a.train + a.test, b.train + b.test, strict=True)
    assert all(np.array_equal(x, y) for x, y in pairs)
    assert not all(np.array_equal(x, y) for x, y in zip(a.train, c.train, strict=True))


def test_minimum_size_guard_tops_up_clients_and_terminates(labels_10k):
    # 400 clients of 25 samples on average with alpha=0.05: many draw almost nothing.
    started = time.perf_counter()
    parts, topped = dirichlet_partition(labels_10k, 400, 0.05, np.random.default_rng(0),
                                        min_samples=15)
    assert time.perf_counter() - started < 5
    assert topped > 0
    assert min(len(p) for p in parts) >= 15
    _assert_exact_cover(parts, len(labels_10k))


def test_small_alpha_without_need_for_top_up_keeps_draw(labels_10k):
    parts, topped = dirichlet_partition(labels_10k, 10, 0.5, np.random.default_rng(0),
                                        min_samples=10)
    assert topped == 0 and min(len(p) for p in parts) >= 10


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "quantity", "pathological"])
def test_more_clients_than_samples_is_a_clear_error(scheme, labels_10k):
    with pytest.raises(ConfigError, match="lower num-clients"):
        make_partition(labels_10k, 10, scheme=scheme, num_clients=2000, min_samples=10)


def test_quantity_sizes_follow_a_power_law(labels_10k):
    parts = quantity_partition(labels_10k, 10, 1.0, np.random.default_rng(0), min_samples=10)
    _assert_exact_cover(parts, len(labels_10k))
    sizes = np.sort([len(p) for p in parts])[::-1]
    extra = sizes - 10
    # shares of the remainder are proportional to 1/k: largest/k-th ~= k
    assert abs(extra[0] / extra[1] - 2) < 0.01 and abs(extra[0] / extra[9] - 10) < 0.1
    # labels stay IID
    assert _mean_label_entropy(parts, labels_10k) > 0.9 * np.log(10)


def test_train_test_split_is_stratified():
    labels = np.repeat(np.arange(4), [40, 20, 8, 4])
    train, test = split_train_test(np.arange(len(labels)), labels, 0.25,
                                   np.random.default_rng(0))
    _assert_exact_cover([train, test], len(labels))
    assert len(test) == 18  # floor(72 * 0.25)
    counts = np.bincount(labels[test], minlength=4)
    assert np.all(np.abs(counts - 0.25 * np.array([40, 20, 8, 4])) <= 1)


def test_split_keeps_at_least_one_test_sample():
    labels = np.array([0, 1])
    train, test = split_train_test(np.arange(2), labels, 0.25, np.random.default_rng(0))
    assert len(train) == 1 and len(test) == 1


def test_unseen_clients_are_the_last_ids(labels_10k):
    part = make_partition(labels_10k, 10, scheme="iid", num_clients=8, num_unseen=2)
    assert [part.is_unseen(i) for i in range(10)] == [False] * 8 + [True] * 2
    summary = part.summary(labels_10k, 10)
    assert summary["num-unseen-clients"] == 2
    client = summary["clients"][3]
    assert sum(client["train-labels"]) == client["num-train"]
    assert sum(client["test-labels"]) == client["num-test"]


@needs_fashion_mnist
def test_dirichlet_for_10000_clients_of_fashion_mnist_under_two_seconds():
    from pflalign.data.datasets import load_dataset

    labels = load_dataset("fashion-mnist").labels
    started = time.perf_counter()
    part = make_partition(labels, 10, scheme="dirichlet", num_clients=10_000, alpha=0.3, seed=0,
                          min_samples=5)
    elapsed = time.perf_counter() - started
    assert elapsed < 2.0, f"partitioning took {elapsed:.2f}s"
    _assert_exact_cover(list(part.train) + list(part.test), len(labels))
    assert min(len(a) + len(b) for a, b in zip(part.train, part.test, strict=True)) >= 5


def test_the_dirichlet_draw_is_the_one_recorded_before_it_was_vectorized():
    """The partition of a fixed draw, top-ups included, hashed with the per-class, per-client
    split it replaced (recorded on 2026-12-02): the faster gathering changes no client's
    samples, nor their order (which the top-up's donor draws depend on)."""
    import hashlib

    labels = np.random.default_rng(7).integers(0, 10, 20_000)
    parts, topped_up = dirichlet_partition(labels, 3000, 0.3, np.random.default_rng(3), 5)
    digest = hashlib.sha256()
    for part in parts:
        digest.update(np.asarray(part, dtype=np.int64).tobytes())
        digest.update(b"|")
    assert (digest.hexdigest()[:16], topped_up) == ("2023b77dcfa73009", 699)


def test_iid_sizes_differ_by_at_most_one(labels_10k):
    sizes = [len(p) for p in iid_partition(labels_10k, 7, np.random.default_rng(0))]
    assert max(sizes) - min(sizes) <= 1


def test_rotated_partition_holds_out_groups_for_the_unseen_clients(labels_10k):
    from pflalign.data.partition import rotated_partition

    rng = np.random.default_rng(0)
    parts, rotations, _ = rotated_partition(labels_10k, 8, 3, (0, 30, 60, 90), 1, 0.5, rng, 10,
                                            10)
    assert rotations[:8] == [0.0, 30.0, 60.0] * 2 + [0.0, 30.0]
    assert rotations[8:] == [90.0] * 3
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == len(joined)  # disjoint
    assert all(len(p) >= 10 for p in parts)
    # without unseen clients every group trains
    _, rotations, _ = rotated_partition(labels_10k, 8, 0, (0, 30, 60, 90), 1, 0.5,
                                        np.random.default_rng(0), 10, 10)
    assert sorted(set(rotations)) == [0.0, 30.0, 60.0, 90.0]
    with pytest.raises(ConfigError, match="at least one"):
        rotated_partition(labels_10k, 4, 2, (0, 90), 2, 0.5, np.random.default_rng(0), 10, 10)


@needs_fashion_mnist
def test_rotated_clients_see_rotated_images_and_the_config_is_checked():
    import torch

    from pflalign.data.federated import federated_dataset
    from pflalign.run.config import build_settings

    settings = build_settings({"partition": "rotated", "num-clients": 3, "num-unseen-clients": 1,
                         "rotation-angles": "0,180,90", "max-samples": 2000})
    fed = federated_dataset(settings)
    assert fed.partition.rotations == (0.0, 180.0, 0.0, 90.0)
    plain = ClientData.from_indices(fed.dataset, fed.pool[fed.partition.train[3]],
                                    fed.pool[fed.partition.test[3]])
    rotated = fed.client_data(3)
    assert torch.equal(rotated.train_x, torch.rot90(plain.train_x, 1, dims=(2, 3)))
    assert torch.equal(rotated.train_y, plain.train_y)
    assert fed.summary()["clients"][3]["rotation"] == 90.0
    with pytest.raises(ConfigError, match="leaves no angle"):
        build_settings({"partition": "rotated", "num-unseen-clients": 1, "rotation-angles": "0",
                  "rotation-unseen-groups": 1})
    with pytest.raises(ConfigError, match="numbers of degrees"):
        build_settings({"partition": "rotated", "rotation-angles": "0,ninety"})
