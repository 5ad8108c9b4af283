"""Per-step gradient corrections: gradient transformations in the style of Optax.

A correction's tensors are per client, one per trained entry, and its rule is element-wise, so
one ``apply_`` serves a client's tensors (the per-client executor, on ``.grad``) and a stacked
cohort's (the vectorised executor). The shared one is :class:`Proximal`; a method's own lives in
its file (SCAFFOLD's control variates, FedDyn's regularizer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Self

import torch

#: tensors by trained entry name
Entries = Mapping[str, torch.Tensor]


class PerClient:
    """A frozen dataclass whose :data:`Entries` fields hold per-client tensors (one per name) and
    whose other fields are hyperparameters, the same for every client of a cohort: a correction,
    or a run's objective (:mod:`pflalign.training.objectives`). The vectorised executor stacks the
    tensor fields of a cohort's along a leading client dimension."""

    def tensors(self) -> dict[str, Entries]:
        """The per-client tensor fields."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)  # type: ignore
                if isinstance(getattr(self, f.name), Mapping)}

    def replaced(self, tensors: Mapping[str, Entries]) -> Self:
        """The same object with its tensor fields replaced (stacked, moved, or selected)."""
        return dataclasses.replace(self, **tensors)  # type: ignore[type-var]

    def to(self, device: torch.device) -> Self:
        return self.replaced({field: {n: t.to(device) for n, t in entries.items()}
                              for field, entries in self.tensors().items()})

    def scalars(self) -> tuple:
        """The hyperparameter fields, and the names of the tensor fields' entries: what a cohort
        must share (a module field, the structure a loss calls, counts by its type)."""
        tensors = self.tensors()
        return tuple((f.name, tuple(tensors[f.name]) if f.name in tensors else
                      type(v) if isinstance(v := getattr(self, f.name), torch.nn.Module) else v)
                     for f in dataclasses.fields(self))  # type: ignore[arg-type]


class Correction(PerClient):
    """A per-step gradient transformation: ``apply_(grads, params, names)`` changes the
    gradients in place after ``backward`` and before the optimizer steps.

    A correction is a frozen dataclass. Its :data:`Entries` fields hold one tensor per trained
    entry (keyed by the entry's name): they are per client, and the vectorised executor stacks
    them along a leading client dimension. Its other fields are hyperparameters, the same for
    every client of a cohort. ``apply_`` must be element-wise over the tensors, so that it gives a
    client's rows of a stacked cohort the values it gives the client's own tensors."""

    def apply_(self, grads: list[torch.Tensor], params: list[torch.Tensor],
               names: Sequence[str]) -> None:
        raise NotImplementedError

    def end_batch_(self, params: list[torch.Tensor], names: Sequence[str]) -> None:
        """Change the correction's own tensors in place after each batch's steps (pFedMe's
        local model moves toward the personalized one); none by default. A correction that
        does so gives its tensors as they ended in :attr:`~pflalign.training.runs.RunResult.
        correction`."""

    @property
    def moves(self) -> bool:
        """Whether :meth:`end_batch_` changes the correction's tensors (then an executor works on
        copies of them)."""
        return type(self).end_batch_ is not Correction.end_batch_


@dataclass(frozen=True)
class Proximal(Correction):
    """``g += mu (w - w_anchor)``: the gradient of ``mu/2 ||w - w_anchor||^2``. FedProx (Li et al.,
    MLSys 2020, eq. 2) with the received global model as anchor; Ditto's personal objective (Li et
    al., ICML 2021, Algorithm 1) with ``mu = lambda``."""

    anchor: Entries
    mu: float

    def apply_(self, grads: list[torch.Tensor], params: list[torch.Tensor],
               names: Sequence[str]) -> None:
        anchor = [self.anchor[n] for n in names]
        torch._foreach_add_(grads, torch._foreach_sub(params, anchor), alpha=self.mu)
