"""User-level differential privacy for the uploads: the pieces that involve no engine.

DP-FedAvg (McMahan et al., "Learning Differentially Private Recurrent Language Models", ICLR
2018). A client's contribution to a round is its update ``delta_i`` (what it uploads minus the
model it received), clipped to the L2 norm ``C``:

    clip(delta_i) = delta_i * min(1, C / ||delta_i||)

and the server releases the noised sum, divided by a denominator fixed before the round (the
expected number of clients a round samples, ``m``), never by the count that replied:

    Delta = (sum_i clip(delta_i) + N(0, (z C)^2 I)) / m

Adding or removing one client changes the sum by at most ``C`` in L2 norm, so each round is the
Gaussian mechanism with noise multiplier ``z`` on a sensitivity-``C`` query; a round that samples
each client independently with probability ``q`` (Poisson sampling) is the sampled Gaussian
mechanism, whose privacy the Renyi-DP accountant tracks (:class:`Accountant`).

Adaptive clipping (Andrew et al., "Differentially Private Learning with Adaptive Clipping",
NeurIPS 2021): ``C`` follows a target quantile ``gamma`` of the clients' update norms. Each client
also reports whether its norm was within ``C`` (``b_i`` in {0, 1}); the server releases the noised
fraction ``b = (sum_i (b_i - 1/2) + N(0, sigma_b^2)) / m + 1/2`` and moves the bound
geometrically, ``C <- C exp(-eta (b - gamma))``. The count has sensitivity 1/2, so for the two
releases together to cost what one Gaussian release at multiplier ``z`` does, the updates' sum
gets the multiplier ``z_delta = (z^-2 - (2 sigma_b)^-2)^-1/2`` (:func:`update_noise_multiplier`).

Noise is drawn from a generator keyed by (seed, round, stream), so a resumed run draws what the
uninterrupted one did.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from pflalign.server.sampling import sorted_ids
from pflalign.settings.options import ConfigError
from pflalign.training.privacy import clip, gaussian_noise, noise_rng

#: the random stream of a round's Poisson draw of clients (``sampling = poisson``)
POISSON_STREAM = 32


def noised_mean(deltas: Sequence[np.ndarray], bound: float, std: float, denominator: float,
                rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """DP-FedAvg's release: ``(sum_i clip(delta_i) + N(0, std^2 I)) / denominator`` and the
    clients' norms before clipping. ``std`` is ``z_delta * bound``; an empty round releases the
    noise alone."""
    if not denominator > 0:
        raise ValueError(f"the denominator must be positive, got {denominator}")
    if not deltas:
        raise ValueError("noised_mean needs the size of the update: pass at least one delta")
    total = np.zeros(np.shape(deltas[0]), dtype=np.float64)
    norms = np.empty(len(deltas))
    for i, delta in enumerate(deltas):
        clipped, norms[i] = clip(delta, bound)
        total += clipped
    total += gaussian_noise(total.size, std, rng).reshape(total.shape)
    return total / denominator, norms


def update_noise_multiplier(noise_multiplier: float, count_std: float) -> float:
    """The updates' noise multiplier ``z_delta`` when a clip count with noise ``count_std``
    (sigma_b) is released beside them, so that both together cost one release at
    ``noise_multiplier`` (Andrew et al. 2021, Theorem 1): ``(z^-2 - (2 sigma_b)^-2)^-1/2``.
    Without a count (``count_std`` = 0: a fixed clip) it is ``z`` itself."""
    if noise_multiplier == 0 or count_std == 0:
        return noise_multiplier
    rest = noise_multiplier ** -2 - (2 * count_std) ** -2
    if rest <= 0:
        raise ValueError(f"the clip count's noise ({count_std:g}) must exceed z / 2 = "
                         f"{noise_multiplier / 2:g} for the updates to get any of the noise "
                         f"budget (z = {noise_multiplier:g})")
    return rest ** -0.5


def adapt_clip(bound: float, norms: Sequence[float], quantile: float, lr: float,
               count_std: float, denominator: float, rng: np.random.Generator) -> float:
    """The next round's bound (Andrew et al. 2021, geometric update):
    ``C exp(-lr (b - quantile))`` with ``b`` the noised fraction of clients whose update norm was
    within ``C``, ``(sum_i (1[norm_i <= C] - 1/2) + N(0, count_std^2)) / denominator + 1/2``."""
    centred = sum((1.0 if n <= bound else 0.0) - 0.5 for n in norms)
    fraction = (centred + float(gaussian_noise(1, count_std, rng)[0])) / denominator + 0.5
    return float(bound * math.exp(-lr * (fraction - quantile)))


def poisson_sample(pool: Sequence[int], rate: float, seed: int, server_round: int) -> list[int]:
    """Each client of ``pool`` independently with probability ``rate`` (possibly none), sorted;
    reproducible from (seed, round) and the same for every method."""
    ordered = sorted_ids(pool)
    rng = np.random.default_rng([seed, server_round, POISSON_STREAM])
    keep = rng.random(len(ordered)) < rate
    return ordered[keep].tolist()


@dataclass
class Accountant:
    """The run's privacy loss so far, by Opacus's Renyi-DP accountant of the sampled Gaussian
    mechanism (Mironov, Talwar and Zhang, "Renyi Differential Privacy of the Sampled Gaussian
    Mechanism", 2019), converted to (epsilon, delta) by Balle et al. (AISTATS 2020, Theorem 21).

    ``sample_rate`` is the probability that a round includes a given client: ``q`` under Poisson
    sampling; 1 under fixed-size sampling, whose rounds are then composed without amplification
    by sampling (a valid bound for any way of choosing the clients, and a loose one)."""

    delta: float
    sample_rate: float
    #: (noise multiplier, sample rate, rounds) runs, as Opacus keeps them
    history: list[tuple[float, float, int]] = field(default_factory=list)

    def step(self, noise_multiplier: float, rounds: int = 1) -> None:
        """Account ``rounds`` more releases at ``noise_multiplier``."""
        if self.history and self.history[-1][:2] == (noise_multiplier, self.sample_rate):
            z, q, n = self.history[-1]
            self.history[-1] = (z, q, n + rounds)
        else:
            self.history.append((noise_multiplier, self.sample_rate, rounds))

    def epsilon(self) -> float:
        """Epsilon spent so far at the run's delta (0 before any release; inf without noise)."""
        return epsilon_of(self.history, self.delta)

    def state_dict(self) -> dict:
        return {"history": [list(h) for h in self.history]}

    def load_state_dict(self, state: dict) -> None:
        self.history = [(float(z), float(q), int(n)) for z, q, n in state["history"]]


def epsilon_of(history: Sequence[tuple[float, float, int]], delta: float) -> float:
    """Epsilon at ``delta`` of the composed ``(noise multiplier, sample rate, rounds)`` runs."""
    if not history:
        return 0.0
    if any(z == 0 for z, _, n in history if n):
        return math.inf
    from opacus.accountants import RDPAccountant  # imported only for a run with dp

    accountant = RDPAccountant()
    accountant.history = [tuple(h) for h in history]
    with quiet():
        return float(accountant.get_epsilon(delta=delta, alphas=alphas()))


@contextmanager
def quiet() -> Iterator[None]:
    """Without Opacus's warning that the best Renyi order is the largest or smallest tried:
    :func:`alphas` goes far enough for a useful bound, :func:`calibrate`'s search tries noises
    far past any that a run takes, and a noise so small that the smallest order is best spends
    an epsilon far beyond any useful one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the (largest|smallest) alpha")
        yield


def alphas() -> list[float]:
    """The Renyi orders the accountant minimises over: Opacus's defaults (1.1 to 63) and larger
    ones, which the few, heavily noised releases of a federated run (sample rate 1 under
    fixed-size sampling) need for a tight bound."""
    from opacus.accountants.rdp import RDPAccountant

    return [*RDPAccountant.DEFAULT_ALPHAS, 80, 96, 128, 192, 256, 384, 512, 1024]


def calibrate(target_epsilon: float, delta: float, sample_rate: float, rounds: int,
              tolerance: float = 0.01) -> float:
    """The smallest noise multiplier (within ``tolerance`` of the target in epsilon) whose
    ``rounds`` releases at ``sample_rate`` spend at most ``target_epsilon`` at ``delta``
    (Opacus's search); a target no noise reaches is one sentence."""
    from opacus.accountants.utils import get_noise_multiplier

    try:
        with quiet():
            return float(get_noise_multiplier(
                target_epsilon=target_epsilon, target_delta=delta, sample_rate=sample_rate,
                steps=rounds, accountant="rdp", epsilon_tolerance=tolerance, alphas=alphas()))
    except ValueError as error:
        raise ConfigError(f"dp-epsilon = {target_epsilon:g} cannot be reached at dp-delta = "
                          f"{delta:g} in {rounds} rounds at a sample rate of {sample_rate:g} "
                          f"with any noise multiplier up to 1e6, or lies below what the "
                          "accountant's largest Renyi order (1024) can bound at this delta "
                          f"({error}); raise dp-epsilon or dp-delta, or run fewer "
                          "rounds.") from None


def sample_rate(run: object) -> float:
    """The probability that a round includes a given training client, as the accountant takes
    it: ``fraction-train`` under ``sampling = poisson``; 1 under fixed-size sampling (no
    amplification by sampling is claimed for a draw of a fixed number of clients)."""
    return float(run.fraction_train) if run.sampling == "poisson" else 1.0


def run_noise_multiplier(run: object) -> float:
    """The run's noise multiplier ``z``: ``dp-noise-multiplier``, or, with ``dp-epsilon`` > 0,
    the smallest that spends at most that epsilon in the run's rounds (:func:`calibrate`; under
    ``dp = local``, twice the multiplier found for one client taking part in every round, as
    its release's sensitivity is the clip ball's diameter, :func:`local_multiplier`)."""
    if run.dp_epsilon > 0:
        if run.dp == "local":
            return 2 * _calibrated(run.dp_epsilon, run.dp_delta, 1.0, run.rounds)
        return _calibrated(run.dp_epsilon, run.dp_delta, sample_rate(run), run.rounds)
    return float(run.dp_noise_multiplier)


@functools.lru_cache(maxsize=32)
def _calibrated(target_epsilon: float, delta: float, rate: float, rounds: int) -> float:
    """:func:`calibrate`, once per process for a run (each client of ``dp = local`` needs it)."""
    return calibrate(target_epsilon, delta, rate, rounds)


def privacy_warnings(run: object, clients: int) -> list[str]:
    """What a run with ``dp`` and ``clients`` training clients should be warned of: no noise
    (no guarantee), and a ``dp-delta`` of at least 1 / clients (a guarantee that may fail with
    that probability allows releasing one client's data whole)."""
    if run.dp == "off":
        return []
    out = []
    if run_noise_multiplier(run) == 0:
        out.append(f"dp = {run.dp!r} with dp-noise-multiplier = 0 clips the updates and adds no "
                   "noise: there is no privacy guarantee, and no epsilon is reported.")
    if run.dp_delta * clients >= 1:
        out.append(f"dp-delta = {run.dp_delta:g} is at least 1 / {clients} (the training "
                   "clients): a guarantee that may fail with that probability allows releasing "
                   "one client's data whole; set dp-delta well below 1 / the number of clients "
                   "(1e-5 for 1,000 clients).")
    return out


def local_multiplier(noise_multiplier: float) -> float:
    """The noise multiplier a ``dp = local`` release is accounted at: a client's noise is
    ``z C`` and two of its possible updates can differ by ``2 C`` (any two points of the clip
    ball: local DP protects every input of the client, not its presence), so ``z / 2``."""
    return noise_multiplier / 2


def count_noise(run: object, expected_clients: float, noise_multiplier: float) -> float:
    """The clip count's noise ``sigma_b`` (adaptive clipping with noise only, else 0):
    ``dp-count-noise``, or the larger of the expected clients a round / 20 (Andrew et al.'s
    choice) and the noise multiplier ``z`` (with few clients a round, m / 20 would leave the
    updates no budget: ``sigma_b`` must exceed ``z / 2``; at ``z`` the updates' multiplier is
    ``z / sqrt(3/4)``, 15% more)."""
    if run.dp_clipping != "adaptive" or noise_multiplier == 0:
        return 0.0
    if run.dp_count_noise > 0:
        return float(run.dp_count_noise)
    return max(expected_clients / 20, noise_multiplier)


@dataclass
class Released:
    """One round's private release: the new values of the released entries (the clipped, noised
    mean update added to the model the round started from), and the round row's entries."""

    model: dict[str, np.ndarray]
    entries: dict[str, float]


class CentralPrivacy:
    """``dp = central`` for one run: the server clips each client's update, releases their noised
    sum over a fixed denominator (:func:`noised_mean`), adapts the clip (``dp-clipping =
    adaptive``) and accounts for every training round.

    ``spec`` packs the released entries (the exchanged floating-point arrays: every array a
    client uploads that is averaged; integer counters keep the server's value);
    ``expected_clients`` is the denominator ``m``: the fixed round size, or ``q`` times the
    training clients under Poisson sampling."""

    def __init__(self, run: object, seed: int, spec: object, expected_clients: float):
        self.seed = seed
        self.spec = spec
        self.expected_clients = float(expected_clients)
        self.noise_multiplier = run_noise_multiplier(run)
        self.count_std = count_noise(run, self.expected_clients, self.noise_multiplier)
        #: the updates' share of the noise (all of it with a fixed clip)
        self.update_multiplier = update_noise_multiplier(self.noise_multiplier, self.count_std)
        self.adaptive = run.dp_clipping == "adaptive"
        self.quantile = run.dp_clip_quantile
        self.lr = run.dp_clip_lr
        #: the clip of the next round
        self.bound = float(run.dp_clip)
        self.accountant = Accountant(run.dp_delta, sample_rate(run))

    def release(self, base: dict[str, np.ndarray], uploads: Sequence[dict[str, np.ndarray]],
                server_round: int) -> Released:
        """The round's release from the clients' uploaded models (each update over ``base``
        clipped to the round's bound, noise added to their sum, divided by the expected clients),
        then the next round's clip. With no upload, the noise alone is released (the round
        happened; who took part is private)."""
        start = self.spec.flatten(base, np.float64)
        deltas = [self.spec.flatten(u, np.float64) - start for u in uploads] or \
            [np.zeros(self.spec.size)]
        rng = noise_rng(self.seed, server_round)
        bound = self.bound
        mean, norms = noised_mean(deltas, bound, self.update_multiplier * bound,
                                  self.expected_clients, rng)
        if not uploads:
            norms = norms[:0]
        if self.adaptive:  # the count's noise comes after the sum's, from the same stream
            self.bound = adapt_clip(bound, norms, self.quantile, self.lr, self.count_std,
                                    self.expected_clients, rng)
        return Released(self.spec.unflatten(start + mean), {"dp-clip": bound})

    def release_sum(self, base: dict[str, np.ndarray], total: np.ndarray,
                    server_round: int) -> Released:
        """The round's release from the sum of the clients' updates, each clipped to the bound
        on its client (secure aggregation: the server sees only the sum): that sum plus the
        noise of :meth:`release` (the same stream and standard deviation), divided by the
        expected clients. A fixed clip only (an adaptive one needs each client's clipped
        bit)."""
        rng = noise_rng(self.seed, server_round)
        noised = total + gaussian_noise(total.size, self.update_multiplier * self.bound,
                                        rng).reshape(total.shape)
        start = self.spec.flatten(base, np.float64)
        return Released(self.spec.unflatten(start + noised / self.expected_clients),
                        {"dp-clip": self.bound})

    def account(self) -> dict[str, float]:
        """Account one training round (whether or not any client's update was used: who took
        part is not released) and return the row's epsilon spent so far; without noise, no
        epsilon is reported (there is no guarantee)."""
        self.accountant.step(self.noise_multiplier)
        if self.noise_multiplier == 0:
            return {}
        return {"dp-epsilon": self.accountant.epsilon()}

    def state_dict(self) -> dict:
        """The clip, the accountant's history and the noise's key (the seed, or dp-secure's
        secret: a checkpoint is the server's own)."""
        return {"clip": self.bound, "key": self.seed, **self.accountant.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.bound = float(state["clip"])
        self.seed = int(state.get("key", self.seed))
        self.accountant.load_state_dict(state)
