"""An evaluation round: its messages, the replies' checks, and the metrics they give.

Seen clients give ``personal-acc`` (every test sample pooled), its spread and worst decile
(:func:`~pflalign.server.metrics.accuracy_summary`), the personal loss (sample-weighted and
median), ``global-acc`` for a method with a global model, perplexities for a next-token model,
``personal-acc-next`` where clients report it, and the scores ``eval-metrics`` asks for
(``personal-macro-f1``, ...: each client's, averaged by test samples); unseen clients give
``unseen-acc``. Each
evaluated client's own accuracy goes to the run's per-client results.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pflalign.methods.base import Method
from pflalign.models.language import is_language_model
from pflalign.server.metrics import accuracy_summary, ratio_interval
from pflalign.server.runtime import ServerRuntime
from pflalign.server.validation import Collected
from pflalign.wire.messages import Exchange, Outgoing
from pflalign.wire.protocol import (
    BACKDOOR_HITS,
    BACKDOOR_TRIED,
    EVALUATE,
    GLOBAL_CORRECT,
    GLOBAL_LOSS,
    NEXT_CORRECT,
    NUM_TEST,
    PARTITION_ID,
    PERSONAL_CORRECT,
    PERSONAL_LOSS,
    SCORED,
    SCORES,
)

#: attack = backdoor: the share of the triggered test samples taken for the target class
BACKDOOR_ASR = "personal-backdoor-asr"


def evaluation_metrics(server: ServerRuntime, method: Method,
                       rows: Sequence[Mapping[str, float]],
                       population: tuple[int, int] | None = None) -> tuple[dict, list[dict]]:
    """The round's metrics from the accepted evaluation replies ``rows``, and the per-client
    results. ``population``: the round scored a sample of the method's clients, of which there
    are (seen, unseen): the pooled metrics then carry their confidence intervals
    (:func:`sample_intervals`)."""
    metrics: dict = {}
    info = {int(m[PARTITION_ID]): server.clients[int(m[PARTITION_ID])] for m in rows}
    seen = [m for m in rows if not info[int(m[PARTITION_ID])].unseen]
    unseen = [m for m in rows if info[int(m[PARTITION_ID])].unseen]
    if population is not None:
        metrics.update(sample_intervals(server.settings.run.task, seen, unseen, population))
    if server.settings.run.task == "regression":
        metrics_r, clients = regression_metrics(method, rows, seen, unseen, info)
        return {**metrics_r, **metrics}, clients
    if seen:
        metrics.update(accuracy_summary([m[PERSONAL_CORRECT] for m in seen],
                                        [m[NUM_TEST] for m in seen]))
        metrics[PERSONAL_LOSS] = float(np.average(
            [m[PERSONAL_LOSS] for m in seen], weights=[m[NUM_TEST] for m in seen]))
        metrics[f"{PERSONAL_LOSS}-median"] = float(np.median([m[PERSONAL_LOSS] for m in seen]))
        tested = sum(m[NUM_TEST] for m in seen)
        # a next-token model (a language model, or LEAF's character LSTM): the perplexity of
        # every seen client's test tokens together
        language = (is_language_model(server.settings.run.model)
                    or server.settings.run.model == "char-lstm")
        if language:
            metrics["personal-ppl"] = float(np.exp(metrics[PERSONAL_LOSS]))
        if method.has_global_model and all(GLOBAL_CORRECT in m for m in seen):
            metrics["global-acc"] = sum(m[GLOBAL_CORRECT] for m in seen) / tested
            if language and all(GLOBAL_LOSS in m for m in seen):
                metrics["global-ppl"] = float(np.exp(np.average(
                    [m[GLOBAL_LOSS] for m in seen], weights=[m[NUM_TEST] for m in seen])))
        if all(NEXT_CORRECT in m for m in seen):
            metrics["personal-acc-next"] = sum(m[NEXT_CORRECT] for m in seen) / tested
    if unseen:
        metrics["unseen-acc"] = (sum(m[PERSONAL_CORRECT] for m in unseen)
                                 / sum(m[NUM_TEST] for m in unseen))
    scores = [f"personal-{name}" for name in SCORES]
    for key in scores:  # eval-metrics: the seen clients that have it, by their test samples
        having = [m for m in seen if key in m]
        if having:
            metrics[key] = float(np.average([m[key] for m in having],
                                            weights=[m[NUM_TEST] for m in having]))
    tried = [m for m in seen if BACKDOOR_TRIED in m]
    if tried:  # attack = backdoor: the trigger's success, every triggered test sample pooled
        total = sum(m[BACKDOOR_TRIED] for m in tried)
        metrics[BACKDOOR_ASR] = sum(m[BACKDOOR_HITS] for m in tried) / total if total else 0.0
    clients = [{"id": cid, "unseen": info[cid].unseen, "num-train": info[cid].num_train,
                "num-test": int(m[NUM_TEST]), "personal-acc": m[PERSONAL_CORRECT] / m[NUM_TEST],
                **{key: m[key] for key in scores if key in m},
                **({BACKDOOR_ASR: m[BACKDOOR_HITS] / m[BACKDOOR_TRIED]}
                   if m.get(BACKDOOR_TRIED) else {})}
               for m in rows for cid in [int(m[PARTITION_ID])]]
    return metrics, clients


def sample_intervals(task: str, seen: Sequence[Mapping[str, float]],
                     unseen: Sequence[Mapping[str, float]],
                     population: tuple[int, int]) -> dict[str, float | int]:
    """An evaluation of a sample (``eval-clients``, ``eval-fraction``): for the whole population
    of (seen, unseen) clients, the 95% interval of personal-acc and unseen-acc (a regression's
    personal-mse and unseen-mse), each pooling every client's test samples
    (:func:`~pflalign.server.metrics.ratio_interval`), and ``eval-population``, the clients
    the sample stands for."""
    out: dict[str, float | int] = {"eval-population": int(sum(population))}
    regression = task == "regression"
    for prefix, group, size in (("personal", seen, population[0]),
                                ("unseen", unseen, population[1])):
        if len(group) < 2:
            continue
        counts = [m[NUM_TEST] for m in group]
        if regression:
            low, high = ratio_interval([m[PERSONAL_LOSS] * m[NUM_TEST] for m in group], counts,
                                       size, bounds=(0.0, math.inf))
            key = f"{prefix}-mse"
        else:
            low, high = ratio_interval([m[PERSONAL_CORRECT] for m in group], counts, size)
            key = f"{prefix}-acc"
        out[f"{key}-ci-low"], out[f"{key}-ci-high"] = low, high
    return out


def _weighted(rows: Sequence[Mapping[str, float]], key: str) -> float | None:
    """The test-sample-weighted mean of ``key`` over the ``rows`` that have it (None: none)."""
    having = [m for m in rows if key in m]
    if not having:
        return None
    return float(np.average([m[key] for m in having], weights=[m[NUM_TEST] for m in having]))


def regression_metrics(method: Method, rows: Sequence[Mapping[str, float]],
                       seen: Sequence[Mapping[str, float]], unseen: Sequence[Mapping[str, float]],
                       info: Mapping) -> tuple[dict, list[dict]]:
    """``task = regression``: the seen clients' mean squared error (every test sample pooled:
    their mean losses weighted by test samples), mean absolute error and R^2 (each client's,
    weighted by test samples; R^2 of the clients that have it), the global model's MSE, and the
    unseen clients' MSE; per client its own."""
    metrics: dict = {}
    for prefix, group in (("personal", seen), ("unseen", unseen)):
        if group:
            metrics[f"{prefix}-mse"] = _weighted(group, PERSONAL_LOSS)
    if seen:
        for key in ("personal-mae", "personal-r2"):
            value = _weighted(seen, key)
            if value is not None:
                metrics[key] = value
        metrics[f"{PERSONAL_LOSS}-median"] = float(np.median([m[PERSONAL_LOSS] for m in seen]))
        if method.has_global_model and all(GLOBAL_LOSS in m for m in seen):
            metrics["global-mse"] = _weighted(seen, GLOBAL_LOSS)
    clients = [{"id": cid, "unseen": info[cid].unseen, "num-train": info[cid].num_train,
                "num-test": int(m[NUM_TEST]), "personal-mse": float(m[PERSONAL_LOSS]),
                **{key: m[key] for key in ("personal-mae", "personal-r2") if key in m}}
               for m in rows for cid in [int(m[PARTITION_ID])]]
    return metrics, clients


@dataclass
class Evaluation:
    """An evaluation round's messages: the clients it wants, those it leaves out (training in
    flight), and, once it came back, the exchange."""

    number: int
    wanted: list[int]
    busy: set[int]
    messages: list[Outgoing]
    exchange: Exchange | None = None


def evaluation_round(loop, server_round: int) -> Evaluation:
    """An evaluation round's messages: every client the method evaluates (a sample of them
    under ``eval-fraction``) but those training in flight (real-time FedBuff)."""
    server, method = loop.server, loop.method
    wanted = server.largest_first(server.eval_sample(method.eval_clients(server),
                                                     server_round))
    busy = loop.scheduler.busy() & set(wanted)
    messages = [loop.messaging.message(cid, method.eval_payload(server, loop.state, cid,
                                                              server_round), server_round)
                for cid in wanted if cid not in busy]
    for feature in loop.features:
        messages = feature.evaluating(loop, messages, server_round)
    return Evaluation(server_round, wanted, busy, messages)


def evaluate(loop, evaluation: Evaluation) -> tuple[dict, int, int, Collected]:
    """The metrics of ``evaluation`` (exchanged now unless it already was), its bytes down and
    up, and its validated replies before the features' checks."""
    server, method, server_round = loop.server, loop.method, evaluation.number
    messaging = loop.messaging
    exchange = evaluation.exchange or messaging.exchange(EVALUATE, evaluation.messages)
    collected = messaging.validator.collect(exchange.replies, {}, method.reply_metrics(EVALUATE),
                                            records=(SCORED,))
    extra: dict = {}
    checked = collected
    for feature in loop.features:
        checked = feature.evaluated(loop, server_round, evaluation.messages, checked, extra)
    rows = [m for m, _ in checked.good]
    loop.accepted(rows)
    metrics: dict = {"eval-failures": collected.failed + checked.rejected,
                     "eval-rejected": checked.rejected, "evaluated": len(rows),
                     "eval-clients": len(evaluation.wanted), **extra}
    if evaluation.busy:
        metrics["eval-busy"] = len(evaluation.busy)
    population = None
    if server.eval_sampled(server_round):  # the sample stands for all the method's clients
        everyone = method.eval_clients(server)
        unseen = sum(1 for cid in everyone if server.clients[cid].unseen)
        population = (len(everyone) - unseen, unseen)
    summary, loop.client_results = evaluation_metrics(server, method, rows, population)
    metrics.update(summary)
    return metrics, exchange.bytes_down, exchange.bytes_up, collected


def evaluate_round(loop, server_round: int, evaluation: Evaluation | None = None,
                   ) -> tuple[dict, int, int]:
    """One evaluation round of ``loop`` (``evaluation``: its messages, already exchanged): its
    metrics, and the bytes sent down and up. When most clients report a non-finite loss right
    after an aggregation, that aggregation is rolled back and the round evaluated again."""
    metrics, down, up, collected = evaluate(loop, evaluation
                                            or evaluation_round(loop, server_round))
    answered = metrics["eval-clients"] - metrics.get("eval-busy", 0) - collected.failed
    if loop.rollback_due(collected.nonfinite_loss, answered):
        loop.warn(f"round {server_round}: {collected.nonfinite_loss} of {answered} clients "
                  "report a non-finite loss for the new model; the round's aggregation is "
                  "rolled back and the previous model evaluated.")
        loop.roll_back()
        metrics, again_down, again_up, _ = evaluate(loop, evaluation_round(loop, server_round))
        metrics["rolled-back"] = 1
        down, up = down + again_down, up + again_up
    return metrics, down, up


def evaluate_at_start(loop) -> dict[str, float]:
    """Round 0 (``eval-at-start``): the initial model evaluated before any training, its row
    added to ``loop``'s rows and reported; returns its metrics."""
    started = time.perf_counter()
    metrics, down, up = evaluate_round(loop, 0)
    loop.rounds.append({"round": 0, **metrics, "eval-seconds": time.perf_counter() - started,
                        "round-seconds": time.perf_counter() - started,
                        "bytes-up": up, "bytes-down": down})
    loop.reporter.round(loop.label, loop.rounds[-1], loop.server.rounds)
    return metrics
