"""SecAgg+, the secure aggregation protocol of Bell et al., "Secure single-server aggregation with
(poly)logarithmic overhead", CCS 2020: the server learns the sum of the clients' vectors and
nothing else, and the sum survives clients that drop out after sharing their keys.

Its building blocks are Flower's (``flwr.common.secure_aggregation`` and
``flwr.supercore.primitives.asymmetric``: ECDH key pairs on SECP384R1, HKDF-SHA256 shared keys,
Fernet encryption, Shamir secret sharing); the stages are written here over this project's own
messages: Flower's ``SecAggPlusWorkflow`` (flwr 1.42) runs only under a ``LegacyContext``, through
a strategy's ``configure_fit`` and ``aggregate_fit``, and gives back a weighted average of one
array record; its ``secaggplus_mod`` masks only a legacy ``fitres.parameters`` reply and empties
every other array record. This project's rounds send their own records and need the sum.

The stages of one round, for the clients ``U`` that take part, each with its neighbours ``N(u)``
in a ``neighbours``-regular graph (:func:`graph`; every other client when the round is smaller):

1. :func:`setup`: each client draws two key pairs (``c`` to encrypt shares, ``s`` for the
   pairwise masks) and a 32-byte self-mask seed ``b_u``; it sends the public keys.
2. :func:`share_keys`: each client splits ``b_u`` and its ``s`` secret key into Shamir shares
   (``threshold`` of them rebuild a secret) and sends neighbour ``v`` its two shares encrypted with
   the key ``KA(c_u, c_v)``.
3. :func:`masked_input`: each client decrypts the shares it was sent, and sends
   ``y_u = x_u + PRG(b_u) + sum_{v in N(u)} sign(u, v) PRG(KA(s_u, s_v)) mod M``, with ``x_u``
   its quantized vector (:func:`quantize`) and ``sign(u, v) = +1`` for ``u < v``, else ``-1``.
4. :func:`unmask`: given which neighbours sent ``y_v``, each surviving client reveals its share of
   ``b_v`` for a survivor ``v`` and of ``s_v``'s secret key for a dropped one.

:func:`unmasked_sum` (the server) rebuilds each survivor's ``b_v`` and each dropped client's secret
key from ``threshold`` shares, and removes the self masks and the pairwise masks the dropped
clients' neighbours added: what remains is ``sum_{u surviving} x_u mod M``. A client that drops
before sending its masked vector is left out of the sum; one that drops after sending it is
still in it (its self mask is rebuilt from its neighbours' shares). The masks are drawn from
NumPy's PCG64 seeded by the whole 32-byte secret. (Flower is imported only when a stage runs, so
an engine that never runs one does not load it.)

Quantization (:func:`quantize`): each value is clipped to ``[-clip, clip]``, mapped to ``[0, T]``
and stochastically rounded; the sum of ``n`` such vectors dequantizes to within ``n * 2 clip / T``
of the sum of the clipped values, per coordinate (each rounding moves a value by less than one
step ``2 clip / T``), as long as ``n T < M`` (no wrap-around).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

SEED_BYTES = 32


@dataclass(frozen=True)
class Params:
    """A round's protocol parameters: ``threshold`` shares rebuild a secret; each client has
    ``neighbours`` neighbours (at most the round's other clients); values are clipped to
    ``[-clip, clip]`` and quantized to ``[0, target]``; sums are taken mod ``modulus``."""

    threshold: int
    neighbours: int
    clip: float
    target: int = 1 << 22
    modulus: int = 1 << 32

    def check(self, clients: int) -> None:
        if clients * self.target >= self.modulus:
            raise ValueError(f"{clients} clients' sum of values up to {self.target} wraps the "
                             f"modulus {self.modulus}.")

    def error_bound(self, clients: int) -> float:
        """How far the dequantized sum of ``clients`` vectors may lie from the sum of their
        clipped values, per coordinate."""
        return clients * 2 * self.clip / self.target


@dataclass
class ClientSecrets:
    """What one client keeps between the stages: its secret keys, its self-mask seed, its
    neighbours' public keys, and the shares its neighbours sent it."""

    id: int
    enc_key: bytes
    mask_key: bytes
    seed: bytes
    public: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    #: neighbour -> (its share of that neighbour's seed, of its mask key), and its own
    shares: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)


# --- the graph ------------------------------------------------------------------------------
def graph(clients: Sequence[int], neighbours: int, rng: np.random.Generator,
          ) -> dict[int, tuple[int, ...]]:
    """Each client's neighbours: the clients in a random order, each joined to the
    ``neighbours // 2`` on either side (a Harary graph on a shuffled ring; Bell et al. 2020,
    section 3); every other client when ``neighbours >= len(clients) - 1``."""
    clients = sorted(clients)
    if neighbours >= len(clients) - 1:
        return {c: tuple(o for o in clients if o != c) for c in clients}
    order = [clients[i] for i in rng.permutation(len(clients))]
    half, n = max(1, neighbours // 2), len(order)
    links: dict[int, set[int]] = {c: set() for c in clients}
    for i, c in enumerate(order):
        for step in range(1, half + 1):
            other = order[(i + step) % n]
            links[c].add(other)
            links[other].add(c)
    return {c: tuple(sorted(links[c])) for c in clients}


# --- quantization ----------------------------------------------------------------------------
def quantize(values: np.ndarray, params: Params, rng: np.random.Generator) -> np.ndarray:
    """``values`` clipped to ``[-clip, clip]``, mapped to ``[0, target]`` and stochastically
    rounded (unbiased), as int64."""
    scaled = (np.clip(values, -params.clip, params.clip) + params.clip) * (
        params.target / (2 * params.clip))
    low = np.floor(scaled)
    return (low + (rng.random(scaled.shape) < scaled - low)).astype(np.int64)


def dequantize_sum(total: np.ndarray, clients: int, params: Params) -> np.ndarray:
    """The sum of ``clients`` values from the sum of their quantized values."""
    return total.astype(np.float64) * (2 * params.clip / params.target) - clients * params.clip


# --- the client's stages ---------------------------------------------------------------------
def setup(client: int) -> tuple[ClientSecrets, tuple[bytes, bytes]]:
    """Stage 1: the client's secrets, and the two public keys it sends."""
    from flwr.supercore.primitives.asymmetric import (
        generate_key_pairs,
        private_key_to_bytes,
        public_key_to_bytes,
    )

    enc_sk, enc_pk = generate_key_pairs()
    mask_sk, mask_pk = generate_key_pairs()
    secrets = ClientSecrets(client, private_key_to_bytes(enc_sk), private_key_to_bytes(mask_sk),
                            np.random.default_rng().bytes(SEED_BYTES))
    return secrets, (public_key_to_bytes(enc_pk), public_key_to_bytes(mask_pk))


def _channel_key(own_private: bytes, other_public: bytes) -> bytes:
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
    from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

    return generate_shared_key(bytes_to_private_key(own_private),
                               bytes_to_public_key(other_public))


def share_keys(secrets: ClientSecrets, public: Mapping[int, tuple[bytes, bytes]],
               threshold: int) -> dict[int, bytes]:
    """Stage 2: given its neighbours' public keys (``public``, its own included), the shares of
    its seed and mask key for each neighbour, encrypted for it (its own share it keeps)."""
    from flwr.common.secure_aggregation.crypto.shamir import create_shares
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import encrypt

    secrets.public = dict(public)
    others = sorted(c for c in public if c != secrets.id)
    members = sorted(public)
    if threshold > len(members):
        raise ValueError(f"threshold {threshold} exceeds the {len(members)} clients that hold "
                         "shares.")
    seed_shares = create_shares(secrets.seed, threshold, len(members))
    key_shares = create_shares(secrets.mask_key, threshold, len(members))
    out = {}
    for index, member in enumerate(members):
        pair = (seed_shares[index], key_shares[index])
        if member == secrets.id:
            secrets.shares[secrets.id] = pair
            continue
        payload = len(pair[0]).to_bytes(4, "little") + pair[0] + pair[1]
        out[member] = encrypt(_channel_key(secrets.enc_key, public[member][0]), payload)
    assert set(out) == set(others)
    return out


def _prg(seed: bytes, size: int, modulus: int) -> np.ndarray:
    """``size`` pseudo-random values in ``[0, modulus)`` from ``seed``: uint32 for the modulus
    2^32 (whose sums then wrap by themselves), else uint64."""
    gen = np.random.Generator(np.random.PCG64(int.from_bytes(seed, "little")))
    if modulus == 1 << 32:
        return np.frombuffer(gen.bytes(4 * size), dtype="<u4").astype(np.uint32)
    return gen.integers(0, modulus, size=size, dtype=np.uint64)


def _add(total: np.ndarray, values: np.ndarray, modulus: int, sign: int = 1) -> np.ndarray:
    """``total + sign * values`` mod ``modulus``, in place where the modulus is 2^32 (uint32
    arithmetic wraps around by itself)."""
    if total.dtype == np.uint32:
        if sign > 0:
            total += values
        else:
            total -= values
        return total
    return (total + values) % modulus if sign > 0 else (total + modulus - values) % modulus


def _start(vector: np.ndarray, modulus: int) -> np.ndarray:
    """A vector mod ``modulus``, as the dtype its sums are taken in (a copy)."""
    if modulus == 1 << 32:
        return (np.asarray(vector).astype(np.uint64) % modulus).astype(np.uint32)
    return np.asarray(vector, dtype=np.uint64) % modulus


def _pair_seed(own_mask_key: bytes, other_mask_public: bytes) -> bytes:
    return _channel_key(own_mask_key, other_mask_public)


def masked_input(secrets: ClientSecrets, received: Mapping[int, bytes], vector: np.ndarray,
                 modulus: int) -> np.ndarray:
    """Stage 3: decrypt the shares the neighbours sent (``received``: sender -> ciphertext),
    and mask the quantized ``vector``."""
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt

    for sender, ciphertext in received.items():
        payload = decrypt(_channel_key(secrets.enc_key, secrets.public[sender][0]), ciphertext)
        length = int.from_bytes(payload[:4], "little")
        secrets.shares[sender] = (payload[4:4 + length], payload[4 + length:])
    masked = _add(_start(vector, modulus), _prg(secrets.seed, vector.size, modulus), modulus)
    for other, (_, mask_public) in secrets.public.items():
        if other == secrets.id:
            continue
        pair = _prg(_pair_seed(secrets.mask_key, mask_public), vector.size, modulus)
        masked = _add(masked, pair, modulus, 1 if secrets.id < other else -1)
    return masked.astype(np.uint64)


def unmask(secrets: ClientSecrets, survivors: Sequence[int], dropped: Sequence[int],
           ) -> dict[int, bytes]:
    """Stage 4: its share of each surviving neighbour's seed and of each dropped neighbour's
    mask key (never both for one client)."""
    out = {v: secrets.shares[v][0] for v in survivors if v in secrets.shares}
    out.update({v: secrets.shares[v][1] for v in dropped if v in secrets.shares})
    return out


# --- the server ------------------------------------------------------------------------------
def unmasked_sum(masked: Mapping[int, np.ndarray], public: Mapping[int, Mapping[int, tuple]],
                 shares: Mapping[int, Mapping[int, bytes]], params: Params) -> np.ndarray:
    """The sum mod ``modulus`` of the survivors' quantized vectors: ``masked`` (survivor ->
    ``y_u``), ``public`` (each client that shared keys -> the public keys of its neighbours and
    its own), ``shares`` (each client that answered stage 4 -> its revealed shares). Raises
    ValueError when fewer than ``threshold`` shares of a secret came back."""
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares

    survivors = sorted(masked)
    modulus, size = params.modulus, next(iter(masked.values())).size
    total = _start(np.zeros(size, dtype=np.uint64), modulus)
    for u in survivors:
        total = _add(total, _start(masked[u], modulus), modulus)
    for v in sorted(public):
        revealed = [s[v] for s in shares.values() if v in s]
        if len(revealed) < params.threshold:
            raise ValueError(f"client {v}'s secret has {len(revealed)} shares back, fewer than "
                             f"the threshold {params.threshold}: the sum cannot be unmasked.")
        secret = combine_shares(revealed[:params.threshold])
        if v in masked:  # its self mask
            total = _add(total, _prg(secret, size, modulus), modulus, -1)
            continue
        # dropped after sharing its keys: cancel the pairwise masks its surviving neighbours added
        own_public = public[v]
        for u in survivors:
            if u not in own_public or u == v:
                continue
            pair = _prg(_pair_seed(secret, own_public[u][1]), size, modulus)
            # u added +pair when u < v, else -pair: remove it
            total = _add(total, pair, modulus, -1 if u < v else 1)
    return total.astype(np.uint64)


def centered(total: np.ndarray, modulus: int) -> np.ndarray:
    """A sum mod ``modulus`` as int64 in ``[0, modulus)`` (quantized values are non-negative)."""
    return (np.asarray(total, dtype=np.uint64) % modulus).astype(np.int64)


def default_threshold(holders: int) -> int:
    """The default threshold: a majority of a client's share holders (Bell et al. take t > k/2
    against an honest-but-curious server), at least two."""
    return max(2, math.floor(holders / 2) + 1)
