"""PFLlib's Fashion-MNIST clients, regenerated as data this project reads.

PFLlib (Zhang et al., "PFLlib: A Beginner-Friendly and Comprehensive Personalized Federated
Learning Library", JMLR 2025) publishes its accuracy board on one partition of Fashion-MNIST:
20 clients, Dirichlet(0.1) label skew over the pooled 70,000 images, each client's share split
75/25 into train and test, the images scaled to [-1, 1]. Its generator draws everything from
numpy's global random state seeded with 1. This module draws the same numbers in the same order
from a ``numpy.random.RandomState(1)`` of its own, so the clients come out sample for sample and
byte for byte as PFLlib writes them (checked against PFLlib's own generator run here on the same
Debian IDX files: docs/experiments/reproduce-pfllib.md), without torchvision or PFLlib:

1. **Pooling.** The 60,000 training images, then the 10,000 test images, in IDX order; each pixel
   ``((v / 255) - 0.5) / 0.5`` in float32 (torchvision's ``ToTensor`` then ``Normalize(0.5,
   0.5)``, operation for operation).
2. **Dirichlet shares, with PFLlib's retry.** Repeat until every client holds at least
   ``least = int(min(batch / (1 - train_ratio), N / clients / 2))`` samples (40 here): for each
   label in turn, shuffle that label's indices, draw proportions ``Dir(alpha * 1)`` over the
   clients, zero those of clients already holding ``N / clients`` samples or more, renormalise,
   and cut the shuffled indices at ``floor(cumsum(p) * n_k)``; a client's samples are its pieces
   in label order.
3. **The split,** client by client: a permutation of the client's ``n`` samples; its first
   ``n - floor(0.75 n)`` positions are the test split and the rest, in that order, the training
   split (scikit-learn's ``train_test_split(train_size=0.75, shuffle=True)`` on the global state,
   as PFLlib calls it).

:func:`write_npz` writes the clients as ``dataset = npz:PATH`` data with a ``client`` and a
``split`` array: ``partition = natural`` then keeps each client's own train/test split
(:mod:`pflalign.data.sources`).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

#: PFLlib's generator settings for its Fashion-MNIST board (dataset/generate_FashionMNIST.py
#: run as ``noniid - dir``, with dataset/utils/dataset_utils.py's module constants)
SEED, CLIENTS, ALPHA, TRAIN_RATIO, BATCH_SIZE = 1, 20, 0.1, 0.75, 10


def dirichlet_shares(labels: np.ndarray, rng: np.random.RandomState, clients: int = CLIENTS,
                     alpha: float = ALPHA, train_ratio: float = TRAIN_RATIO,
                     batch_size: int = BATCH_SIZE) -> list[np.ndarray]:
    """Each client's sample indices, drawn as step 2 of the module docstring describes."""
    total, classes = len(labels), len(np.unique(labels))  # PFLlib counts the labels present
    least = int(min(batch_size / (1 - train_ratio), total / clients / 2))
    smallest = 0
    while smallest < least:
        shares: list[list[int]] = [[] for _ in range(clients)]
        for label in range(classes):
            members = np.flatnonzero(labels == label)
            rng.shuffle(members)
            weights = rng.dirichlet(np.full(clients, alpha))
            weights = weights * np.array([len(s) < total / clients for s in shares])
            weights = weights / weights.sum()
            cuts = (np.cumsum(weights) * len(members)).astype(int)[:-1]
            shares = [s + piece.tolist() for s, piece in zip(shares, np.split(members, cuts),
                                                             strict=True)]
            smallest = min(len(s) for s in shares)
    return [np.asarray(s, dtype=np.int64) for s in shares]


def train_test(share: np.ndarray, rng: np.random.RandomState,
               train_ratio: float = TRAIN_RATIO) -> tuple[np.ndarray, np.ndarray]:
    """A client's (train, test) indices, split as step 3 of the module docstring describes."""
    size = len(share)
    num_test = size - math.floor(train_ratio * size)
    order = rng.permutation(size)
    return share[order[num_test:]], share[order[:num_test]]


def pfllib_clients(labels: np.ndarray, seed: int = SEED) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each of PFLlib's clients' (train, test) indices into the pooled samples, in its order."""
    rng = np.random.RandomState(seed)
    return [train_test(share, rng) for share in dirichlet_shares(labels, rng)]


def scaled(images: np.ndarray) -> np.ndarray:
    """uint8 images as PFLlib feeds them to its models: ``(v / 255 - 0.5) / 0.5`` in float32."""
    half = np.float32(0.5)
    return (images.astype(np.float32) / np.float32(255) - half) / half


def pooled_fashion_mnist(root: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST's 70,000 uint8 images (N x 1 x 28 x 28) and labels, training images first,
    from the Debian package's IDX files (or ``root``'s)."""
    from pflalign.data.datasets import _load_mnist_like

    return _load_mnist_like("fashion-mnist", root, download=False)


def write_npz(path: str | Path, seed: int = SEED, root: Path | None = None) -> dict:
    """Write PFLlib's clients as npz data (``x`` float32 in [-1, 1], ``y``, ``client``,
    ``split``: 0 train, 1 test; each client's training samples, then its test samples, in
    PFLlib's order) and return each client's label counts per split."""
    images, labels = pooled_fashion_mnist(root)
    clients = pfllib_clients(labels, seed)
    order = np.concatenate([np.concatenate([train, test]) for train, test in clients])
    client = np.concatenate([np.full(len(tr) + len(te), i, np.int64)
                             for i, (tr, te) in enumerate(clients)])
    split = np.concatenate([np.repeat(np.array([0, 1], np.int8), [len(tr), len(te)])
                            for tr, te in clients])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:  # np.savez on a handle: the name is kept as given
        np.savez(handle, x=scaled(images[order]), y=labels[order], client=client, split=split)
    return label_counts(labels, clients)


def label_counts(labels: np.ndarray, clients: list[tuple[np.ndarray, np.ndarray]],
                 ) -> dict[str, list[list[int]]]:
    """Per split, each client's samples per label."""
    classes = int(labels.max()) + 1
    return {side: [np.bincount(labels[pair[k]], minlength=classes).tolist() for pair in clients]
            for k, side in enumerate(("train", "test"))}


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description="Write PFLlib's Fashion-MNIST clients "
                                     "(Dir(0.1), 20 clients, 75/25 split, seed 1) as npz data.")
    parser.add_argument("out", nargs="?", default="data/pfllib-fashion-mnist.npz")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--data-root", type=Path, default=None,
                        help="a folder with Fashion-MNIST's four IDX files (default: the Debian "
                        "package's)")
    args = parser.parse_args(argv)
    counts = write_npz(args.out, args.seed, args.data_root)
    train = [sum(c) for c in counts["train"]]
    test = [sum(c) for c in counts["test"]]
    print(json.dumps({"train": train, "test": test}))
    print(f"{sum(train):,} train and {sum(test):,} test samples over {len(train)} clients "
          f"written to {args.out}; use: --set dataset=npz:{args.out} --set partition=natural")


if __name__ == "__main__":
    main()
