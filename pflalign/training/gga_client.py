"""The client's side of the federated annealed warm start (:mod:`pflalign.round.features.gga`): its
answer to an annealing round, and the names of that exchange's records and config entries. The
client handler (:mod:`pflalign.engines.host`) imports this, never the server's round hook.
"""

from __future__ import annotations

import torch

from pflalign.settings.schema import GGAParams
from pflalign.training.client import ClientRuntime
from pflalign.training.gga import candidate_statistics
from pflalign.training.loops import STREAM_GGA
from pflalign.wire.messages import Received
from pflalign.wire.protocol import NUM_EXAMPLES
from pflalign.wire.state import TorchState

GGA_ACTION = "gga"
SKETCH = "sketch"
CANDIDATES, PERTURB = "gga-candidates", "gga-perturb"


def losses_key(k: int) -> str:
    return f"gga-loss-{k}"


def client_answer(client: ClientRuntime, received: Received, params: GGAParams,
                  ) -> tuple[dict[str, float | int], dict[str, TorchState]]:
    """A client's answer to an annealing round
    (:func:`pflalign.training.gga.candidate_statistics`): the global model (shared entries over
    the run's initial model), ``gga-batch-size`` of its train samples drawn by (seed, round,
    client), the candidates named by the server's seed."""
    model = client.new_model()
    model.load_state_dict(received.model, strict=False)
    model.train()
    gen = client.generator(received.server_round, STREAM_GGA)
    data = client.data
    idx = torch.randperm(data.num_train, generator=gen)[:params.batch_size].to(data.train_x.device)
    perturb = [n for n in str(received.config[PERTURB]).split(",") if n]
    losses, sketches = candidate_statistics(
        model, data.normalize(data.train_x[idx]), data.train_y[idx], perturb, seed=client.seed,
        server_round=received.server_round, candidates=int(received.config[CANDIDATES]),
        rho=params.rho, sketch_dim=params.sketch_dim)
    metrics = {NUM_EXAMPLES: data.num_train, **{losses_key(k): v for k, v in enumerate(losses)}}
    return metrics, {SKETCH: {SKETCH: sketches}}
