"""A client's side of SecAgg+ (``secure-aggregation = secagg+``, :mod:`pflalign.wire.secagg`).

Every engine runs it inside :func:`pflalign.engines.host.begin` (the three key stages, each a
query with its own ``action``) and :func:`pflalign.engines.host.finish` (a training reply, whose
model update leaves the client only masked). What a client must keep from one stage to the next
(its secret keys, its self-mask seed, its neighbours' public keys, the shares it holds) is kept
in its saved state, under entries named ``secagg/...``, exactly as the engine keeps the method's
state (in memory, in a Flower node's context); the method never sees them, and they are dropped
when the round's unmasking is done, before any checkpoint or audit could ask for the state.

A training reply under SecAgg+ carries, in place of its model, the record :data:`MASKED`: the
vector ``y`` (uint32, mod ``2^32``) masking the quantized ``w (theta - theta_g)`` over the
floating-point entries of the model it received, in their order, with ``w = num-examples / W``
(``W``, the largest training set of the round's clients, is in the message's config): the
server's unmasked sum divided by the sum of the weights is the FedAvg update. Under ``dp =
central`` the update is instead clipped to ``dp-clip`` (L2) and unweighted, as DP-FedAvg sums
it, and the server adds the noise to the unmasked sum. Under ``dp = distributed`` the vector is
instead the update clipped to ``dp-clip``, rotated, rounded and noised by the client
(:func:`pflalign.training.ddgauss.encode`, with the grid, noise, bound and rotation in the
message's config), padded to a power of two; its noise is drawn from the client's own key under
``dp-secure``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from pflalign.engines.updates import flat_update
from pflalign.settings.options import Value
from pflalign.settings.schema import Settings
from pflalign.training import ddgauss
from pflalign.wire.protocol import MODEL, NUM_EXAMPLES, ROUND, TRAIN
from pflalign.wire.secagg import (
    ClientSecrets,
    Params,
    masked_input,
    quantize,
    setup,
    share_keys,
    unmask,
)
from pflalign.wire.state import State

SETUP, SHARE, UNMASK = "secagg-setup", "secagg-share", "secagg-unmask"
ACTIONS = (SETUP, SHARE, UNMASK)
#: the record a key stage's reply (and a share stage's message) carries its keys or shares in
KEYS = "secagg-keys"
#: a training message's record of the encrypted shares addressed to the client (sender -> bytes)
INBOX = "secagg-inbox"
#: a training reply's masked vector, and an unmask message's lists of survivors and dropped
MASKED, LISTS = "secagg-masked", "secagg-lists"
#: config entries of a training message under SecAgg+
CLIP, THRESHOLD, WEIGHT_SCALE = "secagg-clip", "secagg-threshold", "secagg-weight-scale"
#: ... and under dp = central, the L2 clip of the (unweighted) update before it is masked
DP_CLIP = "secagg-dp-clip"
#: ... and under dp = distributed, the grid, each client's noise (integer units), the rounding's
#: L2 bound and the round's rotation seed
DDP_GAMMA, DDP_SIGMA, DDP_BOUND, DDP_ROTATION = ("ddp-gamma", "ddp-sigma", "ddp-bound",
                                                 "ddp-rotation")
PREFIX = "secagg/"
#: the seed stream of a client's stochastic rounding
ROUNDING_STREAM = 7301
#: ... and of its discrete Gaussian noise (without dp-secure)
NOISE_STREAM = 7304


def rotation_signs(key: int, size: int) -> np.ndarray:
    """The round's random signs from its public rotation seed."""
    return ddgauss.rotation_signs(size, np.random.default_rng(key))


def as_bytes(value: np.ndarray | torch.Tensor) -> bytes:
    """A key, share or ciphertext as it travels (a uint8 array) back to bytes."""
    array = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    return array.astype(np.uint8).tobytes()


def as_array(value: bytes) -> np.ndarray:
    """Bytes as a uint8 array, as they travel in an array record."""
    return np.frombuffer(value, dtype=np.uint8).copy()


def split_saved(saved: State | None) -> tuple[State | None, State]:
    """A saved state without its SecAgg+ entries, and those entries."""
    if not saved or not any(k.startswith(PREFIX) for k in saved):
        return saved, {}
    own = {k: v for k, v in saved.items() if not k.startswith(PREFIX)}
    return own or None, {k: v for k, v in saved.items() if k.startswith(PREFIX)}


def encode(secrets: ClientSecrets) -> State:
    state = {f"{PREFIX}id": np.array([secrets.id], dtype=np.int64),
             f"{PREFIX}enc": as_array(secrets.enc_key), f"{PREFIX}mask": as_array(secrets.mask_key),
             f"{PREFIX}seed": as_array(secrets.seed)}
    for other, (enc, mask) in secrets.public.items():
        state[f"{PREFIX}pub/{other}/enc"], state[f"{PREFIX}pub/{other}/mask"] = (
            as_array(enc), as_array(mask))
    for other, (seed, key) in secrets.shares.items():
        state[f"{PREFIX}share/{other}/seed"], state[f"{PREFIX}share/{other}/key"] = (
            as_array(seed), as_array(key))
    return state


def decode(state: Mapping[str, np.ndarray]) -> ClientSecrets:
    if f"{PREFIX}seed" not in state:
        raise ValueError("this client holds no SecAgg+ keys for the round (it missed the setup).")
    secrets = ClientSecrets(int(state[f"{PREFIX}id"][0]), as_bytes(state[f"{PREFIX}enc"]),
                            as_bytes(state[f"{PREFIX}mask"]), as_bytes(state[f"{PREFIX}seed"]))
    for key in state:
        parts = key[len(PREFIX):].split("/")
        if parts[0] == "pub" and parts[2] == "enc":
            other = int(parts[1])
            secrets.public[other] = (as_bytes(state[key]),
                                     as_bytes(state[f"{PREFIX}pub/{other}/mask"]))
        if parts[0] == "share" and parts[2] == "seed":
            other = int(parts[1])
            secrets.shares[other] = (as_bytes(state[key]),
                                     as_bytes(state[f"{PREFIX}share/{other}/key"]))
    return secrets


def _with(method_saved: State | None, secrets: State) -> State | None:
    merged = {**(method_saved or {}), **secrets}
    return merged or None


def stage(client_id: int, config: Mapping[str, Value],
          arrays: Mapping[str, Mapping[str, torch.Tensor]], saved: State | None,
          ) -> tuple[dict, dict, State | None]:
    """One key stage (``config``'s action): the reply's metrics and records, and the state to
    keep (the method's, with the round's secrets)."""
    action = str(config["action"])
    own, held = split_saved(saved)
    if action == SETUP:
        secrets, (enc, mask) = setup(client_id)
        reply = {KEYS: {"enc": torch.from_numpy(as_array(enc)),
                        "mask": torch.from_numpy(as_array(mask))}}
        return {}, reply, _with(own, encode(secrets))
    secrets = decode(held)
    if action == SHARE:
        record = arrays[KEYS]
        members = sorted({int(k.split(".")[0]) for k in record})
        public = {m: (as_bytes(record[f"{m}.enc"]), as_bytes(record[f"{m}.mask"]))
                  for m in members}
        out = share_keys(secrets, public, int(config[THRESHOLD]))
        reply = {KEYS: {str(dst): torch.from_numpy(as_array(ct)) for dst, ct in out.items()}}
        return {}, reply, _with(own, encode(secrets))
    if action == UNMASK:
        lists = arrays[LISTS]
        out = unmask(secrets, [int(v) for v in lists["survivors"].tolist()],
                     [int(v) for v in lists["dropped"].tolist()])
        reply = {KEYS: {str(v): torch.from_numpy(as_array(s)) for v, s in out.items()}}
        return {}, reply, own if own is not None else {}  # the round is over: its secrets go
    raise ValueError(f"Unknown SecAgg+ action {action!r}.")


def masked_upload(client_id: int, config: Mapping[str, Value], run,
                  arrays: Mapping[str, Mapping[str, torch.Tensor]], model: Mapping[str,
                                                                                torch.Tensor],
                  num_examples: int, held: State) -> tuple[dict[str, torch.Tensor], State]:
    """A training reply's masked vector in place of ``model`` (its trained shared entries), and
    the secrets to keep (with the shares its inbox held)."""
    secrets = decode(held)
    received = arrays[MODEL]
    keys = [k for k in received if torch.is_floating_point(received[k])]  # the server's order
    update = flat_update(model, received, keys)
    seed = run.seed
    rng = np.random.default_rng([seed, ROUNDING_STREAM, int(config[ROUND]), client_id])
    params = Params(threshold=int(config[THRESHOLD]), neighbours=0,
                    clip=float(config[CLIP]))
    if DDP_GAMMA in config:  # dp = distributed: the client's share of the noise goes in first
        noise = (np.random.default_rng() if run.dp_secure else
                 np.random.default_rng([seed, NOISE_STREAM, int(config[ROUND]), client_id]))
        signs = rotation_signs(int(config[DDP_ROTATION]), ddgauss.padded_size(update.size))
        vector = ddgauss.encode(update, float(config[DP_CLIP]), float(config[DDP_GAMMA]), signs,
                                float(config[DDP_BOUND]), float(config[DDP_SIGMA]), rng, noise)
    else:
        if DP_CLIP in config:  # dp = central: DP-FedAvg's clip, on the client; unweighted sum
            bound, norm = float(config[DP_CLIP]), float(np.linalg.norm(update))
            update = update * min(1.0, bound / norm) if norm > 0 else update
        else:
            update = update * (num_examples / float(config[WEIGHT_SCALE]))
        vector = quantize(update, params, rng)
    inbox = {int(k): as_bytes(v) for k, v in arrays.get(INBOX, {}).items()}
    masked = masked_input(secrets, inbox, vector, params.modulus)
    return {"y": torch.from_numpy(masked.astype(np.uint32))}, encode(secrets)


def secure_reply(action: str, settings: Settings, client_id: int, config: Mapping[str, Value],
                 arrays: Mapping[str, Mapping[str, torch.Tensor]], metrics: dict, reply: dict,
                 state: State | None, saved: State | None) -> tuple[dict, dict, State | None]:
    """The reply as it leaves the client: a training reply under SecAgg+ with its model replaced
    by the masked vector (after any injected fault or attack changed it, as a client's own
    code would), and the state to keep with the round's secrets (the shares its inbox held)."""
    if action != TRAIN or CLIP not in config or MODEL not in reply:
        return metrics, reply, state
    own, held = split_saved(state if state is not None else saved)
    masked, held = masked_upload(client_id, config, settings.run, arrays, reply[MODEL],
                                 int(metrics[NUM_EXAMPLES]), held)
    return metrics, {MASKED: masked}, {**(own or {}), **held}


def with_secure_upload(handler):
    """``handler`` (the client handler, with its fault injection) whose training replies under
    SecAgg+ leave masked (:func:`secure_reply`)."""

    def secure(action, settings, client_id, config, arrays, saved, node=None):
        metrics, reply, state = handler(action, settings, client_id, config, arrays, saved,
                                        node=node)
        return secure_reply(action, settings, client_id, config, arrays, metrics, reply, state,
                            saved)

    return secure
