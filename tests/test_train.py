import math

import numpy as np
import pytest
import torch
from conftest import needs_fashion_mnist

from pflalign.data.datasets import ClientData, Dataset, Normalizer
from pflalign.models.registry import MODELS, build_model
from pflalign.server.metrics import accuracy_summary
from pflalign.settings.options import ConfigError
from pflalign.training.loops import (
    derive_seed,
    evaluate,
    make_generator,
    num_local_steps,
    train_batches,
)


def _tiny_dataset(n=64, channels=1, side=28, classes=10, seed=0) -> Dataset:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, channels, side, side), dtype=np.uint8)
    return Dataset("tiny", images, rng.integers(0, classes, n).astype(np.int64), classes,
                   (0.5,) * channels, (0.25,) * channels)


@pytest.mark.parametrize("name", [m for m, spec in MODELS.items() if "image" in spec.takes])
@pytest.mark.parametrize("shape,classes", [((1, 28, 28), 10), ((3, 32, 32), 100)])
def test_models_give_logits_of_the_right_shape(name, shape, classes):
    model = build_model(name, shape, classes, seed=0)
    assert model(torch.zeros(5, *shape)).shape == (5, classes)


def test_every_model_declares_its_input_and_batch_norm_truly():
    shapes = {"image": (1, 28, 28), "tokens": (80,), "features": (12,)}
    for name, spec in MODELS.items():
        # a sample shape of a kind it does not take (feature vectors and token sequences are
        # both one-dimensional: a model taking one of them takes that shape)
        for kind, other in shapes.items():
            if kind in spec.takes or len(other) == 1 and {"tokens", "features"} & set(spec.takes):
                continue
            with pytest.raises(ConfigError, match=f"Model '{name}' takes"):
                build_model(name, other, 10)
        if "features" in spec.takes:
            assert build_model(name, (12,), 3)(torch.zeros(4, 12)).shape == (4, 3)
        shape = (1, 28, 28) if "image" in spec.takes else (80,)
        model = build_model(name, shape, 10)
        norms = torch.nn.modules.batchnorm._BatchNorm
        has_norm = any(isinstance(m, norms) for m in model.modules())
        assert has_norm == spec.batch_norm, name
        if spec.batch_norm_version:
            assert MODELS[spec.batch_norm_version].batch_norm and not spec.batch_norm


def test_cnn_is_pfllibs_4_layer_cnn():
    model = build_model("cnn", (1, 28, 28), 10)
    assert sum(p.numel() for p in model.parameters()) == 582_026
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size) for c in convs] == [(32, (5, 5)), (64, (5, 5))]


def test_seeded_model_init_is_reproducible():
    a = build_model("cnn", (1, 28, 28), 10, seed=3).state_dict()
    b = build_model("cnn", (1, 28, 28), 10, seed=3).state_dict()
    c = build_model("cnn", (1, 28, 28), 10, seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["fc.weight"], c["fc.weight"])


def test_normalizer_matches_the_formula():
    norm = Normalizer((0.5, 0.25), (0.2, 0.5))
    x = torch.randint(0, 256, (3, 2, 4, 4), dtype=torch.uint8)
    expected = (x.float() / 255 - torch.tensor([0.5, 0.25]).view(1, 2, 1, 1)) / torch.tensor(
        [0.2, 0.5]).view(1, 2, 1, 1)
    torch.testing.assert_close(norm(x), expected)


def test_num_local_steps():
    assert num_local_steps(100, 32, 1) == 4
    assert num_local_steps(100, 32, 3) == 12
    assert num_local_steps(100, 32, 3, max_steps=5) == 5
    assert num_local_steps(96, 32, 1) == 3


def _client(ds: Dataset) -> ClientData:
    return ClientData.from_indices(ds, np.arange(48), np.arange(48, 64))


def test_training_lowers_the_loss_on_a_small_batch():
    ds = _tiny_dataset()
    data = _client(ds)
    model = build_model("cnn", (1, 28, 28), 10, seed=0)
    before = evaluate(model, data.train_x, data.train_y, data.normalize)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    stats = train_batches(model, data.train_x, data.train_y, data.normalize, optimizer=opt,
                        batch_size=16, epochs=15, generator=make_generator(0))
    after = evaluate(model, data.train_x, data.train_y, data.normalize)
    assert stats.steps == 45 and stats.samples == 15 * 48
    assert after.loss_sum < 0.75 * before.loss_sum
    assert after.correct > before.correct


def test_training_is_deterministic_under_the_same_generator_seed():
    ds = _tiny_dataset()
    data = _client(ds)
    results = []
    for seed in (1, 1, 2):
        model = build_model("mlp", (1, 28, 28), 10, seed=0)
        train_batches(model, data.train_x, data.train_y, data.normalize,
                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1), batch_size=8,
                    generator=make_generator(seed))
        results.append(model.state_dict()["fc.weight"].clone())
    assert torch.equal(results[0], results[1])
    assert not torch.equal(results[0], results[2])


def test_max_steps_caps_training():
    data = _client(_tiny_dataset())
    model = build_model("mlp", (1, 28, 28), 10, seed=0)
    stats = train_batches(model, data.train_x, data.train_y, data.normalize,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), batch_size=8,
                        epochs=5, max_steps=7, generator=make_generator(0))
    assert stats.steps == 7 and stats.samples == 56


def test_evaluate_counts_correct_predictions():
    class Fixed(torch.nn.Module):
        def forward(self, x):  # predicts class 1 for every input
            return torch.tensor([[0.0, 1.0, 0.0]]).repeat(len(x), 1)

    x = torch.zeros(5, 1, 2, 2, dtype=torch.uint8)
    y = torch.tensor([1, 0, 1, 2, 1])
    stats = evaluate(Fixed(), x, y, Normalizer((0.0,), (1.0,)), batch_size=2)
    assert stats.correct == 3 and stats.count == 5
    # softmax of [0, 1, 0]: p(1) = e / (e + 2), p(0) = p(2) = 1 / (e + 2)
    expected = 3 * -math.log(math.e / (math.e + 2)) + 2 * -math.log(1 / (math.e + 2))
    assert stats.loss_sum == pytest.approx(expected, rel=1e-6)


def test_derived_seeds_differ_by_every_part():
    base = derive_seed(0, 1, 2, 1)
    assert base == derive_seed(0, 1, 2, 1)
    assert len({base, derive_seed(1, 1, 2, 1), derive_seed(0, 2, 2, 1), derive_seed(0, 1, 3, 1),
                derive_seed(0, 1, 2, 2)}) == 5


def test_accuracy_summary_matches_hand_computation():
    correct = [1, 9, 10, 0, 5]
    count = [10, 10, 20, 5, 5]
    s = accuracy_summary(correct, count)
    per = np.array([0.1, 0.9, 0.5, 0.0, 1.0])
    assert s["personal-acc"] == pytest.approx(25 / 50)
    assert s["personal-acc-unweighted"] == pytest.approx(per.mean())
    assert s["personal-acc-std"] == pytest.approx(per.std())
    assert s["personal-acc-bottom10"] == pytest.approx(0.0)  # ceil(0.5) = 1 worst client
    many = accuracy_summary(list(range(11)), [10] * 11)  # accuracies 0.0 .. 1.0
    assert many["personal-acc-bottom10"] == pytest.approx((0.0 + 0.1) / 2)  # ceil(1.1) = 2


@needs_fashion_mnist
def test_fashion_mnist_loads_pooled_with_balanced_classes():
    from pflalign.data.datasets import load_dataset

    ds = load_dataset("fashion-mnist")
    assert ds.images.shape == (70000, 1, 28, 28) and ds.images.dtype == np.uint8
    assert np.array_equal(np.bincount(ds.labels), np.full(10, 7000))
    assert ds.num_classes == 10
