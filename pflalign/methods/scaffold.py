"""SCAFFOLD (Karimireddy et al., SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning, ICML 2020, Algorithm 1, option II).

Client: each step uses the corrected gradient ``g(y) - c_i + c`` (plain SGD at rate ``lr``). After
``K`` steps the client's control variate becomes ``c_i+ = c_i - c + (x - y) / (K lr)``; the client
keeps ``c_i+`` and uploads its model ``y`` with ``dc = c_i+ - c_i`` (record ``control-delta``). A
client that has not trained yet has ``c_i = 0``. Option II's estimate assumes plain SGD: with
``momentum`` or ``weight-decay`` the step is no longer ``lr g``, so the config refuses them.

Server (lines 16-17): it keeps ``c`` (trainable entries, zeros at start) and sends it as the record
``control`` beside the global model; it steps ``x <- x + eta_g sum_i p_i (y_i - x)`` (sample
weights ``p_i``; buffers averaged as in FedAvg) and ``c <- c + (1/N) sum_i dc_i`` over the N
training clients (:func:`scaffold_server_update`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pflalign.methods.fedavg import FedAvg, trained_upload
from pflalign.server.aggregation import FlatSpec, fedavg, weighted_average
from pflalign.server.runtime import ServerRuntime
from pflalign.settings.options import ConfigError
from pflalign.settings.params import Params, param
from pflalign.settings.schema import Settings
from pflalign.training.client import ClientRuntime
from pflalign.training.corrections import Correction, Entries
from pflalign.training.optim.common import Tensors
from pflalign.training.runs import LocalRun, Rule
from pflalign.wire.messages import Payload, Received, Update
from pflalign.wire.protocol import MODEL
from pflalign.wire.state import ArrayState, ServerState, State, TorchState

CONTROL, CONTROL_DELTA = "control", "control-delta"


@torch.no_grad()
def scaffold_client_control(client_control: Tensors, server_control: Tensors, start: Tensors,
                            end: Tensors, steps: int, lr: float) -> list[torch.Tensor]:
    """SCAFFOLD option II (Alg. 1 line 12): ``c_i+ = c_i - c + (x - y_i) / (K lr)`` where ``x`` is
    the model the client started from and ``y_i`` the model after ``K`` local SGD steps."""
    if steps < 1 or lr <= 0:
        raise ValueError(f"scaffold_client_control needs steps >= 1 and lr > 0, got {steps}, {lr}.")
    new = torch._foreach_sub(list(client_control), list(server_control))
    torch._foreach_add_(new, torch._foreach_sub(list(start), list(end)), alpha=1.0 / (steps * lr))
    return new


def scaffold_server_update(model: np.ndarray, control: np.ndarray,
                           model_deltas: Sequence[np.ndarray], control_deltas: Sequence[np.ndarray],
                           weights: Sequence[float], num_clients: int, server_lr: float,
                           ) -> tuple[np.ndarray, np.ndarray]:
    """SCAFFOLD's server step (Alg. 1 lines 16-17) on flat vectors:
    ``x <- x + eta_g sum_i p_i dy_i`` and ``c <- c + (1/N) sum_i dc_i``.

    ``p_i`` are the clients' sample weights normalised to sum to 1 (the paper's 1/|S| when clients
    hold equal data; sample weighting makes ``eta_g = 1`` with zero control variates exactly
    FedAvg). ``N`` is the number of training clients, sampled or not.
    """
    step = weighted_average(model_deltas, weights)
    new_control = control.astype(np.float64) + np.sum(control_deltas, axis=0,
                                                      dtype=np.float64) / num_clients
    return model + server_lr * step, new_control


@dataclass(frozen=True)
class ControlVariates(Correction):
    """SCAFFOLD's corrected gradient ``g + c - c_i`` (Karimireddy et al., ICML 2020, Algorithm 1
    line 10): ``server`` is ``c``, ``client`` is ``c_i``."""

    server: Entries
    client: Entries

    def apply_(self, grads: list[torch.Tensor], params: list[torch.Tensor],
               names: Sequence[str]) -> None:
        torch._foreach_add_(grads, torch._foreach_sub([self.server[n] for n in names],
                                                      [self.client[n] for n in names]))


@dataclass(frozen=True)
class ScaffoldParams(Params):
    prefix = "scaffold"

    server_lr: float = param(1.0, "Global step size eta_g applied to the averaged model change.",
                             minimum=0.0, exclusive_minimum=True)


@dataclass
class ScaffoldClientState(ArrayState):
    #: the client's control variate c_i (trainable entries)
    control: TorchState | None = None


@dataclass
class ScaffoldServerState(ServerState):
    #: the server's control variate c over the trainable entries, flat, float64
    control: np.ndarray | None = None


class Scaffold(FedAvg):
    asynchronous = False  # its server update is not a plain average of uploads
    name = "scaffold"
    summary = ("Client and server control variates correct each local gradient for client drift "
               "(variance reduction); option II control-variate update.")
    paper = ("Karimireddy et al., SCAFFOLD: Stochastic Controlled Averaging for Federated "
             "Learning, ICML 2020")
    Params = ScaffoldParams
    ClientState = ScaffoldClientState
    ServerState = ScaffoldServerState
    local_optimizer = False
    robust_aggregation = False  # its server step is a control-variate-corrected mean update
    private = False
    not_private = ("its clients upload a control-variate change beside the model, and its server "
                   "step corrects the mean update with their running sum")

    def __init__(self, params: ScaffoldParams):
        super().__init__(params)
        self._unpacked: tuple[np.ndarray, State] | None = None

    @classmethod
    def check(cls, settings: Settings) -> None:
        super().check(settings)
        t = settings.training
        if t.momentum or t.weight_decay:
            raise ConfigError("scaffold's control variates (option II) assume plain SGD; set "
                              "momentum = 0 and weight-decay = 0 for it.")

    # --- client --------------------------------------------------------------------------------
    def train(self, client: ClientRuntime, received: Received, state: ScaffoldClientState,
              ) -> Rule:
        start = received.model
        names = client.template.trainable
        zeros = {n: torch.zeros_like(start[n]) for n in names}
        c = received.arrays.get(CONTROL) or zeros
        c_i = state.control or zeros
        result = yield LocalRun(start, correction=ControlVariates(c, c_i))
        steps = result.stats.steps
        c_list = [c[n].to(client.device) for n in names]
        c_i_list = [c_i[n].to(client.device) for n in names]
        new_c_i = scaffold_client_control(c_i_list, c_list, [start[n].to(client.device)
                                                            for n in names],
                                          [result.model[n] for n in names], steps,
                                          client.training.lr)
        delta = torch._foreach_sub(new_c_i, c_i_list)
        upload = trained_upload(result)
        upload.arrays[CONTROL_DELTA] = dict(zip(names, delta, strict=True))
        return upload, ScaffoldClientState(dict(zip(names, new_c_i, strict=True)))

    # --- server --------------------------------------------------------------------------------
    def init_server(self, server: ServerRuntime, model: State) -> ScaffoldServerState:
        return ScaffoldServerState(model=model, control=np.zeros(server.trainable_spec.size,
                                                                 dtype=np.float64))

    def reply_arrays(self, server: ServerRuntime) -> dict[str, FlatSpec]:
        return {CONTROL_DELTA: server.trainable_spec}

    def train_payload(self, server: ServerRuntime, state: ScaffoldServerState, client: int,
                      server_round: int) -> Payload:
        return Payload({MODEL: server.shared_model(state),
                        CONTROL: self._control_arrays(server, state.control)})

    def _control_arrays(self, server: ServerRuntime, control: np.ndarray) -> State:
        """``c`` as arrays in the model's dtypes, unpacked once per value of ``c`` (the same
        arrays for every client of a round, so an engine serializes them once)."""
        if self._unpacked is None or self._unpacked[0] is not control:
            self._unpacked = (control, server.trainable_spec.unflatten(control))
        return self._unpacked[1]

    def aggregate(self, server: ServerRuntime, state: ScaffoldServerState, server_round: int,
                  updates: Sequence[Update]) -> tuple[ScaffoldServerState, dict[str, float]]:
        spec = server.trainable_spec
        weights = [u.num_examples for u in updates]
        x = spec.flatten(state.model, np.float64)
        model, control = scaffold_server_update(
            x, state.control, [spec.flatten(u.model, np.float64) - x for u in updates],
            [spec.flatten(u.arrays[CONTROL_DELTA], np.float64) for u in updates], weights,
            num_clients=len(server.training_clients()), server_lr=self.params.server_lr)
        averaged = fedavg([u.model for u in updates], weights, server.flat)
        new = server.with_model(state, {**averaged, **spec.unflatten(model)})
        return dataclasses.replace(new, control=control), {}

    def round_diagnostics(self, server: ServerRuntime, state: ScaffoldServerState,
                          ) -> dict[str, float]:
        return {"control-norm": float(np.linalg.norm(state.control))}
