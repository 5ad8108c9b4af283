"""Seeded local training and evaluation loops, shared by every method."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pflalign.data import Normalizer
from pflalign.optim import GENIE
from pflalign.params import Params, param

# Independent random streams derived from (seed, round, client, stream).
STREAM_TRAIN = 1
STREAM_FINETUNE = 2
STREAM_PERSONAL = 3  # a second local model (Ditto's personal model, APFL's mixture)
STREAM_ADAPT = 4  # a method's own adaptation data (FedALA's random subset)
STREAM_OPTIMIZER = 5  # an optimizer's own randomness (GENIE's mask and noise), per training stream
STREAM_GGA = 6  # the batch a client scores the annealing candidates on


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integer parts (e.g. seed, round, client id, stream), order-sensitive."""
    state = np.random.SeedSequence([int(p) for p in parts]).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def make_generator(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(*parts))


def configure_threads(num_cpus: float) -> int:
    """Give torch as many intra-op threads as the client has CPU cores (at least one)."""
    threads = max(1, int(num_cpus))
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


def pick_device(num_gpus: float) -> torch.device:
    """``cuda`` when the client was given a GPU share and one exists, else ``cpu``."""
    return torch.device("cuda" if num_gpus > 0 and torch.cuda.is_available() else "cpu")


def num_local_steps(num_samples: int, batch_size: int, epochs: int, max_steps: int = 0) -> int:
    """Optimizer steps in one local round: ``ceil(n / B) * E``, capped by ``max_steps`` if > 0."""
    steps = math.ceil(num_samples / batch_size) * epochs
    return min(steps, max_steps) if max_steps > 0 else steps


@dataclass(frozen=True)
class LocalTraining(Params):
    """The run's local training (mini-batches, steps, the local optimizer): run-wide keys that a
    method entry may override, e.g. ``fedavg(lr=0.1)``."""

    group: ClassVar[str] = "train"

    batch_size: int = param(32, "Local mini-batch size.", minimum=1)
    local_epochs: int = param(1, "Local epochs per round.", minimum=1)
    local_steps: int = param(0, "If > 0, cap the local optimizer steps per round at this "
                             "number.", minimum=0)
    lr: float = param(0.05, "Local learning rate (SGD).", minimum=0.0, exclusive_minimum=True,
                      search=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2))
    momentum: float = param(0.0, "Local SGD momentum (0 is plain SGD, as in FedAvg).",
                            minimum=0.0, maximum=1.0, exclusive_maximum=True)
    weight_decay: float = param(0.0, "Local L2 weight decay.", minimum=0.0)
    local_optimizer: str = param(
        "sgd", "Local optimizer of the methods that train with a standard one: sgd (lr, "
        "momentum), adam (adam-lr) or genie (genie-*); a new one every round. Methods with their "
        "own local rule (scaffold, apfl, perfedavg, pfedme, pflalign) refuse anything but sgd; "
        "pflalign-genie is pFLAlign with GENIE.", choices=("sgd", "adam", "genie"))
    adam_lr: float = param(0.001, "Step size of local-optimizer = adam.", minimum=0.0,
                           exclusive_minimum=True)
    genie_lr: float = param(
        0.3, "GENIE's step size (the paper's convergence rate eta, ALGORITHMS.md 2.5), for "
        "local-optimizer = genie and pflalign-genie. The paper's 0.015 (pretrained ResNets) "
        "trains a CNN from scratch too slowly; 0.3 was best of 0.015-1.0 on "
        "configs/rotated.toml, seeds 0-1 (README).", minimum=0.0, exclusive_minimum=True,
        group="genie")
    genie_moving_avg: float = param(0.95, "GENIE's EMA decay beta.", minimum=0.0, maximum=1.0,
                                    exclusive_maximum=True, group="genie")
    genie_p: float = param(0.4, "GENIE's mask drop probability.", minimum=0.0, maximum=1.0,
                           exclusive_maximum=True, group="genie")
    genie_precondition: bool = param(True, "GENIE: apply the OSGR preconditioner r * tau "
                                     "(false: step on the bias-corrected EMA mean).",
                                     group="genie")
    genie_noise: bool = param(True, "GENIE: add noise on low-confidence coordinates.",
                              group="genie")
    genie_mask: bool = param(True, "GENIE: inverted-dropout mask on the update.", group="genie")

    def sgd(self, params: Iterable[torch.Tensor]) -> torch.optim.SGD:
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum,
                               weight_decay=self.weight_decay)

    def genie_options(self) -> dict:
        """GENIE's keyword arguments from the ``genie-*`` keys (ALGORITHMS.md 2.5)."""
        return dict(lr=self.genie_lr, moving_avg=self.genie_moving_avg, p=self.genie_p,
                    weight_decay=self.weight_decay, precondition=self.genie_precondition,
                    noise=self.genie_noise, mask=self.genie_mask)

    def optimizer(self, params: Iterable[torch.Tensor],
                  generator: torch.Generator | None = None) -> torch.optim.Optimizer:
        """The ``local-optimizer``: ``sgd`` (``lr``, ``momentum``, ``weight-decay``), ``adam``
        (``adam-lr``, ``weight-decay``) or ``genie`` (``genie-*``, ``weight-decay``; its mask and
        noise drawn from ``generator``). A new one each round: its state does not outlive the
        round."""
        if self.local_optimizer == "sgd":
            return self.sgd(params)
        if self.local_optimizer == "adam":
            return torch.optim.Adam(params, lr=self.adam_lr, weight_decay=self.weight_decay)
        if self.local_optimizer == "genie":
            return GENIE(params, **self.genie_options(), generator=generator)
        raise ValueError(f"Unknown local-optimizer {self.local_optimizer!r}; choose sgd, adam "
                         "or genie.")


@dataclass(frozen=True)
class TrainStats:
    """Mean training loss over the samples seen, and how many steps and samples that was."""

    loss: float
    steps: int
    samples: int


@dataclass(frozen=True)
class EvalStats:
    correct: int
    loss_sum: float
    count: int


def batch_indices(num_samples: int, batch_size: int, epochs: int, max_steps: int,
                  generator: torch.Generator, device: torch.device | str = "cpu",
                  ) -> Iterator[torch.Tensor]:
    """Index batches of shuffled epochs: exactly :func:`num_local_steps` of them (the last batch
    of an epoch may be smaller). Shuffling uses ``generator`` only, so the same generator seed
    gives the same batches."""
    total = num_local_steps(num_samples, batch_size, epochs, max_steps)
    steps = 0
    while steps < total:
        order = torch.randperm(num_samples, generator=generator).to(device)
        for start in range(0, num_samples, batch_size):
            if steps == total:
                return
            yield order[start:start + batch_size]
            steps += 1


def train_local(model: nn.Module, x: torch.Tensor, y: torch.Tensor, normalize: Normalizer, *,
                optimizer: torch.optim.Optimizer, batch_size: int, epochs: int = 1,
                max_steps: int = 0, generator: torch.Generator,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
                before_step: Callable[[], None] | None = None) -> TrainStats:
    """Mini-batch training over :func:`batch_indices`.

    ``before_step`` runs between ``backward()`` and ``optimizer.step()``: the place where a
    method adds its gradient correction (FedProx's proximal term, SCAFFOLD's control variates).
    """
    model.train()
    loss_sum = torch.zeros((), device=x.device)
    seen = 0
    steps = 0
    for idx in batch_indices(len(y), batch_size, epochs, max_steps, generator, x.device):
        inputs, targets = normalize(x[idx]), y[idx]
        loss = loss_fn(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if before_step is not None:
            before_step()
        optimizer.step()
        loss_sum += loss.detach() * len(idx)
        seen += len(idx)
        steps += 1
    return TrainStats(loss=float(loss_sum) / max(seen, 1), steps=steps, samples=seen)


@torch.inference_mode()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, normalize: Normalizer,
             batch_size: int = 256) -> EvalStats:
    """Accuracy counts and summed cross-entropy of ``model`` on (x, y), in eval mode."""
    model.eval()
    correct = 0
    loss_sum = 0.0
    for start in range(0, len(y), batch_size):
        logits = model(normalize(x[start:start + batch_size]))
        targets = y[start:start + batch_size]
        correct += int((logits.argmax(dim=1) == targets).sum())
        loss_sum += float(F.cross_entropy(logits, targets, reduction="sum"))
    return EvalStats(correct=correct, loss_sum=loss_sum, count=len(y))
