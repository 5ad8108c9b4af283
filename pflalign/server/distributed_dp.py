"""``dp = distributed``: the parameters and the accounting of the distributed discrete Gaussian
mechanism (Kairouz, Liu and Steinke, ICML 2021; the arithmetic is
:mod:`pflalign.training.ddgauss`).

Each of the round's ``n`` clients clips its update to ``c``, scales it by ``1 / gamma``, rotates
it, rounds it to integers within ``Delta_2`` and adds discrete Gaussian noise ``N_Z(0,
sigma^2)`` before secure aggregation masks it; the server learns only the sum, whose noise
(``n`` such draws) no single party knows.

**Sensitivity** (integer units). The rounded vector's L2 norm is at most (Theorem 1, with the
rounding repeated until it holds, which one try does with probability at least ``1 - beta``):

    Delta_2 = min(c/gamma + sqrt(d),
                  sqrt((c/gamma)^2 + d/4 + sqrt(2 log(1/beta)) (c/gamma + sqrt(d)/2)))

and, its coordinates being integers, its L1 norm at most ``Delta_1 = Delta_2 min(sqrt(d),
Delta_2)`` (``d``: the padded dimension).

**Two guarantees.** The paper's bound holds for neighbouring inputs that differ in one client's
vector, every client's noise present (a client's update replaced by zeros, its noise kept).

- ``dp-epsilon``: for whoever sees the released models but not who took part in a round (what
  central DP's ``dp-epsilon`` states): each round at its sample rate, amplified by Poisson
  sampling (below), as the paper does. It is the one ``dp-epsilon`` calibrates.
- ``dp-epsilon-server``: against the server, which draws the sample and knows who took part:
  no amplification; each client's rounds in an unmasked sum composed at rate 1, each with the
  clients whose noise that sum held; the largest over the clients (:class:`ServerAccountant`).

**Privacy of one round** (Proposition 14): the sum of ``n`` independent ``N_Z(0, sigma^2)^d``
shifted by a vector within those norms has Renyi divergence of order ``alpha`` at most

    min( alpha/2 l_2^2 + tau d,
         alpha/2 (l_2^2 + 2 l_1 tau + tau^2 d),
         alpha/2 (l_2 + sqrt(d) tau)^2 )

with ``l_p = Delta_p / (sqrt(n) sigma)`` and ``tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k /
(k + 1))`` (how far a sum of discrete Gaussians is from one discrete Gaussian), for ``sigma >=
1/2`` (below it no bound is claimed: infinite). A round that samples each client with
probability ``q < 1`` (Poisson sampling) is amplified by Zhu and Wang's bound for
Poisson-subsampled RDP ("Poisson Subsampled Renyi Differential Privacy", ICML 2019, Theorem 9),
as the paper does; rounds compose by adding their RDP, converted to (epsilon, delta) as the
central accountant does (Balle et al. 2020, Opacus's ``get_privacy_spent``). Each round is
accounted with the number of clients whose noise its sum holds (the survivors the server
unmasked): a round with dropouts costs more. A round that released nothing (fewer than two
clients, or an unmasking that failed) is not accounted; the amplified bound does not cover what
the absence of a release could tell (with 1,000 clients at rate 0.1, fewer than two in a round
has a probability below 1e-40).

**Granularity.** ``gamma`` is chosen so that ``k`` standard deviations of every coordinate of the
sum fit within the modulus ``m = 2^32`` (the paper's Section 4.4 heuristic, solved here for
gamma), with ``k = sqrt(2 ln(2 d' / p))``, ``p = 1e-3`` (:func:`stddevs`): were the coordinates
Gaussian, the union bound would keep any of the ``d'`` from wrapping around with probability at
most ``p`` a round (at ``k`` = 4, the paper's choice, about 60 of the CNN's 2^20 would). A
coordinate of the rotated sum of ``n`` clipped updates has a spread of about
``n c / sqrt(d)``, and each client adds ``sigma_r^2`` of noise (``sigma_r = gamma sigma`` in
real units) and at most ``gamma^2 / 4`` of rounding variance:

    stddevs^2 (n^2 c^2 / d + n sigma_r^2) / gamma^2 + stddevs^2 n / 4 <= m^2 / 4.

**The noise.** With ``dp-noise-multiplier = z`` each client's real-unit noise is ``z c /
sqrt(n_0)``, so that a sum of ``n_0`` clients carries what central DP adds, ``z c``; with
``dp-epsilon`` the smallest such ``z`` whose run spends at most the target with ``n_0`` clients
in every round's sum (:func:`calibrate`). ``n_0`` is the expected clients a round ``m_e``, and
under Poisson sampling, whose rounds hold a random number of clients, three standard deviations
below it (``m_e - 3 sqrt(N q (1 - q))``, at least 1): the few rounds with fewer clients cost
more than planned, and every row's epsilon is the accountant's for the rounds as they were.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
from scipy.special import gammaln, logsumexp

from pflalign.server.privacy import quiet
from pflalign.settings.options import ConfigError
from pflalign.training.ddgauss import MODULUS, padded_size

#: the rounding's bias: each try stays within Delta_2 with probability at least 1 - beta (the
#: paper's choice, exp(-1/2))
BETA = math.exp(-0.5)
#: the probability a round that any coordinate of the sum wraps around the modulus may have,
#: were the coordinates Gaussian (:func:`stddevs`)
WRAP = 1e-3
#: the smallest per-client noise (integer units) the sum's bound holds for
MIN_SIGMA = 0.5
#: the Renyi orders: integers (Poisson subsampling's bound needs them), and a few large ones
ORDERS = np.array([*range(2, 129), 160, 192, 256, 384, 512], dtype=np.float64)


def stddevs(padded: int, wrap: float = WRAP) -> float:
    """``k``: the standard deviations of a coordinate of the sum the modulus holds, so that by the
    union bound over the ``padded`` coordinates a Gaussian sum wraps with probability at most
    ``wrap``: ``sqrt(2 ln(2 padded / wrap))``."""
    return math.sqrt(2 * math.log(2 * padded / wrap))


def rounded_l2_bound(l2: float, dim: int, beta: float = BETA) -> float:
    """``Delta_2``: the L2 norm a randomized rounding of a vector of norm at most ``l2`` (integer
    units, ``dim`` values) is conditioned to stay within (Theorem 1)."""
    if not 0 <= beta < 1:
        raise ValueError(f"beta must lie in [0, 1), got {beta}")
    first = l2 + math.sqrt(dim)
    if beta == 0:
        return first
    second = math.sqrt(l2 ** 2 + dim / 4 + math.sqrt(2 * math.log(1 / beta))
                       * (l2 + math.sqrt(dim) / 2))
    return min(first, second)


def rounded_l1_bound(l2: float, dim: int) -> float:
    """``Delta_1`` of an integer vector of L2 norm at most ``l2``: ``l2 min(sqrt(dim), l2)``."""
    return l2 * min(math.sqrt(dim), l2)


def tau(sigma: float, clients: int) -> float:
    """``10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k + 1))`` (0 for one client)."""
    k = np.arange(1, clients, dtype=np.float64)
    return float(10 * np.exp(-2 * math.pi ** 2 * sigma ** 2 * k / (k + 1)).sum())


def round_rdp(orders: np.ndarray, l1: float, l2: float, t: float, dim: int) -> np.ndarray:
    """Proposition 14's bound at ``orders`` for the normalized sensitivities ``l1``, ``l2`` and
    ``t`` = :func:`tau`."""
    orders = np.asarray(orders, dtype=np.float64)
    return np.minimum.reduce([orders / 2 * l2 ** 2 + t * dim,
                              orders / 2 * (l2 ** 2 + 2 * l1 * t + t ** 2 * dim),
                              orders / 2 * (l2 + math.sqrt(dim) * t) ** 2])


def poisson_subsampled(order: int, rate: float, rdp) -> float:
    """Zhu and Wang's upper bound (ICML 2019, Theorem 9) on the RDP of order ``order`` (an
    integer >= 2) of a mechanism with RDP ``rdp(orders)`` run on a Poisson sample of rate
    ``rate``; never more than the mechanism's own."""
    own = float(rdp(np.array([order], dtype=np.float64))[0])
    if rate >= 1:
        return own
    q, a = rate, int(order)
    log_terms = [(a - 1) * math.log1p(-q) + math.log(a * q - q + 1),
                 math.log(a * (a - 1) / 2) + 2 * math.log(q) + (a - 2) * math.log1p(-q)
                 + float(rdp(np.array([2.0]))[0])]
    if a >= 3:
        ls = np.arange(3, a + 1, dtype=np.float64)
        log_binomial = gammaln(a + 1) - gammaln(ls + 1) - gammaln(a - ls + 1)
        log_terms.extend((math.log(3) + log_binomial + (a - ls) * math.log1p(-q)
                          + ls * math.log(q) + (ls - 1) * rdp(ls)).tolist())
    return min(own, float(logsumexp(log_terms)) / (a - 1))


@dataclass(frozen=True)
class Mechanism:
    """One run's distributed discrete Gaussian: the clip ``c``, the grid ``gamma``, each client's
    noise ``sigma`` (integer units), the rounding's bound ``Delta_2`` and ``Delta_1``, the
    dimension ``dim`` (the exchanged floating-point values) and ``padded`` (the next power of
    two), ``expected`` (the denominator of the mean), ``noised_for`` (``n_0``: the clients whose
    summed noise is ``multiplier`` times the clip in real units, central DP's ``z``)."""

    clip: float
    gamma: float
    sigma: float
    dim: int
    padded: int
    l2: float
    l1: float
    expected: float
    multiplier: float
    noised_for: float
    beta: float = BETA

    @classmethod
    def build(cls, clip: float, multiplier: float, expected: float, dim: int,
              noised_for: float | None = None, beta: float = BETA, k: float | None = None,
              modulus: int = MODULUS) -> Mechanism:
        padded = padded_size(dim)
        k = stddevs(padded) if k is None else k
        noised_for = expected if noised_for is None else noised_for
        local = multiplier * clip / math.sqrt(noised_for)  # a client's noise, real units
        n = max(expected, 1.0)
        room = modulus ** 2 - k ** 2 * n
        if room <= 0:
            raise ConfigError(f"{n:g} clients a round cannot sum within the modulus 2^32 at "
                              f"{k:g} standard deviations")
        gamma = 2 * k * math.sqrt(n ** 2 * clip ** 2 / padded + n * local ** 2) / (
            math.sqrt(room))
        l2 = rounded_l2_bound(clip / gamma, padded, beta)
        return cls(clip=clip, gamma=gamma, sigma=local / gamma, dim=dim, padded=padded, l2=l2,
                   l1=rounded_l1_bound(l2, padded), expected=expected, multiplier=multiplier,
                   noised_for=noised_for, beta=beta)

    def rdp(self, clients: int, rate: float) -> np.ndarray:
        """The RDP at :data:`ORDERS` of one round whose sum holds ``clients`` clients' noise,
        sampled at ``rate`` (computed once per process for each)."""
        return _round_rdp(self, int(clients), float(rate)).copy()

    def _rdp(self, clients: int, rate: float) -> np.ndarray:
        if self.sigma < MIN_SIGMA:
            return np.full(ORDERS.size, math.inf)
        scale = math.sqrt(clients) * self.sigma
        t = tau(self.sigma, clients)

        def own(orders):
            return round_rdp(orders, self.l1 / scale, self.l2 / scale, t, self.padded)

        return np.array([poisson_subsampled(int(a), rate, own) for a in ORDERS])

    def epsilon(self, history: dict[int, int], rate: float, delta: float) -> float:
        """Epsilon at ``delta`` of the rounds in ``history`` (clients in the sum -> rounds)."""
        if not any(history.values()):
            return 0.0
        if self.sigma < MIN_SIGMA:
            return math.inf
        return epsilon_of_rdp(sum(rounds * self.rdp(clients, rate)
                                  for clients, rounds in history.items() if rounds), delta)


def epsilon_of_rdp(rdp: np.ndarray, delta: float) -> float:
    """(epsilon, ``delta``) of an RDP curve at :data:`ORDERS` (Opacus's conversion)."""
    from opacus.accountants.analysis.rdp import get_privacy_spent

    with quiet():
        eps, _ = get_privacy_spent(orders=ORDERS.tolist(), rdp=np.asarray(rdp).tolist(),
                                   delta=delta)
    return float(eps)


def epsilons_of_rdp(rdp: np.ndarray, delta: float) -> np.ndarray:
    """:func:`epsilon_of_rdp` of each row of ``rdp`` at once: Balle et al.'s conversion (AISTATS
    2020, Theorem 21), ``min_alpha rdp(alpha) - (log delta + log alpha) / (alpha - 1) + log((alpha
    - 1) / alpha)``, the formula Opacus applies to one curve."""
    orders = ORDERS[None, :]
    eps = (np.asarray(rdp, dtype=np.float64) - (math.log(delta) + np.log(orders)) / (orders - 1)
           + np.log((orders - 1) / orders))
    return np.min(eps, axis=1)


def noised_for(expected: float, clients: int, rate: float) -> float:
    """``n_0``: the clients a round's noise is sized for (the module docstring)."""
    if rate >= 1:
        return expected
    return max(1.0, math.floor(expected - 3 * math.sqrt(clients * rate * (1 - rate))))


@functools.lru_cache(maxsize=4096)
def _round_rdp(mechanism: Mechanism, clients: int, rate: float) -> np.ndarray:
    return mechanism._rdp(clients, rate)


def calibrate(target_epsilon: float, delta: float, clip: float, expected: float, dim: int,
              rate: float, rounds: int, noised: float | None = None,
              tolerance: float = 0.01) -> float:
    """The smallest noise multiplier ``z`` (within ``tolerance`` in epsilon, below the target)
    whose mechanism spends at most ``target_epsilon`` at ``delta`` in ``rounds`` rounds of
    ``noised`` (default: ``expected``) clients at ``rate``."""
    noised = expected if noised is None else noised
    clients = max(1, round(noised))

    def spent(z: float) -> float:
        return Mechanism.build(clip, z, expected, dim, noised).epsilon({clients: rounds}, rate,
                                                                       delta)

    low, high = 0.0, 1.0
    while spent(high) > target_epsilon:
        low, high = high, 2 * high
        if high > 1e6:
            raise ConfigError(f"dp-epsilon = {target_epsilon:g} cannot be reached by dp = "
                              f"'distributed' at dp-delta = {delta:g} in {rounds} rounds with "
                              "any noise multiplier up to 1e6; raise dp-epsilon or dp-delta.")
    while True:
        middle = (low + high) / 2
        eps = spent(middle)
        if eps > target_epsilon:
            low = middle
        else:
            high = middle
            if target_epsilon - eps <= tolerance:
                return high
        if high - low < 1e-6:
            return high


@dataclass
class DistributedAccountant:
    """The run's rounds as the accountant needs them: clients in the sum -> rounds."""

    mechanism: Mechanism
    delta: float
    rate: float
    history: dict[int, int] = field(default_factory=dict)

    def step(self, clients: int) -> None:
        self.history[clients] = self.history.get(clients, 0) + 1

    def epsilon(self) -> float:
        return self.mechanism.epsilon(self.history, self.rate, self.delta)

    def state_dict(self) -> dict:
        return {"rounds": {str(k): v for k, v in self.history.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.history = {int(k): int(v) for k, v in state["rounds"].items()}


@dataclass
class ServerAccountant:
    """``dp-epsilon-server``: each client's rounds in an unmasked sum (clients in the sum ->
    rounds, per client), at rate 1; the epsilon of the client that has spent most."""

    mechanism: Mechanism
    delta: float
    clients: dict[int, dict[int, int]] = field(default_factory=dict)

    def step(self, summed: list[int]) -> None:
        for client in summed:
            own = self.clients.setdefault(int(client), {})
            own[len(summed)] = own.get(len(summed), 0) + 1

    def epsilon(self) -> float:
        """The largest epsilon over the clients (0 before any sum)."""
        if not self.clients:
            return 0.0
        if self.mechanism.sigma < MIN_SIGMA:
            return math.inf
        sizes = sorted({n for own in self.clients.values() for n in own})
        column = {n: i for i, n in enumerate(sizes)}
        per_size = np.stack([self.mechanism.rdp(n, 1.0) for n in sizes])
        counts = np.zeros((len(self.clients), len(sizes)))
        for row, own in enumerate(self.clients.values()):
            for n, k in own.items():
                counts[row, column[n]] = k
        return float(epsilons_of_rdp(np.unique(counts, axis=0) @ per_size, self.delta).max())

    def state_dict(self) -> dict:
        return {"clients": {str(c): {str(n): k for n, k in own.items()}
                            for c, own in self.clients.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.clients = {int(c): {int(n): int(k) for n, k in own.items()}
                        for c, own in state.get("clients", {}).items()}
