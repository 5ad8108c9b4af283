"""The federated annealed warm start (docs/algorithms.md 4.3 item 1) as a wrapper around any method.

In rounds ``gga-start..gga-end``, before training, the server sends the round's sampled clients the
global model and a seed; each regenerates ``gga-candidates`` perturbations ``eps_k ~ U(-gga-rho,
gga-rho)`` of the featurizer, and returns, for the anchor and every candidate, its loss on
``gga-batch-size`` of its samples and a count sketch of its gradient
(:func:`pflalign.training.gga_client.client_answer`, over
:func:`pflalign.training.gga.candidate_statistics`). The server scores each candidate by the
clients' gradient agreement and accepts the best one that beats the anchor within the loss tolerance
(:func:`pflalign.training.gga.choose_candidate`, GGA's rule 3.2 with clients as domains), moves the
global model there (:func:`pflalign.training.gga.apply_candidate`), and the round continues. One
message exchange per annealing round; its bytes and seconds are recorded in the round's row.

:class:`AnnealedWarmStart` is a round feature (:mod:`pflalign.round.feature`), on with ``gga =
true``: it wraps a round loop's rounds and never branches inside a method or the round loop.
Every candidate and batch is drawn from (seed, round) and the accepted moves are in the server
state, so a checkpoint keeps nothing of it.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from pflalign.methods.base import Method
from pflalign.models.registry import head_keys
from pflalign.round.feature import RoundFeature, Traffic, register
from pflalign.server.validation import ClientFailure
from pflalign.settings.schema import Settings
from pflalign.training.gga import apply_candidate, choose_candidate
from pflalign.training.gga_client import CANDIDATES, GGA_ACTION, PERTURB, SKETCH, losses_key
from pflalign.wire.messages import Payload
from pflalign.wire.protocol import (
    ACTION,
    ID,
    LOSS,
    MODEL,
    NUM_EXAMPLES,
    PARTITION_ID,
    QUERY,
    SAMPLES,
)


@register
class AnnealedWarmStart(RoundFeature):
    """The warm start as a round feature over any round loop (see the module docstring)."""

    name = "gga"

    @classmethod
    def wanted(cls, settings: Settings, method: Method) -> bool:
        return settings.gga.enabled

    def __init__(self, loop):
        server = loop.server
        params = server.settings.gga
        self.params = params
        head = set(head_keys(server.template_model()))
        #: the featurizer: trainable shared entries outside the classifier (3.2 step 4.1)
        self.perturb = [k for k in server.trainable if k in server.shared and k not in head]
        dims = server.trainable_spec.size
        wanted = params.sketch_dim
        self.sketch_shape = (params.candidates + 1, wanted if 0 < wanted < dims else dims)

    def active(self, server_round: int) -> bool:
        return self.params.start <= server_round <= self.params.end

    def before_training(self, loop, server_round: int) -> Traffic:
        if not self.active(server_round):
            return {}, 0, 0
        server, p = loop.server, self.params
        started = time.perf_counter()
        config = {ACTION: GGA_ACTION, CANDIDATES: p.candidates, PERTURB: ",".join(self.perturb)}
        model = server.shared_model(loop.state)
        messages = [loop.messaging.message(cid, Payload({MODEL: model}, config), server_round)
                    for cid in server.largest_first(server.sample(server_round))]
        exchange = loop.engine.exchange(QUERY, messages)
        schema = {PARTITION_ID: ID, NUM_EXAMPLES: SAMPLES,
                  **{losses_key(k): LOSS for k in range(p.candidates + 1)}}
        losses, sketches, weights = [], [], []
        # in client-id order, whatever order the engine delivered them in: the means below
        # are then the same bits on every engine and run
        for reply in sorted(exchange.replies, key=lambda r: (r.sender is None, r.sender or 0)):
            try:
                metrics, _ = loop.messaging.validator.validate(reply, {}, schema, (SKETCH,))
                record = reply.arrays.get(SKETCH)
                if record is None or SKETCH not in record:
                    raise ClientFailure(f"{reply.who} replied without its gradient sketches")
                if np.asarray(record[SKETCH]).dtype != np.float32:
                    raise ClientFailure(f"{reply.who} sent sketches of dtype "
                                        f"{np.asarray(record[SKETCH]).dtype}, expected float32")
                sketch = torch.from_numpy(np.array(record[SKETCH], copy=True))
                if tuple(sketch.shape) != self.sketch_shape or not torch.isfinite(sketch).all():
                    raise ClientFailure(f"{reply.who} sent sketches of shape "
                                        f"{tuple(sketch.shape)} (expected {self.sketch_shape}, "
                                        "finite)")
            except ClientFailure as failure:
                loop.warn(f"GGA round {server_round}: {failure}; skipped.")
                continue
            losses.append([metrics[losses_key(k)] for k in range(p.candidates + 1)])
            sketches.append(sketch)
            weights.append(metrics[NUM_EXAMPLES])
        row: dict[str, float] = {"gga-bytes-up": exchange.bytes_up,
                                 "gga-bytes-down": exchange.bytes_down}
        if len(sketches) < 2:
            loop.warn(f"GGA round {server_round}: fewer than two usable replies; the "
                      "global model is kept.")
            row.update({"gga-accepted": 0.0, "gga-seconds": time.perf_counter() - started})
            return row, exchange.bytes_down, exchange.bytes_up
        best, scores, mean_loss = choose_candidate(losses, sketches, weights, p.tolerance,
                                                   p.objective)
        if best:
            loop.state = dataclasses.replace(loop.state, model=apply_candidate(
                loop.state.model, self.perturb, seed=server.seed,
                server_round=server_round, candidate=best, rho=p.rho))
        row.update({"gga-accepted": float(best > 0), "gga-candidate": float(best),
                    "gga-cosine-before": scores[0], "gga-cosine-after": scores[best],
                    "gga-loss-before": mean_loss[0], "gga-loss-after": mean_loss[best],
                    "gga-seconds": time.perf_counter() - started})
        return row, exchange.bytes_down, exchange.bytes_up
