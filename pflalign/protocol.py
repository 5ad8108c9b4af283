"""The wire names both halves use: record names, actions, reply metrics, per-client config.

Every engine moves the same things between a method's server rule and its client rule; this
module names them once. A client's reply is a dict of metrics (scalars) plus named array records;
the server validates it against these names (:mod:`pflalign.server`).
"""

from __future__ import annotations

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

# --- the per-message config --------------------------------------------------------------------
METHOD = "method"  #: the registered method's name
LABEL = "label"  #: the method entry's label (its state namespace)
ROUND = "server-round"
ACTION = "action"  #: a query's purpose beside discovery (``gga``)

# --- actions -----------------------------------------------------------------------------------
TRAIN, EVALUATE, QUERY = "train", "evaluate", "query"
#: ask a client for its saved method state (for a checkpoint); it changes nothing on the client
STATE = "state"

# --- reply metrics -----------------------------------------------------------------------------
PARTITION_ID = "partition-id"  #: the client's stable id (never Flower's random node id)
NUM_EXAMPLES = "num-examples"  #: training samples: the aggregation weight
NUM_TRAIN, NUM_TEST, UNSEEN = "num-train", "num-test", "unseen"  #: discovery
TRAIN_LOSS, LOCAL_STEPS = "train-loss", "local-steps"
CLIENT_SECONDS = "client-seconds"
HAD_STATE = "had-state"  #: a training reply: 1 if the client had saved state for the method entry
KEPT_STATE = "kept-state"  #: a training reply: 1 if the client saved state for the next round
PERSONAL_CORRECT, PERSONAL_LOSS = "personal-correct", "personal-loss"
GLOBAL_CORRECT = "global-correct"  #: the global model's correct count (methods that have one)
GLOBAL_LOSS = "global-loss"  #: the global model's mean loss (methods that have one)
NEXT_CORRECT = "next-correct"  #: pFLAlign's next starting point theta_g + Delta_i
#: losses a reply may carry (a non-finite one may mean the model it was sent is broken)
LOSSES = (TRAIN_LOSS, PERSONAL_LOSS, GLOBAL_LOSS)
#: correct counts a reply may carry, each at most its num-test
CORRECT_COUNTS = (PERSONAL_CORRECT, GLOBAL_CORRECT, NEXT_CORRECT)
#: what every evaluation reply must carry
EVAL_REQUIRED = (NUM_TEST, PERSONAL_CORRECT, PERSONAL_LOSS)
