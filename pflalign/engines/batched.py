"""The batched engine: a round's sampled clients trained together, in this process.

``engine = batched`` delivers the same messages as the sequential engine
(:mod:`pflalign.engines.sequential`), counts the same bytes and keeps each client's state the same
way, but hands a method's clients to its batched rules (:meth:`~pflalign.method.Method.
train_cohort`, :meth:`~pflalign.method.Method.evaluate_cohort`) in cohorts of ``cohort-size``:
their models stacked, their data gathered from the pooled array on the device, their training in
lockstep (:mod:`pflalign.cohort`). ``batched-backend`` chooses how a step's gradients are computed
(``loop``: per client, the sequential engine's metrics bit for bit; ``vmap``: one call for the
cohort; ``auto``: vmap on a GPU, loop on the CPU). The device is the GPU when
``client-resources-num-gpus`` > 0 and one is visible.

A method without batched rules, or a run the cohort cannot serve (rotated images, fault
injection, batch norm), runs one client at a time, as on the sequential engine, and the run says
so once. A batched rule that raises fails its cohort's clients, each with an error reply naming
the exception, which the round loop skips with a warning (as under Flower). Needs neither Ray nor
flwr.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from pflalign import cohort as cohorts
from pflalign.client import Received
from pflalign.config import Settings
from pflalign.engines import check_resources, run_methods
from pflalign.engines.host import counted, method_of, state_to_keep, train_reply
from pflalign.engines.sequential import (
    SequentialEngine,
    failure_reply,
    numpy_records,
    payload_bytes,
    sent_bytes,
    sent_records,
)
from pflalign.federation import federated_dataset
from pflalign.protocol import (
    EVALUATE,
    METHOD,
    PARTITION_ID,
    RESTORE,
    ROUND,
    TRAIN,
)
from pflalign.results import Reporter
from pflalign.server import Exchange, Outgoing, Reply
from pflalign.train import configure_threads, pick_device


class BatchedEngine(SequentialEngine):
    """Cohorts of clients trained and evaluated together; other methods one client at a time."""

    def __init__(self, settings: Settings, reporter: Reporter | None = None):
        super().__init__(settings)
        self.reporter = reporter or Reporter()
        run = settings.run
        self.device = pick_device(run.client_resources_num_gpus)
        self.backend = cohorts.resolve_backend(run.batched_backend, self.device)
        self.cohort_size = run.cohort_size
        self._said: set[str] = set()
        self._unsupported = cohorts.unsupported(settings)  # the run's: the same every round

    def _fallback_reason(self, method_name: str) -> str | None:
        return self._unsupported or method_of(self.settings, method_name).cohort_unsupported()

    def exchange(self, action: str, messages: Sequence[Outgoing]) -> Exchange:
        if action not in (TRAIN, EVALUATE) or not messages:
            return super().exchange(action, messages)
        name = str(messages[0].config[METHOD])
        reason = self._fallback_reason(name)
        if reason is not None:
            if name not in self._said:
                self._said.add(name)
                self.reporter.info(f"[{name}] engine = batched: its clients run one at a time "
                                   f"(sequentially), because {reason}.")
            return super().exchange(action, messages)
        configure_threads(self.settings.run.client_resources_num_cpus)
        method = method_of(self.settings, name)
        converted: dict[tuple[int, ...], tuple[list, dict[str, torch.Tensor]]] = {}
        replies: list[Reply] = []
        down = up = 0
        for start in range(0, len(messages), self.cohort_size):
            chunk = messages[start:start + self.cohort_size]
            received = []
            for message in chunk:
                sent = sent_records(message.payload.arrays)
                down += sent_bytes(sent)
                if RESTORE in sent:  # a resumed client's state: it replaces the saved one
                    self.states[message.client] = sent[RESTORE]
                received.append(Received(int(message.config[ROUND]), {
                    record_name: self._torch(record, converted)
                    for record_name, record in sent.items()
                    if record_name != RESTORE and len(record)}, dict(message.config)))
            cohort_replies, cohort_up = self._run_cohort(action, method, chunk, received)
            replies.extend(cohort_replies)
            up += cohort_up
        return Exchange(replies, down, up)

    def _torch(self, record: Mapping[str, np.ndarray],
               converted: dict[tuple[int, ...], tuple[list, dict[str, torch.Tensor]]],
               ) -> dict[str, torch.Tensor]:
        """A received record as torch tensors on the device: one copy per distinct record in an
        exchange (the global model sent to a thousand clients is converted once). The arrays
        are kept with their copy, so that no id in a key is reused while the exchange runs."""
        key = tuple(id(v) for v in record.values())
        if key not in converted:
            converted[key] = (list(record.values()), {
                k: torch.from_numpy(np.array(v, copy=True)).to(self.device)
                for k, v in record.items()})
        return converted[key][1]

    def _run_cohort(self, action: str, method, chunk: Sequence[Outgoing],
                    received: list[Received]) -> tuple[list[Reply], int]:
        clients = [m.client for m in chunk]
        saved = [self.states.get(c) for c in clients]
        states = [method.ClientState.from_arrays(s or {}) for s in saved]
        started = time.perf_counter()
        try:
            cohort = cohorts.Cohort(self.settings, clients, self.device, self.backend)
            if action == EVALUATE:
                results = method.evaluate_cohort(cohort, received, states)
            else:
                results = method.train_cohort(cohort, received, states)
        except Exception as err:  # the cohort's clients fail, as failing clients do under Flower
            return [failure_reply(c, err) for c in clients], 0
        seconds = (time.perf_counter() - started) / len(clients)
        if action == EVALUATE:
            return [Reply(c, f"client {c}", metrics={PARTITION_ID: c, **metrics})
                    for c, metrics in zip(clients, results, strict=True)], 0
        replies, up = [], 0
        for i, (c, (upload, new_state)) in enumerate(zip(clients, results, strict=True)):
            kept = state_to_keep(new_state, None)
            if kept is not None:
                self.states[c] = kept
            metrics, reply = train_reply(c, counted(upload, cohort.num_train(i)), saved[i], kept,
                                         seconds)
            arrays = numpy_records(reply)
            up += payload_bytes(arrays.values())
            replies.append(Reply(c, f"client {c}", metrics=metrics, arrays=arrays))
        return replies, up

def simulate(settings: Settings, reporter: Reporter | None = None, resume: bool = False) -> dict:
    """Validate the data and resources, run every method of ``settings`` on the batched engine,
    and return the results (``resume``: as :func:`~pflalign.engines.run_methods`)."""
    federated_dataset(settings)  # data and partition errors surface here, before any training
    check_resources(settings)
    return run_methods(settings, lambda s: BatchedEngine(s, reporter), reporter, resume=resume)
