"""The wire names both halves use: record names, actions, reply metrics, per-client config.

Every engine moves the same things between a method's server rule and its client rule; this
module names them once. A client's reply is a dict of metrics (scalars) plus named array records;
the server validates it against these names (:mod:`pflalign.server.runtime`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from pflalign.process.memory import host_id, peak_rss_mb

# --- records of a message ---------------------------------------------------------------------
MODEL = "arrays"  #: the model (or its shared part) sent to or uploaded by a client
CONFIG = "config"  #: per-message config: method, label, round, and a rule's own entries
RUN_CONFIG = "run-config"  #: the run's settings, so that a client needs nothing else
METRICS = "metrics"  #: a reply's metrics
#: a client's method state as a checkpoint holds it, sent to a client once after a resume: the
#: client uses (and keeps) it in place of the state it has
RESTORE = "restore-state"
#: a reply to :data:`STATE`: the client's saved method state for the message's method entry
CLIENT_STATE = "client-state"
#: an evaluation reply in the run's final round under ``save-models``: the model that scored the
#: client (its personal model), for the server to save (:mod:`pflalign.round.features.models`);
#: the run's output, not the method's traffic, so never counted in ``bytes-up``
SCORED = "scored-model"

# --- the per-message config --------------------------------------------------------------------
METHOD = "method"  #: the registered method's name
LABEL = "label"  #: the method entry's label (its state namespace)
ROUND = "server-round"
ACTION = "action"  #: a query's purpose beside discovery (``gga``)
#: an evaluation message: reply with the model that scored you (:data:`SCORED`); a training
#: message: keep what your next evaluation scores (pFLAlign's model right after training)
SAVE_SCORED = "save-scored"

# --- actions -----------------------------------------------------------------------------------
TRAIN, EVALUATE, QUERY = "train", "evaluate", "query"
#: ask a client for its saved method state (for a checkpoint); it changes nothing on the client
STATE = "state"
#: clients asked for their state in one exchange (by a checkpoint, by the evaluation audit), so
#: that no more than this many clients' states are in flight at once
STATE_CHUNK = 64

# --- reply metrics -----------------------------------------------------------------------------
PARTITION_ID = "partition-id"  #: the client's stable id (never Flower's random node id)
NUM_EXAMPLES = "num-examples"  #: training samples: the aggregation weight
NUM_TRAIN, NUM_TEST, UNSEEN = "num-train", "num-test", "unseen"  #: discovery
TRAIN_LOSS, LOCAL_STEPS = "train-loss", "local-steps"
CLIENT_SECONDS = "client-seconds"
#: a training or evaluation reply: the process that computed it (an integer id of its host, the
#: CRC-32 of the host name; its pid) and that process's peak resident memory so far, in MiB. A
#: diagnostic: the round loop keeps each process's largest for results.json's ``processes``,
#: and no row averages it; the audit does not compare it (its recomputation runs elsewhere)
PROCESS_HOST, PROCESS_ID, PROCESS_PEAK_RSS_MB = "process-host", "process-id", "process-peak-rss-mb"
PROCESS_METRICS = (PROCESS_HOST, PROCESS_ID, PROCESS_PEAK_RSS_MB)
HAD_STATE = "had-state"  #: a training reply: 1 if the client had saved state for the method entry
KEPT_STATE = "kept-state"  #: a training reply: 1 if the client saved state for the next round
PERSONAL_CORRECT, PERSONAL_LOSS = "personal-correct", "personal-loss"
GLOBAL_CORRECT = "global-correct"  #: the global model's correct count (methods that have one)
GLOBAL_LOSS = "global-loss"  #: the global model's mean loss (methods that have one)
NEXT_CORRECT = "next-correct"  #: pFLAlign's next starting point theta_g + Delta_i
#: an evaluation reply under save-models from a deployed SuperNode: 1 when the node saved its
#: model in its own directory rather than sending it (:data:`SCORED`)
SAVED_ON_NODE = "model-saved-on-node"
#: correct counts a reply may carry, each at most its num-test
CORRECT_COUNTS = (PERSONAL_CORRECT, GLOBAL_CORRECT, NEXT_CORRECT)
#: the mean losses an evaluation reply may carry
LOSSES = (PERSONAL_LOSS, GLOBAL_LOSS)


# --- what a reply's metrics may hold ----------------------------------------------------------
#: the largest value a reply metric without a tighter bound may take (1e300 is not a number of
#: seconds, steps or a diagnostic that any honest client reports, and it would swamp a mean)
LARGEST = 1e6
#: a reply's arrays, and a client's saved state, may hold at most this many times the model's
#: bytes, plus ARRAYS_SLACK bytes for scalars (an honest upload is the model and a record or two
#: of its size; the largest honest state, pFLAlign's with GENIE, about three models)
ARRAYS_FACTOR, ARRAYS_SLACK = 8, 1 << 20
#: the bytes a serialized array may take beyond its data (Flower's Array holds a .npy file: a
#: header of 128 bytes, more for a long shape)
ARRAY_HEADER = 512
#: a loss may be at most this many times log(number of classes): the cross-entropy of a model
#: that guesses uniformly is log(classes); an honest reply 100 times above that is broken
LOSS_BOUND_FACTOR = 100.0


@dataclass(frozen=True)
class Metric:
    """What one reply metric may hold: a finite number in ``[low, high]``, an integer when
    ``integer``. ``loss``: a cross-entropy, at most :data:`LOSS_BOUND_FACTOR` x log(classes) of
    the task; ``count``: a correct count, at most the reply's ``num-test``; ``required``: every
    reply of the action carries it; ``diagnostic``: averaged over the round's clients into the
    round's row."""

    low: float = 0.0
    high: float = LARGEST
    integer: bool = False
    loss: bool = False
    count: bool = False
    required: bool = True
    diagnostic: bool = False


FLAG = Metric(0, 1, integer=True)
LOSS = Metric(loss=True)
COUNT = Metric(integer=True, count=True)
ID = Metric(integer=True, high=math.inf)
SAMPLES = Metric(1, math.inf, integer=True)

#: the optional process metrics of a training or an evaluation reply: a host id and a pid are
#: 32-bit integers; a peak of at most 1e8 MiB (about 100 TiB, more than any machine holds)
PROCESS: Mapping[str, Metric] = {
    PROCESS_HOST: Metric(high=2**32 - 1, integer=True, required=False),
    PROCESS_ID: Metric(high=2**32 - 1, integer=True, required=False),
    PROCESS_PEAK_RSS_MB: Metric(high=1e8, required=False)}

#: the metrics of every training reply
TRAIN_METRICS: Mapping[str, Metric] = {
    PARTITION_ID: ID, NUM_EXAMPLES: SAMPLES, TRAIN_LOSS: LOSS,
    LOCAL_STEPS: Metric(integer=True, high=1e9), CLIENT_SECONDS: Metric(high=1e7),
    HAD_STATE: FLAG, KEPT_STATE: FLAG, **PROCESS}
#: the metrics of every evaluation reply
EVAL_METRICS: Mapping[str, Metric] = {
    PARTITION_ID: ID, NUM_TEST: SAMPLES, PERSONAL_CORRECT: COUNT, PERSONAL_LOSS: LOSS,
    SAVED_ON_NODE: Metric(0, 1, integer=True, required=False), **PROCESS}
#: the scores beyond accuracy a run may ask for (``eval-metrics``,
#: :mod:`pflalign.training.scores`), each a fraction, reported as ``personal-<score>``
SCORES = ("macro-f1", "balanced-accuracy", "auroc")
BACKDOOR_HITS, BACKDOOR_TRIED = "backdoor-hits", "backdoor-tried"
EVAL_METRICS = {**EVAL_METRICS, **{f"personal-{name}": Metric(0, 1, required=False)
                                   for name in SCORES},
                # task = regression: the mean absolute error, and R^2 (at most 1; a model far
                # worse than the mean has a large negative one)
                "personal-mae": Metric(0, LARGEST, required=False),
                "personal-r2": Metric(-LARGEST, 1, required=False),
                # attack = backdoor: of the test samples not of the target class (backdoor-
                # tried), how many the personal model takes for the target with the trigger
                BACKDOOR_HITS: Metric(integer=True, count=True, required=False),
                BACKDOOR_TRIED: Metric(integer=True, count=True, required=False)}
#: ... and those of a method with a global model
GLOBAL_EVAL_METRICS: Mapping[str, Metric] = {GLOBAL_CORRECT: COUNT, GLOBAL_LOSS: LOSS}


def process_metrics() -> dict[str, int | float]:
    """The process metrics of a training or evaluation reply: this machine's
    :func:`~pflalign.process.memory.host_id`, this process's id and its
    :func:`~pflalign.process.memory.peak_rss_mb` so far."""
    return {PROCESS_HOST: host_id(), PROCESS_ID: os.getpid(), PROCESS_PEAK_RSS_MB: peak_rss_mb()}
