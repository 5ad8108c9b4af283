"""The model-replacement backdoor's trigger, its poisoned training data and its success rate.

Bagdasaryan et al., "How to backdoor federated learning", AISTATS 2020: an attacker trains on its
data with a share of the samples carrying a trigger and relabelled to a target class, then
scales its update so that it replaces the global model (the boost is in
:mod:`pflalign.engines.faults`). The trigger here is a square patch of ``backdoor-patch`` pixels
at the image's bottom-right corner set to the brightest value (255 for the stored uint8 images,
1.0 for float images), in every channel.

The attack success rate (ASR) is measured on every client's test split, honest or not: of the
test samples whose label is not the target, the share that the model classifies as the target
once the trigger is added. Each client reports the two counts (``backdoor-hits`` of
``backdoor-tried``) and the server pools them (``personal-backdoor-asr``).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from pflalign.data.datasets import ClientData

#: the seed stream of the poisoned samples' draw
BACKDOOR_STREAM = 7004


def with_trigger(x: torch.Tensor, patch: int) -> torch.Tensor:
    """Images ``x`` (N x [C x] H x W) with the trigger patch set (a copy)."""
    if x.dim() < 3 or min(x.shape[-2:]) < patch:
        raise ValueError(f"attack = 'backdoor' sets a {patch} x {patch} patch in images, and "
                         f"this run's samples have the shape {tuple(x.shape[1:])}.")
    out = x.clone()
    out[..., -patch:, -patch:] = 255 if x.dtype == torch.uint8 else 1.0
    return out


def poisoned(data: ClientData, share: float, target: int, patch: int, seed: int,
             client_id: int) -> ClientData:
    """``data`` with ``round(share * num_train)`` training samples (drawn by seed and client)
    carrying the trigger and the label ``target``; its test split untouched."""
    check_target(target, data)
    count = round(share * len(data.train_y))
    chosen = np.random.default_rng([seed, BACKDOOR_STREAM, client_id]).choice(
        len(data.train_y), size=count, replace=False)
    index = torch.from_numpy(np.sort(chosen)).to(data.train_y.device)
    train_x, train_y = data.train_x.clone(), data.train_y.clone()
    train_x[index] = with_trigger(train_x[index], patch)
    train_y[index] = target
    return replace(data, train_x=train_x, train_y=train_y)


def check_target(target: int, data: ClientData) -> None:
    if data.train_y.is_floating_point():
        raise ValueError("attack = 'backdoor' relabels samples, and this task's targets are "
                         "not classes.")


@torch.inference_mode()
def success_counts(model: torch.nn.Module, data: ClientData, target: int, patch: int,
                   batch_size: int = 256) -> tuple[int, int]:
    """(hits, tried): of the test samples not labelled ``target``, how many ``model``
    classifies as ``target`` with the trigger added."""
    check_target(target, data)
    keep = data.test_y != target
    x, tried = data.test_x[keep], int(keep.sum())
    model.eval()
    hits = 0
    for start in range(0, tried, batch_size):
        logits = model(data.normalize(with_trigger(x[start:start + batch_size], patch)))
        hits += int((logits.argmax(dim=1) == target).sum())
    return hits, tried
