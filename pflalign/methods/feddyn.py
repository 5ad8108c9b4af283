"""FedDyn (Acar et al., Federated Learning Based on Dynamic Regularization, ICLR 2021,
Algorithm 1).

Client k, in a round t it takes part in, receives the server model ``theta^{t-1}`` and minimizes
its dynamically regularized loss

    ``L_k(theta) - <g_k, theta> + alpha/2 ||theta - theta^{t-1}||^2``

where ``g_k`` (the client's state, zeros at first; the paper's ``grad L_k(theta_k^{t-1})``) is the
linear term: every mini-batch gradient becomes ``grad L_k - g_k + alpha (theta - theta^{t-1})``
(:class:`~pflalign.methods.feddyn.DynamicRegularizer`) under the run's local optimizer. After
training, the first-order condition of that minimization updates the linear term, ``g_k <- g_k -
alpha (theta_k^t - theta^{t-1})`` (:func:`linear_term_update`), and the client uploads
``theta_k^t``. With ``g_k = 0`` (a client's first round) the local update is FedProx's with ``mu =
alpha``, exactly. The local optimizer's weight decay counts as part of ``L_k`` (its stationarity
condition is then that of the decayed loss); momentum changes the path, not the minimizer.

Server: it keeps ``h`` (zeros at first) over the trainable entries and, over the round's
participants ``P_t`` and the ``m`` training clients,
``h <- h - alpha (1/m) sum_{k in P_t} (theta_k^t - theta^{t-1})`` and
``theta^t <- (1/|P_t|) sum_{k in P_t} theta_k^t - h / alpha`` (:func:`feddyn_server_update`): the
paper's uniform mean over participants, not a sample-weighted one. Buffers (batch-norm statistics)
are averaged as in FedAvg. ``personal-acc`` and ``global-acc`` both score the server model, as for
FedAvg; a new client uses it as is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pflalign.methods.fedavg import FedAvg, trained_upload
from pflalign.server.aggregation import fedavg
from pflalign.server.runtime import ServerRuntime
from pflalign.settings.params import Params, log_range, param
from pflalign.training.client import ClientRuntime
from pflalign.training.corrections import Correction, Entries
from pflalign.training.runs import LocalRun, Rule
from pflalign.wire.messages import Received, Update
from pflalign.wire.state import ArrayState, ServerState, State, TorchState

Tensors = Sequence[torch.Tensor]


@torch.no_grad()
def linear_term_update(linear: Tensors, end: Tensors, anchor: Tensors,
                       alpha: float) -> list[torch.Tensor]:
    """``g_k - alpha (theta_k^t - theta^{t-1})``: the client's new linear term."""
    new = [g.clone() for g in linear]
    torch._foreach_add_(new, torch._foreach_sub(list(end), list(anchor)), alpha=-alpha)
    return new


def feddyn_server_update(model: np.ndarray, h: np.ndarray, client_models: Sequence[np.ndarray],
                         num_clients: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """The server step on flat float64 vectors: the new ``h`` and the new server model."""
    if not client_models:
        raise ValueError("feddyn_server_update needs at least one client model.")
    stacked = np.stack(client_models).astype(np.float64)
    new_h = h - alpha * (stacked - model).sum(axis=0) / num_clients
    return stacked.mean(axis=0) - new_h / alpha, new_h


@dataclass(frozen=True)
class DynamicRegularizer(Correction):
    """FedDyn's ``g += alpha (w - w^{t-1}) - g_k`` (Acar et al., ICLR 2021, Algorithm 1): the
    gradient of its quadratic and linear terms, ``anchor`` the received server model and
    ``linear`` the client's ``g_k``."""

    anchor: Entries
    linear: Entries
    alpha: float

    def apply_(self, grads: list[torch.Tensor], params: list[torch.Tensor],
               names: Sequence[str]) -> None:
        torch._foreach_add_(grads, torch._foreach_sub(params, [self.anchor[n] for n in names]),
                            alpha=self.alpha)
        torch._foreach_sub_(grads, [self.linear[n] for n in names])


@dataclass(frozen=True)
class FedDynParams(Params):
    prefix = "feddyn"

    alpha: float = param(0.01, "Weight alpha of the dynamic regularizer (its quadratic term "
                         "alpha/2 ||theta - theta_server||^2 and the server's h / alpha "
                         "correction).", minimum=0.0, exclusive_minimum=True,
                         search=log_range(0.001, 0.1))


@dataclass
class FedDynClientState(ArrayState):
    #: the linear term g_k over the trainable entries
    linear: TorchState | None = None


@dataclass
class FedDynServerState(ServerState):
    #: h over the trainable entries, flat, float64
    h: np.ndarray | None = None


class FedDyn(FedAvg):
    asynchronous = False  # its server update is not a plain average of uploads
    name = "feddyn"
    summary = ("Dynamic regularization: each client's loss gets a linear term from its past "
               "updates and a proximal term, so that local optima align with the global one; "
               "the server corrects the average by its running h.")
    paper = "Acar et al., Federated Learning Based on Dynamic Regularization, ICLR 2021"
    Params = FedDynParams
    ClientState = FedDynClientState
    ServerState = FedDynServerState
    robust_aggregation = False  # its server step is corrected by the running h
    private = False
    not_private = ("its server step corrects the average by h, a running sum of the updates "
                   "over every client (divided by the federation's size, not a round's)")

    def train(self, client: ClientRuntime, received: Received, state: FedDynClientState,
              ) -> Rule:
        alpha = self.params.alpha
        start = received.model
        names = client.template.trainable
        linear = state.linear or {n: torch.zeros_like(start[n]) for n in names}
        result = yield LocalRun(start, correction=DynamicRegularizer(start, linear, alpha))
        new_linear = linear_term_update([linear[n].to(client.device) for n in names],
                                        [result.model[n] for n in names],
                                        [start[n].to(client.device) for n in names], alpha)
        return trained_upload(result), FedDynClientState(dict(zip(names, new_linear,
                                                                  strict=True)))

    def init_server(self, server: ServerRuntime, model: State) -> FedDynServerState:
        return FedDynServerState(model=model, h=np.zeros(server.trainable_spec.size,
                                                         dtype=np.float64))

    def aggregate(self, server: ServerRuntime, state: FedDynServerState, server_round: int,
                  updates: Sequence[Update]) -> tuple[FedDynServerState, dict[str, float]]:
        spec = server.trainable_spec
        model, h = feddyn_server_update(
            spec.flatten(state.model, np.float64),
            state.h, [spec.flatten(u.model, np.float64) for u in updates],
            num_clients=len(server.training_clients()), alpha=self.params.alpha)
        buffers = fedavg([u.model for u in updates], [u.num_examples for u in updates],
                         server.flat)
        new = server.with_model(state, {**buffers, **spec.unflatten(model)})
        return dataclasses.replace(new, h=h), {"h-norm": float(np.linalg.norm(h))}
