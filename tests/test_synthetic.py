"""dataset = synthetic: Synthetic(alpha, beta) and Synthetic-IID (Li et al. 2020), generated per
client from the seed; the same metrics on every engine."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from harness import three_engines

from pflalign.data import synthetic
from pflalign.data.federated import federated_dataset
from pflalign.run.config import build_settings
from pflalign.settings.options import ConfigError

BASE = {"dataset": "synthetic", "partition": "natural", "model": "mlp", "seed": 3}


def federation(**changes: object) -> synthetic.SyntheticFederation:
    fed = federated_dataset(build_settings({**BASE, **changes}))
    assert isinstance(fed, synthetic.SyntheticFederation)
    return fed


def pooled(fed: synthetic.SyntheticFederation, clients: range) -> tuple[np.ndarray, np.ndarray]:
    data = [fed.client_data(c) for c in clients]
    return (torch.cat([d.train_x for d in data]).numpy(),
            torch.cat([d.train_y for d in data]).numpy())


def test_a_client_is_generated_from_the_seed_alone_in_any_order_and_any_federation():
    """A client's data do not depend on which clients were asked for before it, nor on how many
    clients the federation has (client k of 50 and of 5,000 are the same); another seed gives
    other data."""
    small, large = federation(**{"num-clients": 50}), federation(**{"num-clients": 5000})
    first = small.client_data(7)
    for c in (3, 9, 7):
        large.client_data(c)
    again = large.client_data(7)
    assert torch.equal(first.train_x, again.train_x) and torch.equal(first.test_y, again.test_y)
    other = federation(**{"num-clients": 50, "seed": 4}).client_data(7)
    assert not torch.equal(other.train_x[:1], first.train_x[:1])
    assert first.train_x.dtype == torch.float32 and first.train_y.dtype == torch.int64


def test_inputs_follow_the_clients_mean_and_the_decaying_covariance():
    """x ~ N(v_k, diag(j^-1.2)): within one client, feature j's variance is j^-1.2 (checked on
    a client of 20,000 samples, to 5%); Synthetic-IID's inputs are centred on 0."""
    fed = federation(**{"num-clients": 1, "min-samples-per-client": 20000,
                        "synthetic-max-samples": 20000, "synthetic-features": 8})
    x = torch.cat([fed.client_data(0).train_x, fed.client_data(0).test_x]).double().numpy()
    assert len(x) == 20000
    expected = np.arange(1, 9) ** -1.2
    np.testing.assert_allclose(x.var(axis=0), expected, rtol=0.05)
    iid = federation(**{"num-clients": 1, "min-samples-per-client": 20000,
                        "synthetic-max-samples": 20000, "synthetic-features": 8,
                        "synthetic-iid": True})
    np.testing.assert_allclose(iid.client_data(0).train_x.double().mean(0).numpy(), 0,
                               atol=0.03)


def test_synthetic_iid_shares_one_labelling_model_and_the_non_iid_clients_do_not():
    """Synthetic-IID: one softmax model labels every client, so a logistic regression fitted on
    10 clients' pooled data labels 10 other clients well; in Synthetic(1, 1) (and even
    Synthetic(0, 0)) each client draws its own model, and the fit transfers to no other client
    (about chance)."""
    def held_out_accuracy(**changes: object) -> float:
        fed = federation(**{"num-clients": 20, "min-samples-per-client": 150,
                            "synthetic-max-samples": 150, "synthetic-features": 20, **changes})

        def design(clients: range) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = pooled(fed, clients)
            x = torch.from_numpy(x).double()
            return torch.cat([x, torch.ones(len(x), 1, dtype=torch.float64)], 1), \
                torch.from_numpy(y)

        (x, y), (x_new, y_new) = design(range(10)), design(range(10, 20))
        weights = torch.zeros(x.shape[1], 10, dtype=torch.float64, requires_grad=True)
        optimizer = torch.optim.LBFGS([weights], max_iter=100, line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = (torch.nn.functional.cross_entropy(x @ weights, y)
                    + 1e-4 * weights.square().sum())
            loss.backward()
            return loss

        optimizer.step(closure)
        assert float(((x @ weights).argmax(1) == y).double().mean()) > 0.75  # it did fit
        return float(((x_new @ weights).argmax(1) == y_new).double().mean())

    assert held_out_accuracy(**{"synthetic-iid": True}) > 0.8
    assert held_out_accuracy() < 0.2
    assert held_out_accuracy(**{"synthetic-alpha": 0.0, "synthetic-beta": 0.0}) < 0.2


def test_client_sizes_follow_the_power_law_and_the_splits_add_up():
    """n = floor(m (1 - U)^(-1/s)), capped: P(n >= t m) = t^-s below the cap; each client's
    test split is floor(n * test-fraction) of its last samples, and with evaluate-on =
    validation the validation part comes out of the training split."""
    fed = federation(**{"num-clients": 100000, "synthetic-size-power": 1.5,
                        "min-samples-per-client": 10, "synthetic-max-samples": 1000})
    counts = fed.sample_counts
    assert counts.min() == 10 and counts.max() == 1000
    for t in (2, 5, 20):
        assert abs((counts >= 10 * t).mean() - t ** -1.5) < 0.005
    assert np.array_equal(fed.partition.train_sizes + fed.partition.test_sizes, counts)
    assert np.array_equal(fed.partition.test_sizes, np.floor(counts * 0.25).astype(int))
    val = federation(**{"num-clients": 200, "evaluate-on": "validation",
                        "validation-fraction": 0.2})
    test = federation(**{"num-clients": 200})
    train = test.partition.train_sizes
    assert np.array_equal(val.partition.test_sizes, np.maximum(1, np.floor(train * 0.2)))
    assert np.array_equal(val.partition.train_sizes + val.partition.test_sizes, train)
    a, b = val.client_data(5), test.client_data(5)
    assert torch.equal(torch.cat([a.train_x, a.test_x]), b.train_x)


def test_a_federation_of_100000_clients_holds_no_client_data():
    """Building the federation draws one size per client and generates nothing; a client is
    generated when asked for."""
    started = time.perf_counter()
    fed = federation(**{"num-clients": 99000, "num-unseen-clients": 1000})
    assert time.perf_counter() - started < 2.0
    assert fed.dataset.images.size == 0 and fed.partition.num_clients == 100000
    assert fed.partition.is_unseen(99000) and not fed.partition.is_unseen(98999)
    last = fed.client_data(99999)
    assert last.num_train == fed.sizes(99999)[0] and last.num_test == fed.sizes(99999)[1]
    with pytest.raises(ValueError, match="outside 0..99999"):
        fed.client_data(100000)


@pytest.mark.parametrize(("changes", "message"), [
    ({"partition": "dirichlet"}, "set partition = 'natural'"),
    ({"max-samples": 100}, "set max-samples = 0"),
    ({"synthetic-max-samples": 5}, "synthetic-max-samples = 5 is below"),
    ({"model": "cnn"}, "holds feature vectors"),
])
def test_bad_synthetic_configs_are_one_sentence(changes: dict, message: str):
    with pytest.raises(ConfigError, match=message):
        build_settings({**BASE, **changes})


def test_synthetic_runs_bit_for_bit_on_every_engine(tmp_path):
    """The sequential and batched engines give the same metrics (feature vectors run on Flower
    in test_tables.py's CSV test); an unseen client is generated like the others."""
    results = three_engines({**BASE, "num-clients": 6, "num-unseen-clients": 1, "rounds": 2,
                             "fraction-train": 0.5, "methods": "fedavg,pflalign",
                             "synthetic-max-samples": 60}, tmp_path, compared_at_least=20,
                            flower=False)
    final = results["methods"]["pflalign"]["final"]
    assert results["partition"]["dataset"] == "synthetic(1,1)"
    assert "unseen-acc" in final and final["personal-acc"] > 0.3
