"""The batched engine: the sequential engine, whose ``vmap`` backend trains a cohort together.

``engine = batched`` delivers the same messages as the sequential engine
(:mod:`pflalign.engines.sequential`), counts the same bytes and keeps each client's state the
same way (in memory up to ``memory-budget-gb``, spilled beyond it). It runs every method's one
client rule; ``batched-backend`` chooses how the rule's local runs are executed:

- ``loop``: client by client, each rule to its end, exactly as the sequential engine does (the
  sequential engine's metrics bit for bit; on the CPU, where training is compute-bound, nothing
  is faster);
- ``vmap``: the clients of a cohort (``cohort-size`` of them) step through their rules
  together. Each time they yield a local run, the runs that can go together are executed
  stacked, in lockstep, with one vectorised gradient call per step for the whole cohort
  (:mod:`pflalign.training.vectorised`; equal to ``loop`` within float32 rounding);
- ``auto``: vmap on a GPU, loop on the CPU.

On either backend a record sent to many clients (the global model) is converted to torch once
per exchange and shared by them. The device is the GPU when ``client-resources-num-gpus`` > 0
and one is visible. Every registered method's training yields its local runs; a plug-in method
whose training is a loop of its own (a rule that yields no runs), and a run that cannot be
stacked (a model with batch norm), runs client by client under vmap too, and the run says so
once. A rule or a stacked run that raises fails its clients, each with an error reply naming the
exception, which the round loop skips with a warning (as under Flower). Needs neither Ray nor
flwr.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from pflalign.engines.faults import ClientDropout, after_handler, before_handler
from pflalign.engines.host import Call, begin, finish, method_of, to_torch
from pflalign.engines.secagg_client import secure_reply
from pflalign.engines.sequential import SequentialEngine, failure_reply
from pflalign.outputs.results import Reporter
from pflalign.settings.schema import Settings
from pflalign.training.loops import pick_device
from pflalign.training.runs import LocalRun, RunResult, is_generator_rule
from pflalign.training.vectorised import cohort_key, execute_together, unstackable
from pflalign.wire.messages import Exchange, Outgoing, Reply
from pflalign.wire.protocol import EVALUATE, METHOD, RESTORE, TRAIN


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto``: ``vmap`` on a GPU, ``loop`` on the CPU (measured there: vmap's grouped
    convolutions run slower than one client at a time, the CPU being compute-bound)."""
    if backend == "auto":
        return "vmap" if device.type == "cuda" else "loop"
    return backend


class BatchedEngine(SequentialEngine):
    """The sequential engine, with cohorts of clients executed together under ``vmap``."""

    def __init__(self, settings: Settings, reporter: Reporter | None = None):
        super().__init__(settings)
        self.reporter = reporter or Reporter()
        run = settings.run
        self.backend = resolve_backend(run.batched_backend,
                                       pick_device(run.client_resources_num_gpus))
        self.cohort_size = run.cohort_size
        self._said: set[tuple[str, str]] = set()

    def received(self, sent: Mapping[str, Mapping[str, np.ndarray]], exchange: dict,
                 ) -> dict[str, dict[str, torch.Tensor]]:
        """What a client receives of ``sent``: one torch copy of each distinct record per
        exchange, shared by the clients it is sent to (the global model sent to a thousand
        clients is converted once; client rules never change what they received). The arrays
        are kept with their copy, so that no id in a key is reused while the exchange runs."""
        out = {}
        for name, record in sent.items():
            if not len(record):
                continue
            if name == RESTORE:  # a resumed client's own state
                out[name] = to_torch({name: record})[name]
                continue
            key = tuple(id(v) for v in record.values())
            if key not in exchange:
                exchange[key] = (list(record.values()), to_torch({name: record})[name])
            out[name] = exchange[key][1]
        return out

    def say_once(self, name: str, reason: str) -> None:
        if (name, reason) not in self._said:
            self._said.add((name, reason))
            self.reporter.info(f"[{name}] engine = batched: its clients run one at a time, "
                               f"because {reason}.")

    def exchange(self, action: str, messages: Sequence[Outgoing]) -> Exchange:
        if self.backend == "loop" or action not in (TRAIN, EVALUATE) or not messages:
            return super().exchange(action, messages)
        name = str(messages[0].config[METHOD])
        method = method_of(self.settings, name)
        rule = type(method).train if action == TRAIN else type(method).evaluate
        if not is_generator_rule(rule):  # no local runs (an evaluation that trains nothing)
            if action == TRAIN:
                self.say_once(name, "its local training is a loop of its own")
            return super().exchange(action, messages)
        replies: list[Reply] = []
        down = up = 0
        for start in range(0, len(messages), self.cohort_size):
            chunk_replies, chunk_down, chunk_up = self._cohort(
                action, name, messages[start:start + self.cohort_size])
            replies.extend(chunk_replies)
            down, up = down + chunk_down, up + chunk_up
        return Exchange(replies, down, up)

    def _cohort(self, action: str, name: str, messages: Sequence[Outgoing],
                ) -> tuple[list[Reply], int, int]:
        """One cohort's messages: each client's rule begun, the rules driven together, each
        client's reply finished, in message order."""
        down = up = 0
        calls: dict[int, Call] = {}
        replies: dict[int, Reply] = {}
        shared: dict = {}
        for message in messages:
            cid = message.client
            size, arrays = self.arrive(message, shared)
            down += size
            try:
                node = before_handler(action, self.settings, cid, message.config, None,
                                      self.states.get(cid))
                calls[cid] = begin(action, self.settings, cid, message.config, arrays,
                                   self.states.get(cid), node)
            except ClientDropout:
                replies[cid] = self.dropout_reply(cid)
            except Exception as err:
                replies[cid] = failure_reply(cid, err)
        results = self._drive(name, calls)
        for cid, call in calls.items():
            try:
                if isinstance(results[cid], Exception):
                    raise results[cid]
                metrics, reply, state = finish(call, results[cid])
                metrics, reply = after_handler(action, self.settings, cid, call.received.config,
                                               call.received.arrays, metrics, reply,
                                               self.states.get(cid), state)
                metrics, reply, state = secure_reply(action, self.settings, cid,
                                                     call.received.config, call.received.arrays,
                                                     metrics, reply, state, self.states.get(cid))
            except Exception as err:
                replies[cid] = failure_reply(cid, err)
                continue
            replies[cid], size = self.answer(cid, metrics, reply, state)
            up += size
        return [replies[m.client] for m in messages], down, up

    def _drive(self, name: str, calls: Mapping[int, Call]) -> dict[int, object]:
        """Every call's rule to its end, in lockstep: each tick, every rule still running is
        advanced to its next local run, and the runs are executed together where they can be.
        Returns each client's rule result, or the exception that failed it."""
        results: dict[int, object] = {}
        running = {}
        for cid, call in calls.items():
            try:
                rule = call.rule()
            except Exception as err:
                results[cid] = err
                continue
            running[cid] = rule
        sent: dict[int, RunResult | None] = dict.fromkeys(running)
        while running:
            runs: dict[int, LocalRun] = {}
            for cid, rule in list(running.items()):
                try:
                    runs[cid] = rule.send(sent[cid])
                except StopIteration as done:
                    results[cid] = done.value
                    del running[cid]
                except Exception as err:
                    results[cid] = err
                    del running[cid]
            for group in self._groups(name, calls, runs):
                clients = [calls[cid].client for cid in group]
                server_round = calls[group[0]].received.server_round
                try:
                    if len(group) == 1 or unstackable(clients[0], runs[group[0]]):
                        outcome = [c.execute(runs[cid], server_round)
                                   for c, cid in zip(clients, group, strict=True)]
                    else:
                        outcome = execute_together(clients, [runs[cid] for cid in group],
                                                   server_round)
                except Exception as err:  # the group's clients fail together
                    for cid in group:
                        results[cid] = err
                        running.pop(cid).close()
                    continue
                sent.update(zip(group, outcome, strict=True))
        return results

    def _groups(self, name: str, calls: Mapping[int, Call],
                runs: Mapping[int, LocalRun]) -> list[list[int]]:
        """The clients whose runs go together (one group per :func:`cohort_key`); a run that
        cannot be stacked is a group of its own, said once."""
        groups: dict[object, list[int]] = {}
        for cid, run in runs.items():
            reason = unstackable(calls[cid].client, run)
            if reason is not None:
                self.say_once(name, reason)
                groups[("alone", cid)] = [cid]
                continue
            groups.setdefault(cohort_key(calls[cid].client, run), []).append(cid)
        return list(groups.values())
