"""A client's own data loaders as its :class:`~pflalign.data.node.NodeData`, for
``dataset = clients`` (:mod:`pflalign.data.clients`; :func:`clients.answer` calls this)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping

import torch
from torch.utils.data import DataLoader, RandomSampler

from pflalign.data.datasets import AsFloat, ClientData
from pflalign.data.node import NodeData


def _pair(batch: object, keys: tuple[str, str] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's inputs and labels: ``(x, y)``, or two entries of a dict batch (``keys``, or its
    one floating and one integer tensor)."""
    if isinstance(batch, Mapping):
        if keys is None:
            tensors = [v for v in batch.values() if isinstance(v, torch.Tensor)]
            floats = [t for t in tensors if t.is_floating_point()]
            ints = [t for t in tensors if not t.is_floating_point()]
            if len(floats) != 1 or len(ints) != 1:
                raise ValueError(f"A batch is a dict with keys {sorted(batch)}: name its input "
                                 "and label entries with batch_keys=(input, label).")
            return floats[0], ints[0]
        missing = [k for k in keys if k not in batch]
        if missing:
            raise ValueError(f"A batch has no {missing[0]!r} (batch_keys = {keys}); it has "
                             f"{sorted(batch)}.")
        return batch[keys[0]], batch[keys[1]]
    if isinstance(batch, list | tuple) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError("A data loader's batches must be (inputs, labels) pairs or dicts; got "
                     f"{type(batch).__name__}.")


def _in_order(loader: Iterable) -> Iterable:
    """``loader``'s samples in their dataset's order: a DataLoader that shuffles is read through
    a sequential one over its dataset (the run's own seeded batches train; a shuffled order
    would change from message to message)."""
    if isinstance(loader, DataLoader) and isinstance(loader.sampler, RandomSampler):
        return DataLoader(loader.dataset, batch_size=loader.batch_size or 1, shuffle=False,
                          collate_fn=loader.collate_fn)
    return loader


def read_split(loader: Iterable, keys: tuple[str, str] | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """All of a loader's samples as one float32 input tensor and one int64 label tensor."""
    xs, ys = [], []
    for batch in _in_order(loader):
        x, y = _pair(batch, keys)
        xs.append(torch.as_tensor(x).float())
        ys.append(torch.as_tensor(y).long().reshape(-1))
    if not xs:
        raise ValueError("A data loader gave no samples.")
    return torch.cat(xs), torch.cat(ys)


_READ: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _split(loader: Iterable, keys: tuple[str, str] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`read_split`, once per loader object that lives on (a ClientApp that keeps its
    loaders reads them once per process)."""
    try:
        cached = _READ.get(loader)
    except TypeError:  # not weakly referenceable: read it each time
        return read_split(loader, keys)
    if cached is None or cached[0] != keys:
        cached = (keys, read_split(loader, keys))
        _READ[loader] = cached
    return cached[1]


def node_data_from_loaders(client_id: int, trainloader: Iterable, testloader: Iterable, *,
                           num_classes: int, input_shape: tuple[int, ...], num_clients: int,
                           num_train_clients: int, batch_keys: tuple[str, str] | None = None,
                           ) -> NodeData:
    """One client's :class:`NodeData` from its own loaders, checked against the run: every
    sample of ``input_shape``, every label in ``0..num_classes - 1``."""
    if not 0 <= client_id < num_clients:
        raise ValueError(f"partition-id {client_id} is outside this run's {num_clients} clients "
                         "(num-clients + num-unseen-clients).")
    splits = {}
    for name, loader in (("trainloader", trainloader), ("testloader", testloader)):
        x, y = _split(loader, batch_keys)
        if tuple(x.shape[1:]) != tuple(input_shape):
            raise ValueError(f"The {name}'s samples have shape {tuple(x.shape[1:])}, and the run's "
                             f"input-shape is {','.join(map(str, input_shape))}.")
        if len(x) != len(y):
            raise ValueError(f"The {name} gave {len(x)} inputs and {len(y)} labels.")
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= num_classes):
            raise ValueError(f"The {name}'s labels run {int(y.min())}..{int(y.max())}, outside the "
                             f"run's num-classes = {num_classes} (0..{num_classes - 1}).")
        splits[name] = (x, y)
    (train_x, train_y), (test_x, test_y) = splits["trainloader"], splits["testloader"]
    data = ClientData(train_x, train_y, test_x, test_y, AsFloat())
    return NodeData(client_id=client_id, data=data, num_classes=num_classes,
                    input_shape=tuple(input_shape), unseen=client_id >= num_train_clients,
                    num_clients=num_clients)
