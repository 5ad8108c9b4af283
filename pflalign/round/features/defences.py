"""Robust aggregation as a round feature: what the defences are relative to, and what they kept.

The rules themselves (``aggregation``: trimmed mean and median, :mod:`pflalign.server.aggregation`;
Krum, Multi-Krum, Bulyan, centered clipping, :mod:`pflalign.server.robust`) replace
the method's average in :meth:`~pflalign.server.runtime.ServerRuntime.average`, so they apply to
whatever a method averages, part by part: the exchanged model (FedRep's and FedPer's shared body,
never a personal head), and each further record it averages (FedCP's policy network, GPFL's
embeddings). This feature gives the runtime, before each aggregation, what the updates are taken
from (the global model and the server state's other parts: centered clipping's centre), and
records in the round's row what the rule kept of the uploads (``defence-kept``, of the model
part; ``defence-clipped`` under centered clipping) and the seconds it took
(``defence-seconds``), so that a defence's cost per round is measured, not guessed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence

import numpy as np

from pflalign.data.federated import federated_dataset, root_set
from pflalign.data.node import NodeData
from pflalign.engines.host import handle_aside, to_torch
from pflalign.methods.base import Method
from pflalign.round.feature import RoundFeature, register
from pflalign.settings.options import ConfigError
from pflalign.settings.schema import Settings
from pflalign.wire.messages import Update
from pflalign.wire.protocol import MODEL, TRAIN
from pflalign.wire.state import ServerState


def state_parts(state: ServerState) -> list[Mapping[str, np.ndarray]]:
    """The global model and every other array dict the server state holds (the references an
    aggregated part is found in by its keys)."""
    parts: list[Mapping[str, np.ndarray]] = [state.model]
    if dataclasses.is_dataclass(state):
        for field in dataclasses.fields(state):
            value = getattr(state, field.name)
            if (field.name != "model" and isinstance(value, Mapping) and value
                    and all(isinstance(v, np.ndarray) for v in value.values())):
                parts.append(value)
    return parts


@register
class RobustAggregation(RoundFeature):
    """Every ``aggregation`` but ``mean``: the references of the round's aggregation (and under
    ``fltrust`` the server's own update on its root set), and the row's ``defence-kept`` and
    ``defence-seconds``."""

    name = "robust-aggregation"

    @classmethod
    def wanted(cls, settings: Settings, method: Method) -> bool:
        return settings.run.aggregation != "mean" and method.uploads_model

    def __init__(self, loop):
        self.root: NodeData | None = None
        self.root_seconds = 0.0

    def start(self, loop) -> None:
        settings = loop.server.settings
        if settings.run.aggregation != "fltrust":
            return
        try:
            data = root_set(settings, settings.run.fltrust_root_size)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        template = federated_dataset(settings)
        self.root = NodeData(client_id=root_id(loop.server), data=data,
                             num_classes=template.dataset.num_classes,
                             input_shape=template.dataset.input_shape, unseen=False,
                             num_clients=template.partition.num_clients)
        loop.reporter.info(f"[{loop.label}] fltrust: the server trains on a root set of "
                           f"{data.num_train} samples no client holds.")

    def release(self, loop, server_round: int, updates: Sequence[Update],
                row: dict) -> Sequence[Update]:
        root: list[Mapping[str, np.ndarray]] = []
        if self.root is not None:
            start = time.perf_counter()
            root = self.root_reply(loop, server_round)
            self.root_seconds = time.perf_counter() - start
        loop.server.set_references(state_parts(loop.state), root)
        return updates

    def root_reply(self, loop, server_round: int) -> list[Mapping[str, np.ndarray]]:
        """The arrays the method's local update uploads from the root set, trained here from
        the global model as a client with no state would (FLTrust's server update; Cao et al.
        2021, Algorithm 1), seeded like a client by (seed, round, its id)."""
        server, method = loop.server, loop.method
        payload = method.train_payload(server, loop.state, self.root.client_id, server_round)
        message = loop.messaging.message(self.root.client_id, payload, server_round)
        arrays = to_torch({name: {k: np.ascontiguousarray(v) for k, v in record.items()}
                           for name, record in payload.arrays.items()})
        _, reply, _ = handle_aside(TRAIN, server.settings, self.root.client_id, message.config,
                                   arrays, None, node=self.root)
        return [{k: v.detach().cpu().numpy() for k, v in record.items()}
                for name, record in sorted(reply.items(), key=lambda kv: kv[0] != MODEL)]

    def trained(self, loop, server_round: int, row: dict) -> None:
        kept, seconds = loop.server.take_defence_log()
        row["defence-seconds"] = float(seconds + self.root_seconds)
        self.root_seconds = 0.0
        if kept:  # the first part a method aggregates is its model
            row["defence-kept"] = len(kept[0].indices)
            if kept[0].clipped:
                row["defence-clipped"] = kept[0].clipped
            if kept[0].weights:  # fltrust: the mean trust score of the round's uploads
                row["fltrust-trust"] = float(np.mean(kept[0].weights))


def root_id(server) -> int:
    """The id FLTrust's root set trains under: one past the run's clients (its seeds are its
    own)."""
    return max(server.clients, default=-1) + 1
