"""The federated annealed warm start (ALGORITHMS.md 4.3 item 1), an option of every strategy.

In rounds ``gga-start..gga-end``, before training, the server sends the round's sampled clients
the global model and a seed; each regenerates ``gga-candidates`` perturbations ``eps_k ~
U(-gga-rho, gga-rho)`` of the featurizer, and returns, for the anchor and every candidate, its loss
on ``gga-batch-size`` of its samples and a count sketch of its gradient
(:func:`pflalign.gga.candidate_statistics`). The server scores each candidate by the clients'
gradient agreement and accepts the best one that beats the anchor within the loss tolerance
(:func:`pflalign.gga.choose_candidate`, GGA's rule 3.2 with clients as domains), moves the global
model there (:func:`pflalign.gga.apply_candidate`), and the round continues. One message
exchange per annealing round; its bytes and seconds are recorded in the round's row.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch
from flwr.app import MessageType
from flwr.serverapp import Grid

from pflalign.gga import apply_candidate, choose_candidate
from pflalign.models import head_keys

if TYPE_CHECKING:
    from strategies.base import PFLStrategy

SKETCH = "sketch"


class AnnealedWarmStart:
    def __init__(self, strategy: PFLStrategy):
        s = strategy.settings
        self.strategy = strategy
        self.window = (int(s["gga-start"]), int(s["gga-end"]))
        self.candidates = int(s["gga-candidates"])
        head = set(head_keys(strategy.template_model()))
        #: the featurizer: trainable shared entries outside the classifier (3.2 step 4.1)
        self.perturb = [k for k in strategy.trainable if k in strategy.shared and k not in head]
        dims = sum(int(np.prod(strategy.global_state[k].shape)) for k in strategy.trainable)
        wanted = int(s["gga-sketch-dim"])
        self.sketch_shape = (self.candidates + 1, wanted if 0 < wanted < dims else dims)

    def active(self, server_round: int) -> bool:
        return bool(self.strategy.settings["gga"]) and (
            self.window[0] <= server_round <= self.window[1])

    def config(self) -> dict:
        return {"action": "gga", "gga-candidates": self.candidates,
                "gga-perturb": ",".join(self.perturb)}

    def run(self, server_round: int, grid: Grid) -> dict[str, float]:
        st = self.strategy
        s = st.settings
        started = time.perf_counter()
        clients = st.largest_first(st.sample(server_round))
        messages = [st._message(cid, {"arrays": st.global_record()}, MessageType.QUERY,
                                server_round, self.config()) for cid in clients]
        from strategies.base import ClientFailure, payload_bytes

        down = sum(payload_bytes(m.content) for m in messages)
        replies = list(grid.send_and_receive(messages, timeout=st.timeout))
        up = sum(payload_bytes(m.content) for m in replies if not m.has_error())
        losses, sketches, weights = [], [], []
        for msg in replies:
            try:
                metrics, _ = st._validate(msg, False, ("num-examples", *(
                    f"gga-loss-{k}" for k in range(self.candidates + 1))))
                record = msg.content.array_records.get(SKETCH)
                if record is None or SKETCH not in record:
                    raise ClientFailure(f"{st._describe(msg)} replied without its gradient "
                                        "sketches")
                sketch = torch.from_numpy(record[SKETCH].numpy().copy())
                if tuple(sketch.shape) != self.sketch_shape or not torch.isfinite(sketch).all():
                    raise ClientFailure(f"{st._describe(msg)} sent sketches of shape "
                                        f"{tuple(sketch.shape)} (expected {self.sketch_shape}, "
                                        "finite)")
            except ClientFailure as failure:
                st.reporter.warn(f"[{st.label}] GGA round {server_round}: {failure}; skipped.")
                continue
            losses.append([metrics[f"gga-loss-{k}"] for k in range(self.candidates + 1)])
            sketches.append(sketch)
            weights.append(metrics["num-examples"])
        row: dict[str, float] = {"gga-bytes-up": up, "gga-bytes-down": down}
        if len(sketches) < 2:
            st.reporter.warn(f"[{st.label}] GGA round {server_round}: fewer than two usable "
                             "replies; the global model is kept.")
            row.update({"gga-accepted": 0.0, "gga-seconds": time.perf_counter() - started})
            return row
        best, scores, mean_loss = choose_candidate(
            losses, sketches, weights, float(s["gga-tolerance"]), str(s["gga-objective"]))
        if best:
            st.global_state = apply_candidate(st.global_state, self.perturb, seed=int(s["seed"]),
                                              server_round=server_round, candidate=best,
                                              rho=float(s["gga-rho"]))
            st._global_record = None
        row.update({"gga-accepted": float(best > 0), "gga-candidate": float(best),
                    "gga-cosine-before": scores[0], "gga-cosine-after": scores[best],
                    "gga-loss-before": mean_loss[0], "gga-loss-after": mean_loss[best],
                    "gga-seconds": time.perf_counter() - started})
        return row
