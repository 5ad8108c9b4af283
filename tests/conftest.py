"""Shared test set-up: the Flower/Ray environment, the repository on sys.path, small fixtures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pflalign.data import DEBIAN_FASHION_MNIST  # noqa: E402
from pflalign.runtime import set_flower_environment  # noqa: E402

set_flower_environment()

HAS_FASHION_MNIST = (DEBIAN_FASHION_MNIST / "train-images-idx3-ubyte.gz").exists()
needs_fashion_mnist = pytest.mark.skipif(
    not HAS_FASHION_MNIST,
    reason="Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)")


@pytest.fixture
def labels_10k() -> object:
    """10,000 synthetic labels over 10 balanced classes, in shuffled order."""
    import numpy as np

    return np.random.default_rng(123).permutation(np.repeat(np.arange(10), 1000))
