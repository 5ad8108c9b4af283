"""FedCP (Zhang, Hua, Wang, Song, Xue, Ma, Guan, FedCP: Separating Feature Information for
Personalized Federated Learning via Conditional Policy, KDD 2023, arXiv 2307.01217).

The model splits into a feature extractor ``f`` (every layer but the last) and a head (the last
layer, ``W^hd``). Beside them each client uses a Conditional Policy Network (CPN, ``Theta``): a
linear layer ``K -> 2K``, LayerNorm over the ``2K`` units and ReLU, read as ``K x 2`` and
soft-maxed over the two slots for every feature, which gives ``r`` and ``s = 1 - r``
(:class:`ConditionalPolicy`). For a sample with features ``h = f(x; W_i^fe)``:

- the CPN's input is ``C_i = (v_i / ||v_i||) * h`` with ``v_i`` the column sums of the client's
  personalized head weight ``W_i^hd`` (held fixed during a round; :func:`client_vector`);
- ``{r, s} = CPN(C_i)``; ``r * h`` goes to the frozen global head ``W^hd`` and ``s * h`` to the
  personalized head ``W_i^hd``; the prediction is the sum of their logits (:func:`fedcp_logits`).

Client, each round: it loads the global feature extractor, the global head (frozen) and the
global CPN, and its own personalized head (the run's initial head until it first trains). It
trains ``W_i^fe``, ``W_i^hd`` and ``Theta_i`` with the run's local optimizer on
``CE(out, y) + lambda MMD^2(f(x; W_i^fe), f(x; W^fe))``, the second extractor being a frozen copy of
the received global one (:func:`mmd2`, the biased estimate with a sum of Gaussian kernels). It
keeps ``W_i^hd`` and uploads ``W_i^fe``, ``(W^hd + W_i^hd) / 2`` as the head, and ``Theta_i``
(record ``cpn``). Server: FedAvg by sample count of the model and, separately, of the CPN.

``personal-acc`` scores the client's model as the protocol has it after the round's download: the
global feature extractor, global head and CPN with its own personalized head (the evaluation of
the authors' code); ``global-acc`` scores the global model alone (extractor and global head, no
CPN). A new client's personalized head is the run's initial head, as every client's is before
its first round.

Deviations from the authors' code, following the paper's text instead: the policy is a plain
softmax (the code draws Gumbel noise, also at test time); ``v_i`` comes from the personalized head
from the first round on (the code starts from a random vector). The MMD kernel bandwidths
(``{10, 15, 20, 50}``, ``exp(-d^2 / (2 sigma))``) are not given in the paper; these are the
authors' code's. The CPN adds ``2K^2 + 6K`` values to the traffic (527,360 for the ``cnn``'s
``K = 512``, about 90% of its model).

Batched engine (:mod:`pflalign.cohort`): the objective is not the cross-entropy of the run's
model that :meth:`~pflalign.cohort.Cohort.local_train` trains, so :meth:`FedCP.train_cohort`
runs its own lockstep loop over the cohort's stacked extractors, personalized heads and CPNs,
taking each step's gradients with :func:`torch.func.grad` of the same objective
(:meth:`FedCP._objective`): per client on its exact batch with backend ``loop`` (the sequential
engine's results bit for bit), in one vmapped call over padded batches, the CE and MMD masked,
with backend ``vmap``. Evaluation builds each client's personalized model as :meth:`FedCP.evaluate`
does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from pflalign.aggregation import FlatSpec, State
from pflalign.client import ClientRuntime, Received, Upload
from pflalign.method import Method, Payload, Update
from pflalign.models import parameter_modules
from pflalign.params import Params, param
from pflalign.protocol import LOCAL_STEPS, MODEL, TRAIN_LOSS
from pflalign.server import ServerRuntime
from pflalign.state import ArrayState, ServerState, TorchState
from pflalign.train import STREAM_OPTIMIZER, STREAM_TRAIN, derive_seed

if TYPE_CHECKING:
    from pflalign.cohort import Cohort

CPN = "cpn"
#: the MMD's Gaussian kernel bandwidths sigma in exp(-||u - v||^2 / (2 sigma))
BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)
_CPN_STREAM = 0xC9


class ConditionalPolicy(nn.Module):
    """The CPN: ``K -> 2K`` linear, LayerNorm, ReLU, then a softmax over two slots per feature.
    Returns ``(r, s)``, each ``batch x K``, with ``r + s = 1``."""

    def __init__(self, features: int):
        super().__init__()
        self.linear = nn.Linear(features, 2 * features)
        self.norm = nn.LayerNorm(2 * features)

    def forward(self, conditional: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.relu(self.norm(self.linear(conditional)))
        k = conditional.shape[1]
        policy = torch.softmax(torch.stack([logits[:, :k], logits[:, k:]], dim=2), dim=2)
        return policy[..., 0], policy[..., 1]


def new_policy(features: int, seed: int) -> ConditionalPolicy:
    """The run's initial CPN (seeded, the same on the server and every client)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, _CPN_STREAM))
        return ConditionalPolicy(features)


def client_vector(head_weight: torch.Tensor) -> torch.Tensor:
    """``v_i / ||v_i||`` with ``v_i`` the column sums of the personalized head's ``C x K`` weight
    (the sum of its class rows), detached: it is fixed during the round."""
    v = head_weight.detach().sum(dim=0)
    return v / v.norm()


def fedcp_logits(features: torch.Tensor, vector: torch.Tensor, policy: ConditionalPolicy,
                 global_head: nn.Module, personal_head: nn.Module) -> torch.Tensor:
    """``W^hd(r * h) + W_i^hd(s * h)`` with ``{r, s} = CPN(v * h)``."""
    r, s = policy(vector * features)
    return global_head(r * features) + personal_head(s * features)


class PersonalizedModel(nn.Module):
    """A client's FedCP model as one module (features, policy, both heads), so that the shared
    evaluation loop can score it."""

    def __init__(self, model: nn.Module, global_head: nn.Module, personal_head: nn.Module,
                 policy: ConditionalPolicy):
        super().__init__()
        self.model, self.global_head = model, global_head
        self.personal_head, self.policy = personal_head, policy
        self.vector = client_vector(personal_head.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with without_head(self.model):
            features = self.model(x)
        return fedcp_logits(features, self.vector, self.policy, self.global_head,
                            self.personal_head)


def mmd2(x: torch.Tensor, y: torch.Tensor, bandwidths: Sequence[float] = BANDWIDTHS,
         mask: torch.Tensor | None = None) -> torch.Tensor:
    """The biased estimate of MMD^2 between the samples ``x`` and ``y`` (rows) under the kernel
    ``sum_sigma exp(-||u - v||^2 / (2 sigma))``:
    ``mean k(x, x') + mean k(y, y') - 2 mean k(x, y)``. ``mask`` (1 for a sample, 0 for
    padding; paired rows of ``x`` and ``y``) restricts the means to the masked-in rows."""
    def kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        d2 = (a.unsqueeze(1) - b.unsqueeze(0)).pow(2).sum(dim=2)  # smooth at distance 0
        return sum(torch.exp(-d2 / (2 * sigma)) for sigma in bandwidths)

    if mask is None:
        return kernel(x, x).mean() + kernel(y, y).mean() - 2 * kernel(x, y).mean()
    w = mask / mask.sum().clamp_min(1)
    return w @ kernel(x, x) @ w + w @ kernel(y, y) @ w - 2 * (w @ kernel(x, y) @ w)


def head_of(model: nn.Module) -> tuple[str, nn.Module]:
    """The model's last parameterised layer (its classifier) and its name."""
    return parameter_modules(model)[-1]


@contextlib.contextmanager
def without_head(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` with its head replaced by the identity, so that it returns its features."""
    name, head = head_of(model)
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, nn.Identity())
    try:
        yield model
    finally:
        setattr(parent, attr, head)


@functools.cache
def _policy_spec(features: int) -> FlatSpec:
    """The layout of a CPN's state (what a reply's ``cpn`` record must match)."""
    with torch.device("meta"):
        policy = ConditionalPolicy(features)
    return FlatSpec.of({k: np.empty(tuple(v.shape), dtype=np.float32)
                        for k, v in policy.state_dict().items()})


@dataclass(frozen=True)
class FedCPParams(Params):
    prefix = "fedcp"

    lambda_: float = param(0.5, "Weight lambda of the MMD between the client's features and the "
                           "received global extractor's. The authors use 5 with SGD at 0.005 "
                           "(MNIST, 4-layer CNN); 0.5 keeps their lambda x lr at this project's "
                           "lr = 0.05, where 5 makes local training unstable.", minimum=0.0)


@dataclass
class FedCPClientState(ArrayState):
    #: the personalized head W_i^hd (the run's initial head until the client first trains)
    head: TorchState | None = None


@dataclass
class FedCPServerState(ServerState):
    #: the global CPN Theta
    cpn: State = dataclasses.field(default_factory=dict)


class FedCP(Method):
    name = "fedcp"
    summary = ("Conditional policy: per sample, a policy network splits the features between the "
               "frozen global head and a personalized head; extractor, policy and the heads' "
               "mean are averaged.")
    paper = ("Zhang et al., FedCP: Separating Feature Information for Personalized Federated "
             "Learning via Conditional Policy, KDD 2023")
    Params = FedCPParams
    ClientState = FedCPClientState
    ServerState = FedCPServerState

    # --- client --------------------------------------------------------------------------------
    def _parts(self, new_model: Callable[..., nn.Module], seed: int, device: torch.device,
               received: Received, state: FedCPClientState,
               ) -> tuple[nn.Module, nn.Module, nn.Module, ConditionalPolicy, str]:
        """The received model, the frozen global head, the personalized head, the CPN, and the
        head's name (``new_model(state=None)``: a fresh copy of the run's model)."""
        model = new_model(received.model)
        name, global_head = head_of(model)
        personal = new_model()  # the run's initial model: its head until trained
        if state.head:
            head_of(personal)[1].load_state_dict(state.head)
        personal_head = head_of(personal)[1]
        policy = new_policy(global_head.in_features, seed).to(device)
        policy.load_state_dict(received.arrays[CPN])
        global_head.requires_grad_(False)
        return model, global_head, personal_head, policy, name

    @staticmethod
    def _result(model_state: Mapping[str, torch.Tensor], name: str,
                global_head: Mapping[str, torch.Tensor], own_head: TorchState,
                policy: Mapping[str, torch.Tensor], ce_sum: float, mmd_sum: float, seen: int,
                steps: int) -> tuple[Upload, FedCPClientState]:
        """The upload (the trained extractor, ``(W^hd + W_i^hd) / 2`` as the head, the CPN) and
        the new state (``W_i^hd``) of a client's round."""
        upload = dict(model_state)
        for key, value in own_head.items():
            upload[f"{name}.{key}"] = (global_head[key] + value) / 2
        return (Upload(upload, {TRAIN_LOSS: ce_sum / max(seen, 1), LOCAL_STEPS: steps,
                                "mmd": mmd_sum / max(seen, 1)},
                       arrays={CPN: dict(policy)}),
                FedCPClientState(own_head))

    def train(self, client: ClientRuntime, received: Received, state: FedCPClientState,
              ) -> tuple[Upload, FedCPClientState]:
        model, global_head, personal_head, policy, name = self._parts(
            client.new_model, client.seed, client.device, received, state)
        frozen = client.new_model(received.model)
        frozen.requires_grad_(False)
        vector = client_vector(personal_head.weight)
        body = [p for n, p in model.named_parameters() if not n.startswith(f"{name}.")]
        optimizer = client.make_optimizer([*body, *personal_head.parameters(),
                                           *policy.parameters()], received.server_round)
        lam = self.params.lambda_
        model.train()
        frozen.train()
        policy.train()
        ce_sum, mmd_sum, seen, steps = 0.0, 0.0, 0, 0
        with without_head(model), without_head(frozen):
            for x, y in client.batches(received.server_round):
                features = model(x)
                ce = F.cross_entropy(fedcp_logits(features, vector, policy, global_head,
                                                  personal_head), y)
                with torch.no_grad():
                    reference = frozen(x)
                mmd = mmd2(features, reference)
                optimizer.zero_grad(set_to_none=True)
                (ce + lam * mmd).backward()
                optimizer.step()
                ce_sum += float(ce.detach()) * len(y)
                mmd_sum += float(mmd.detach()) * len(y)
                seen += len(y)
                steps += 1
        own_head = {k: v.detach().clone() for k, v in personal_head.state_dict().items()}
        return self._result(model.state_dict(), name, global_head.state_dict(), own_head,
                            policy.state_dict(), ce_sum, mmd_sum, seen, steps)

    def _personalized(self, new_model: Callable[..., nn.Module], seed: int,
                      device: torch.device, received: Received,
                      state: FedCPClientState) -> PersonalizedModel:
        model, global_head, personal_head, policy, _ = self._parts(new_model, seed, device,
                                                                   received, state)
        return PersonalizedModel(model, global_head, personal_head, policy)

    def evaluate(self, client: ClientRuntime, received: Received,
                 state: FedCPClientState) -> dict:
        global_result = client.test(client.new_model(received.model))
        personalized = self._personalized(client.new_model, client.seed, client.device,
                                          received, state)
        return client.eval_metrics(client.test(personalized), global_result)

    # --- batched client rules --------------------------------------------------------------------
    def train_cohort(self, cohort: Cohort, received: Sequence[Received],
                     states: Sequence[FedCPClientState],
                     ) -> list[tuple[Upload, FedCPClientState]]:
        """:meth:`train` for the cohort's clients in lockstep, on their stacked extractors,
        personalized heads and CPNs (:class:`_CohortParts`); each step's per-client gradients
        come from :func:`torch.func.grad` of the same objective (backend ``loop``: one client at
        a time on its exact batch, bit for bit :meth:`train`; ``vmap``: one call over padded,
        masked batches)."""
        parts = _CohortParts(cohort, received, states)
        optimizers = [cohort.training.optimizer(
            parts.views(parts.trained, i),
            cohort.generator(i, received[0].server_round, STREAM_OPTIMIZER, STREAM_TRAIN))
            for i in range(len(cohort))]
        sums = self._local_train_cohort(cohort, parts, optimizers, received[0].server_round)
        out = []
        for i, (r, (ce_sum, mmd_sum, seen, steps)) in enumerate(zip(received, sums,
                                                                     strict=True)):
            model_state = {k: parts.trained["body"][k][i] if k in parts.trained["body"]
                           else r.model[k] for k in cohort.template.state_dict()}
            own_head = {k: v[i] for k, v in parts.trained["head"].items()}
            global_head = {k: r.model[f"{parts.name}.{k}"] for k in own_head}
            policy = {k: v[i] for k, v in parts.trained["cpn"].items()}
            out.append(self._result(model_state, parts.name, global_head, own_head, policy,
                                    ce_sum, mmd_sum, seen, steps))
        return out

    def _objective(self, parts: _CohortParts, trained: dict[str, Stacked],
                   fixed: dict[str, Stacked], vector: torch.Tensor, reference: torch.Tensor,
                   x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One client's ``CE + lambda MMD^2`` (and its two terms), as :meth:`train` computes
        it, with the client's entries as functional inputs (``mask``: padded rows, vmap)."""
        features = functional_call(parts.body, trained["body"], (x,))
        logits = fedcp_logits(
            features, vector,
            lambda c: functional_call(parts.policy, trained["cpn"], (c,)),
            lambda h: functional_call(parts.head, fixed["head"], (h,)),
            lambda h: functional_call(parts.head, trained["head"], (h,)))
        if mask is None:
            ce = F.cross_entropy(logits, y)
        else:
            ce = ((F.cross_entropy(logits, y, reduction="none") * mask).sum()
                  / mask.sum().clamp_min(1))
        mmd = mmd2(features, reference, mask=mask)
        return ce + self.params.lambda_ * mmd, (ce.detach(), mmd.detach())

    def _local_train_cohort(self, cohort: Cohort, parts: _CohortParts,
                            optimizers: Sequence[torch.optim.Optimizer], server_round: int,
                            ) -> list[tuple[float, float, int, int]]:
        """The round's local training of every client, in lockstep, each on its own seeded
        batches (those of :meth:`ClientRuntime.batches`); per client (CE sum, MMD sum, samples,
        steps)."""
        orders = cohort.orders(server_round, STREAM_TRAIN, None)
        views = [cohort.optimized(opt) for opt in optimizers]
        sums = [[0.0, 0.0, 0, 0] for _ in range(len(cohort))]
        objective = functools.partial(self._objective, parts)
        step = (self._loop_step if cohort.backend == "loop" else self._vmap_step)
        with without_head(parts.body):
            parts.body.train()
            parts.policy.train()
            for batch, active in cohort.lockstep(orders):
                grads, terms = step(cohort, parts, objective, batch, active)
                for i in active:
                    for view, g in zip(views[i], parts.views(grads[i]), strict=True):
                        view.grad = g
                    optimizers[i].step()
                    for view in views[i]:
                        view.grad = None
                    ce, mmd = terms[i]
                    n = len(batch[i])
                    sums[i][0] += float(ce) * n
                    sums[i][1] += float(mmd) * n
                    sums[i][2] += n
                    sums[i][3] += 1
        return [(ce, mmd, seen, steps) for ce, mmd, seen, steps in sums]

    @staticmethod
    def _loop_step(cohort: Cohort, parts: _CohortParts, objective: Callable, batch: list,
                   active: list[int]) -> tuple[dict, dict]:
        """Each active client's gradients on its exact batch, one client at a time."""
        grad = grad_and_value(objective, has_aux=True)
        grads, terms = {}, {}
        for i in active:
            x, y = cohort.batch(i, batch[i])
            fixed = _rows(parts.fixed, i)
            with torch.no_grad():
                reference = functional_call(parts.body, fixed["body"], (x,))
            g, (_, terms[i]) = grad(_rows(parts.trained, i), fixed, parts.vectors[i],
                                    reference, x, y)
            grads[i] = g
        return grads, terms

    @staticmethod
    def _vmap_step(cohort: Cohort, parts: _CohortParts, objective: Callable, batch: list,
                   active: list[int]) -> tuple[dict, dict]:
        """Every active client's gradients in one vmapped call over padded, masked batches."""
        x, y, mask = cohort.padded(batch, active)
        chosen = (slice(None) if len(active) == len(cohort)
                  else torch.tensor(active, device=cohort.device))
        trained, fixed = _rows(parts.trained, chosen), _rows(parts.fixed, chosen)
        with torch.no_grad():
            reference = vmap(lambda p, inputs: functional_call(parts.body, p, (inputs,)))(
                fixed["body"], x)
        g, (_, (ce, mmd)) = vmap(grad_and_value(objective, has_aux=True))(
            trained, fixed, parts.vectors[chosen], reference, x, y, mask)
        return ({i: _rows(g, k) for k, i in enumerate(active)},
                {i: (ce[k], mmd[k]) for k, i in enumerate(active)})

    def evaluate_cohort(self, cohort: Cohort, received: Sequence[Received],
                        states: Sequence[FedCPClientState]) -> list[dict]:
        def new_model(state: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
            return cohort.new_model(state)

        out = []
        for i, (r, state) in enumerate(zip(received, states, strict=True)):
            global_result = cohort.test(cohort.model(r.model, "global"), i)
            personalized = self._personalized(new_model, cohort.seed, cohort.device, r, state)
            out.append(cohort.eval_metrics(cohort.test(personalized, i), global_result))
        return out

    # --- server --------------------------------------------------------------------------------
    @staticmethod
    def _features(server: ServerRuntime) -> int:
        return head_of(server.template_model())[1].in_features

    def init_server(self, server: ServerRuntime, model: State) -> FedCPServerState:
        policy = new_policy(self._features(server), server.seed)
        return FedCPServerState(model=model, cpn={k: v.detach().numpy().copy()
                                                  for k, v in policy.state_dict().items()})

    def reply_arrays(self, server: ServerRuntime) -> dict[str, FlatSpec]:
        return {CPN: _policy_spec(self._features(server))}

    def train_payload(self, server: ServerRuntime, state: FedCPServerState, client: int,
                      server_round: int) -> Payload:
        return Payload({MODEL: server.shared_model(state), CPN: state.cpn})

    eval_payload = train_payload

    def aggregate(self, server: ServerRuntime, state: FedCPServerState, server_round: int,
                  updates: Sequence[Update]) -> tuple[FedCPServerState, dict[str, float]]:
        weights = [u.num_examples for u in updates]
        model = server.average([u.model for u in updates], weights)
        cpn = server.average([u.arrays[CPN] for u in updates], weights,
                             FlatSpec.of(updates[0].arrays[CPN]))
        return dataclasses.replace(server.with_model(state, model), cpn=cpn), {}


Stacked = dict[str, torch.Tensor]



def _rows(tree: dict[str, Stacked], rows: int | slice | torch.Tensor) -> dict[str, Stacked]:
    """The entries of client(s) ``rows`` of a two-level dict of stacked tensors."""
    return {part: {k: v[rows] for k, v in entries.items()} for part, entries in tree.items()}


class _CohortParts:
    """A cohort's FedCP models, stacked (leading client dimension), as :meth:`FedCP.train`
    builds them per client: ``trained`` holds the extractors ``body`` (the received model but
    its head), personalized heads ``head`` (the state's, or the run's initial head) and CPNs
    ``cpn`` (the received one), in the order a client's optimizer steps them; ``fixed`` holds
    the frozen copies of the received extractors ``body`` and the global heads ``head``;
    ``vectors`` the clients' ``v_i / ||v_i||``. ``body``, ``head`` and ``policy`` are modules
    run functionally (their own tensors are never used)."""

    def __init__(self, cohort: Cohort, received: Sequence[Received],
                 states: Sequence[FedCPClientState]):
        self.body = cohort.new_model()
        self.name, self.head = head_of(self.body)
        prefix = f"{self.name}."
        body_names = [n for n, _ in self.body.named_parameters() if not n.startswith(prefix)]
        head_names = [n for n, _ in self.head.named_parameters()]
        self.policy = new_policy(self.head.in_features, cohort.seed).to(cohort.device)
        policy_names = [n for n, _ in self.policy.named_parameters()]
        initial_head = head_of(cohort.template)[1].state_dict()
        heads = [s.head or initial_head for s in states]

        def stack(records: Sequence[Mapping[str, torch.Tensor]], names: Sequence[str],
                  prefix: str = "") -> Stacked:
            return {n: torch.stack([torch.as_tensor(r[prefix + n]) for r in records]).to(
                cohort.device) for n in names}

        models = [r.model for r in received]
        self.trained = {"body": stack(models, body_names), "head": stack(heads, head_names),
                        "cpn": stack([r.arrays[CPN] for r in received], policy_names)}
        self.fixed = {"body": stack(models, body_names), "head": stack(models, head_names, prefix)}
        self.vectors = torch.stack([client_vector(self.trained["head"]["weight"][i])
                                    for i in range(len(cohort))])

    def views(self, tree: dict[str, Stacked], i: int | None = None) -> list[torch.Tensor]:
        """Client ``i``'s entries of ``tree`` (shaped as :attr:`trained`; one client's
        gradients when ``i`` is None), in the order :meth:`FedCP.train`'s optimizer steps them:
        extractor, personalized head, CPN."""
        return [tree[part][k] if i is None else tree[part][k][i]
                for part, entries in self.trained.items() for k in entries]
