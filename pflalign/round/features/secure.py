"""Secure aggregation (``secure-aggregation = secagg+``) as a round feature: the server learns only
the sum of a round's updates (SecAgg+, Bell et al., CCS 2020; :mod:`pflalign.wire.secagg`).

Each synchronous training round runs the protocol's stages around the training exchange, through
the engine like every other message, so that their bytes count in the round's ``bytes-up`` and
``bytes-down`` (and in its own ``secagg-bytes-up``/``-down``):

1. ``before_training``: the round's sampled clients get a setup query (they reply with two public
   keys) and then, those that answered, a share query with the public keys of their neighbours
   in the round's graph (they reply with their encrypted shares, one per neighbour);
2. ``select``: the round trains the clients that completed both;
3. ``sending``: each training message carries the shares addressed to its client and the
   protocol's parameters; the client replies with its masked, quantized, weighted update
   (:mod:`pflalign.engines.secagg_client`) in place of its model;
4. ``received``: each usable masked vector is taken; the reply's model becomes the global model
   it was sent (what the checks of a training reply then see: its metrics are checked as
   always, its upload cannot be);
5. ``checked``: the replies that passed the checks are the survivors, every other client of the
   round counts as dropped; the survivors get an unmask query, and the server rebuilds the sum;
6. ``release``: the method aggregates one update, the global model plus the unmasked sum of the
   weighted updates divided by the sum of the weights (FedAvg's mean update, to within the
   quantization error).

Under ``dp = distributed`` each client encodes its update with its share of discrete Gaussian
noise (:mod:`pflalign.training.ddgauss`: clipped, rotated, rounded to the grid of the run's
:class:`~pflalign.server.distributed_dp.Mechanism`, noised) in place of the quantization, and
the unmasked sum is decoded into the noised sum of the clipped updates, which
:class:`~pflalign.round.features.privacy.DistributedDP` divides by the expected clients and
accounts.

Every feature that reads a single upload cannot run beside it (the config says so in one
sentence, :meth:`pflalign.methods.base.Method.check`): the update-norm bound is replaced by the
quantization's clip, which bounds every coordinate of every weighted update to
``secagg-clip``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence

import numpy as np

from pflalign.engines import secagg_client as sc
from pflalign.methods.base import Method
from pflalign.round.feature import RoundFeature, Selection, Traffic, TrainingRound, register
from pflalign.server.aggregation import FlatSpec
from pflalign.server.distributed_dp import Mechanism, calibrate, noised_for
from pflalign.server.privacy import sample_rate
from pflalign.server.sampling import expected_clients
from pflalign.server.validation import Collected
from pflalign.settings.schema import Settings
from pflalign.training import ddgauss
from pflalign.wire.messages import Exchange, Payload, Reply, Update
from pflalign.wire.protocol import ACTION, MODEL, QUERY
from pflalign.wire.secagg import Params, default_threshold, dequantize_sum, graph, unmasked_sum

#: the seed stream of the rounds' neighbour graphs
GRAPH_STREAM = 7302
#: ... and of the rounds' rotations under dp = distributed (public: every client shares them)
ROTATION_STREAM = 7303


@register
class SecureAggregation(RoundFeature):
    """SecAgg+ around every synchronous training round (see the module docstring)."""

    name = "secure-aggregation"

    @classmethod
    def wanted(cls, settings: Settings, method: Method) -> bool:
        return settings.run.secure_aggregation == "secagg+" and method.uploads_model

    def __init__(self, loop):
        self.participants: list[int] = []
        self.public: dict[int, dict[int, tuple[bytes, bytes]]] = {}
        self.inbox: dict[int, dict[int, bytes]] = {}
        self.masked: dict[int, np.ndarray] = {}
        self.release_model: dict | None = None
        self.total_examples = 0.0
        self.threshold = 0
        #: the largest training set of the round's clients: a weight is num-examples over it
        self.weight_scale = 1
        #: the exchanged floating-point entries: what a masked vector holds, in this order
        self.floats: FlatSpec | None = None
        #: dp = distributed: the run's mechanism, and the clients in the round's unmasked sum
        self.mechanism: Mechanism | None = None
        self.summed: list[int] = []
        self._rotation: tuple | None = None

    def start(self, loop) -> None:
        self.floats = FlatSpec.of({k: v for k, v in loop.server.shared_model(loop.state).items()
                                   if np.asarray(v).dtype.kind == "f"})
        run = loop.server.settings.run
        if run.dp == "distributed":
            self.mechanism = distributed_mechanism(run, self.floats.size,
                                                   len(loop.server.training_clients()))

    @property
    def vector_size(self) -> int:
        """The values of a masked vector: the exchanged floating-point values, padded to a power
        of two under dp = distributed (the rotation's size)."""
        return self.mechanism.padded if self.mechanism else self.floats.size

    # --- the stages before training ------------------------------------------------------------
    def params(self, loop) -> Params:
        """The round's protocol parameters; under ``dp = central`` the quantization's range is
        ``dp-clip`` (every coordinate of an update clipped to it in L2 lies within it)."""
        run = loop.server.settings.run
        return Params(threshold=self.threshold, neighbours=run.secagg_neighbours,
                      clip=run.dp_clip if self.private(loop) else run.secagg_clip)

    @staticmethod
    def private(loop) -> bool:
        """Whether the unmasked sum is DP's (central: its noise follows the unmasking; distributed:
        the noise is in it): the clip is then the clients', and the sum is unweighted."""
        return loop.server.settings.run.dp in ("central", "distributed")

    def rotation(self, server_round: int, seed: int) -> tuple[int, np.ndarray]:
        """The round's public rotation seed and the signs it draws (drawn once a round)."""
        if self._rotation is None or self._rotation[0] != (server_round, seed):
            key = int(np.random.default_rng([seed, ROTATION_STREAM, server_round]).integers(
                2 ** 62))
            self._rotation = ((server_round, seed), key, sc.rotation_signs(
                key, self.mechanism.padded))
        return self._rotation[1], self._rotation[2]

    def _query(self, loop, server_round: int, clients: Sequence[int], config: dict,
               records: Mapping[int, dict] | None = None) -> tuple[dict[int, Reply], int, int]:
        messages = [loop.messaging.message(c, Payload(dict(records.get(c, {})) if records else {},
                                                      {ACTION: config[ACTION], **config}),
                                           server_round) for c in clients]
        exchange = loop.engine.exchange(QUERY, messages)
        good = {}
        for reply in exchange.replies:
            if reply.error is None and reply.sender is not None and sc.KEYS in reply.arrays:
                good[reply.sender] = reply
            else:
                loop.warn(f"round {server_round}: {reply.who} {reply.error or 'sent no keys'} "
                          f"in SecAgg+'s {config[ACTION]}; it is left out of the round.")
        return good, exchange.bytes_down, exchange.bytes_up

    def before_training(self, loop, server_round: int) -> Traffic:
        server, run = loop.server, loop.server.settings.run
        self.masked, self.release_model, self.summed = {}, None, []
        clients = sorted(server.sample(server_round))
        setup, down, up = self._query(loop, server_round, clients, {ACTION: sc.SETUP})
        keys = {c: (sc.as_bytes(r.arrays[sc.KEYS]["enc"]), sc.as_bytes(r.arrays[sc.KEYS]["mask"]))
                for c, r in setup.items()}
        members = sorted(keys)
        rng = np.random.default_rng([server.seed, GRAPH_STREAM, server_round])
        neighbours = graph(members, run.secagg_neighbours or len(members), rng)
        views = {c: {v: keys[v] for v in (*neighbours[c], c)} for c in members}
        holders = min((len(v) for v in views.values()), default=0)
        self.threshold = run.secagg_threshold or default_threshold(holders)
        problem = None
        if len(members) < 2 or holders < self.threshold:
            problem = (f"needs at least two clients and a threshold ({self.threshold}) within "
                       f"each client's {holders} share holders")
        else:
            try:
                if self.mechanism is None:  # under dp = distributed the grid holds the sum
                    self.params(loop).check(len(members))
            except ValueError as err:
                problem = f"cannot sum this round: {err}"
        if problem:
            loop.warn(f"round {server_round}: SecAgg+ {problem}; this round trains no client.")
            self.participants = []
            return self._traffic(down, up)
        records = {c: {sc.KEYS: {f"{v}.{part}": sc.as_array(key)
                                 for v, pair in views[c].items()
                                 for part, key in zip(("enc", "mask"), pair, strict=True)}}
                   for c in members}
        shared, d2, u2 = self._query(loop, server_round, members,
                                     {ACTION: sc.SHARE, sc.THRESHOLD: self.threshold}, records)
        down, up = down + d2, up + u2
        self.inbox = {c: {} for c in shared}
        for sender, reply in shared.items():
            for dst, ciphertext in reply.arrays[sc.KEYS].items():
                if int(dst) in self.inbox and int(dst) in views[sender]:
                    self.inbox[int(dst)][sender] = sc.as_bytes(ciphertext)
        self.participants = sorted(shared)
        self.public = {c: views[c] for c in members}
        self.weight_scale = max((server.clients[c].num_train for c in self.participants),
                                default=1)
        return self._traffic(down, up)

    @staticmethod
    def _traffic(down: int, up: int) -> Traffic:
        return {"secagg-bytes-down": down, "secagg-bytes-up": up}, down, up

    def select(self, loop, server_round: int, wanted: int) -> Selection | None:
        return Selection(list(self.participants), len(self.participants))

    def sending(self, loop, training: TrainingRound) -> None:
        server = loop.server
        for i, message in enumerate(training.messages):
            inbox = {str(src): sc.as_array(ct)
                     for src, ct in self.inbox.get(message.client, {}).items()}
            payload = Payload({**message.payload.arrays, sc.INBOX: inbox},
                              message.payload.config)
            config = {**message.config, sc.CLIP: self.params(loop).clip,
                      sc.THRESHOLD: self.threshold, sc.WEIGHT_SCALE: self.weight_scale,
                      **({sc.DP_CLIP: server.settings.run.dp_clip} if self.private(loop)
                         else {}), **self.noise_config(training.number, server.seed)}
            limits = {**(message.limits or {}), sc.MASKED: 4 * self.vector_size + 512}
            training.messages[i] = type(message)(message.client, payload, config, limits)

    def noise_config(self, server_round: int, seed: int) -> dict:
        """dp = distributed: what a client needs to encode its update (the grid, its noise,
        the rounding's bound and the round's rotation)."""
        if self.mechanism is None:
            return {}
        m = self.mechanism
        return {sc.DDP_GAMMA: m.gamma, sc.DDP_SIGMA: m.sigma, sc.DDP_BOUND: m.l2,
                sc.DDP_ROTATION: self.rotation(server_round, seed)[0]}

    # --- after training --------------------------------------------------------------------
    def received(self, loop, training: TrainingRound) -> None:
        """Take each well-formed masked vector (uint32, one value per floating-point entry of
        the exchanged model); a reply without one keeps its records, which the checks then
        reject, and its client counts as dropped in the unmasking."""
        shared = loop.server.shared_model(loop.state)
        replies = []
        for reply in training.exchange.replies:
            record = reply.arrays.get(sc.MASKED)
            if reply.error is None and record is not None and "y" in record:
                y = np.asarray(record["y"])
                if y.dtype == np.uint32 and y.shape == (self.vector_size,):
                    self.masked[int(reply.sender)] = y.astype(np.uint64)
                    reply = dataclasses.replace(reply, arrays={MODEL: dict(shared)})
            replies.append(reply)
        training.exchange = Exchange(replies, training.exchange.bytes_down,
                                     training.exchange.bytes_up)

    def checked(self, loop, training: TrainingRound, collected: Collected) -> Collected:
        server, server_round = loop.server, training.number
        started = time.perf_counter()
        survivors = sorted(int(m[0]["partition-id"]) for m in collected.good
                           if int(m[0]["partition-id"]) in self.masked)
        self.summed = []
        if not survivors:
            self.release_model = None
            return collected
        dropped = [c for c in self.participants if c not in survivors]
        records = {c: {sc.LISTS: {
            "survivors": np.array([v for v in survivors if v in self.public[c]], dtype=np.int64),
            "dropped": np.array([v for v in dropped if v in self.public[c]], dtype=np.int64)}}
            for c in survivors}
        answers, down, up = self._query(loop, server_round, survivors, {ACTION: sc.UNMASK},
                                        records)
        training.row["secagg-bytes-down"] = training.row.get("secagg-bytes-down", 0) + down
        training.row["secagg-bytes-up"] = training.row.get("secagg-bytes-up", 0) + up
        training.bytes_down, training.bytes_up = (training.bytes_down + down,
                                                  training.bytes_up + up)
        shares = {c: {int(v): sc.as_bytes(s) for v, s in r.arrays[sc.KEYS].items()}
                  for c, r in answers.items()}
        params = self.params(loop)
        try:
            total = unmasked_sum({c: self.masked[c] for c in survivors},
                                 {c: self.public[c] for c in self.participants}, shares, params)
        except ValueError as err:
            loop.warn(f"round {server_round}: SecAgg+ cannot unmask the sum ({err}); the global "
                      "model is kept.")
            self.release_model = None
            return Collected([], collected.failed, collected.timed_out,
                             collected.rejected + len(collected.good), collected.nonfinite_loss)
        weights = sum(server.clients[c].num_train / self.weight_scale for c in survivors)
        if self.mechanism is not None:  # the noised sum (DistributedDP.release divides it)
            mean_update = ddgauss.decode(total, self.mechanism.gamma,
                                         self.rotation(server_round, server.seed)[1],
                                         self.floats.size, params.modulus)
        else:  # under dp = central the sum itself, which the noise then follows
            mean_update = dequantize_sum(total, len(survivors), params) / (
                1.0 if self.private(loop) else weights)
        self.summed = list(survivors)
        shared = server.shared_model(loop.state)
        base = self.floats.flatten(shared, np.float64)
        self.release_model = {**shared, **self.floats.unflatten(base + mean_update)}
        self.total_examples = float(sum(server.clients[c].num_train for c in survivors))
        training.row["secagg-dropped"] = len(dropped)
        training.row["secagg-seconds"] = time.perf_counter() - started
        return collected

    def trained(self, loop, server_round: int, row: dict) -> None:
        """No single update reached the server: the round's cosine between uploads and the
        aggregate is not defined (the loop computed it from the placeholders)."""
        row.pop("update-cosine", None)

    def release(self, loop, server_round: int, updates: Sequence[Update],
                row: dict) -> Sequence[Update]:
        """The one update the method aggregates: the global model plus the mean update."""
        if self.release_model is None or not updates:
            return []
        return [Update(client=-1, num_examples=self.total_examples, metrics={},
                       model=self.release_model)]


def distributed_mechanism(run, dim: int, training_clients: int) -> Mechanism:
    """``dp = distributed``'s mechanism for ``dim`` exchanged values: ``dp-noise-multiplier``,
    or the one :func:`~pflalign.server.distributed_dp.calibrate` finds for ``dp-epsilon``."""
    expected = expected_clients(run.sampling, run.fraction_train, training_clients)
    rate = sample_rate(run)
    floor = noised_for(expected, training_clients, rate)
    multiplier = (calibrate(run.dp_epsilon, run.dp_delta, run.dp_clip, expected, dim, rate,
                            run.rounds, floor) if run.dp_epsilon > 0
                  else run.dp_noise_multiplier)
    return Mechanism.build(run.dp_clip, multiplier, expected, dim, floor)
