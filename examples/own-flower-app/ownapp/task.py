"""This app's own model and data: a small MLP, and per-client data with skewed labels.

The data stand for what a real app would read from its own files: each client's samples are
drawn from its own seeded generator (four Gaussian classes in 16 dimensions, each client with
its own mix of classes and its own shift of the features), and ``load_data`` gives them as
PyTorch DataLoaders, as Flower's quickstart does.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FEATURES, CLASSES = 16, 4


class Net(nn.Module):
    """Two hidden layers and a linear head (``fc``, which methods with a personal head keep)."""

    def __init__(self, input_shape: tuple[int, ...] = (FEATURES,), num_classes: int = CLASSES):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(int(np.prod(input_shape)), 32), nn.ReLU(),
                                  nn.Linear(32, 32), nn.ReLU())
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x.flatten(1)))


def _client_arrays(partition_id: int, samples: int) -> tuple[np.ndarray, np.ndarray]:
    """One client's samples: class centres shared by all, a mix of classes and a feature shift
    of its own (its personal task)."""
    shared = np.random.default_rng(1234)
    centres = shared.normal(0.0, 1.5, size=(CLASSES, FEATURES))
    rng = np.random.default_rng([1234, partition_id])
    mix = rng.dirichlet(np.full(CLASSES, 0.5))
    labels = rng.choice(CLASSES, size=samples, p=mix)
    shift = rng.normal(0.0, 0.5, size=FEATURES)
    x = centres[labels] + shift + rng.normal(0.0, 1.0, size=(samples, FEATURES))
    return x.astype(np.float32), labels.astype(np.int64)


def load_data(partition_id: int, batch_size: int = 16) -> tuple[DataLoader, DataLoader]:
    """Client ``partition_id``'s train and test loaders (80/20 of its samples)."""
    samples = 60 + 20 * (partition_id % 3)
    x, y = _client_arrays(partition_id, samples)
    cut = int(0.8 * samples)
    train = TensorDataset(torch.from_numpy(x[:cut]), torch.from_numpy(y[:cut]))
    test = TensorDataset(torch.from_numpy(x[cut:]), torch.from_numpy(y[cut:]))
    return (DataLoader(train, batch_size=batch_size, shuffle=True),
            DataLoader(test, batch_size=batch_size))
