"""Differential privacy as round features: central DP-FedAvg, and local DP's accounting.

``dp = central`` (:class:`CentralDP`; McMahan et al., ICLR 2018): the round's updates are
replaced, before the method's rule aggregates them, by one release: each client's update
clipped to ``dp-clip`` (adapted under ``dp-clipping = adaptive``, Andrew et al. 2021), their sum
noised and divided by the expected clients a round
(:class:`~pflalign.server.privacy.CentralPrivacy`); a round that drew nobody releases the noise
alone; every training round is accounted and its row reports the epsilon spent. No aggregation
is rolled back for the clients' losses (which the release does not privatize). The clip and the
accountant's history are what a checkpoint keeps.

``dp = distributed`` (:class:`DistributedDP`; Kairouz, Liu and Steinke, ICML 2021): under
secure aggregation each client adds its share of discrete Gaussian noise before masking
(:mod:`pflalign.round.features.secure`); the unmasked, decoded sum is divided by the expected
clients a round, and each round is accounted with the clients whose noise the sum holds
(:class:`~pflalign.server.distributed_dp.DistributedAccountant`).

``dp = local`` (:class:`LocalDPAccounting`): each client clips and noises its own update before
it leaves (the client's side, :func:`~pflalign.server.privacy.local_release`); the server only
reports what the client that trained most often has spent. A method that uploads nothing
reports epsilon 0 under either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from pflalign.methods.base import Method
from pflalign.round.feature import RoundFeature, register
from pflalign.round.features.secure import SecureAggregation
from pflalign.server.aggregation import FlatSpec
from pflalign.server.distributed_dp import DistributedAccountant, ServerAccountant
from pflalign.server.privacy import (
    CentralPrivacy,
    epsilon_of,
    local_multiplier,
    privacy_warnings,
    run_noise_multiplier,
    sample_rate,
)
from pflalign.server.sampling import expected_clients
from pflalign.settings.schema import Settings
from pflalign.wire.messages import Update


@register
class CentralDP(RoundFeature):
    """``dp = central`` for a method whose clients upload their model."""

    name = "central-dp"
    forbids_rollback = True
    #: a round that drew no client still releases (the noise alone)
    releases_without_updates = True

    @classmethod
    def wanted(cls, settings: Settings, method: Method) -> bool:
        return settings.run.dp == "central" and method.uploads_model

    def __init__(self, loop):
        self.server = loop.server
        self.privacy: CentralPrivacy | None = None

    def start(self, loop) -> None:
        """The clip, noise and accountant of this run: the released entries are the exchanged
        floating-point arrays, the denominator the expected clients a round."""
        server, run = loop.server, loop.server.settings.run
        shared = server.shared_model(loop.state)
        spec = FlatSpec.of({k: v for k, v in shared.items() if np.asarray(v).dtype.kind == "f"})
        expected = expected_clients(run.sampling, run.fraction_train,
                                    len(server.training_clients()))
        self.privacy = CentralPrivacy(run, server.private_key, spec, expected)
        loop.reporter.info(
            f"[{loop.label}] dp = central: each update clipped to "
            f"{run.dp_clip:g}{' (adaptive)' if self.privacy.adaptive else ''}, noise "
            f"multiplier {self.privacy.noise_multiplier:.4g}"
            f"{' (from dp-epsilon)' if run.dp_epsilon else ''}, sum over {expected:g} expected "
            f"clients, sample rate {self.privacy.accountant.sample_rate:g}; the clip replaces "
            "the update-norm bound")
        for text in privacy_warnings(run, len(server.training_clients())):
            loop.warn(text)

    def release(self, loop, server_round: int, updates: Sequence[Update], row: dict,
                ) -> list[Update]:
        """The round's updates as the one update the method's server rule aggregates: the model
        the round started from plus the clipped updates' noised sum over the expected
        clients."""
        shared = loop.server.shared_model(loop.state)
        if loop.server.settings.run.secure_aggregation != "off":
            # the one update secure aggregation released: the global model plus the unmasked
            # sum of the clients' updates, each clipped to dp-clip before it was masked
            total = (self.privacy.spec.flatten(updates[0].model, np.float64)
                     - self.privacy.spec.flatten(shared, np.float64)) if updates else (
                np.zeros(self.privacy.spec.size))
            release = self.privacy.release_sum(shared, total, server_round)
        else:
            release = self.privacy.release(shared, [u.model for u in updates], server_round)
        row.update(release.entries)
        return [Update(client=-1, num_examples=1, metrics={}, model={**shared, **release.model})]

    def trained(self, loop, server_round: int, row: dict) -> None:
        row.update(self.privacy.account())

    def state_dict(self) -> dict:
        return self.privacy.state_dict()

    def load_state_dict(self, state: Mapping) -> None:
        self.privacy.load_state_dict(dict(state))
        if self.privacy.seed != self.server.private_key:  # dp-secure's key, as it was
            self.server.private_key = self.privacy.seed
            self.server.forget_samples()


@register
class DistributedDP(RoundFeature):
    """``dp = distributed``: the release's denominator and the accountant (the noise is the
    clients', inside the sum that secure aggregation unmasked)."""

    name = "distributed-dp"
    forbids_rollback = True

    @classmethod
    def wanted(cls, settings: Settings, method: Method) -> bool:
        return settings.run.dp == "distributed" and method.uploads_model

    def __init__(self, loop):
        self.secure: SecureAggregation | None = None
        self.accountant: DistributedAccountant | None = None
        self.server: ServerAccountant | None = None

    def start(self, loop) -> None:
        run = loop.server.settings.run
        self.secure = next(f for f in loop.features if isinstance(f, SecureAggregation))
        m = self.secure.mechanism
        self.accountant = DistributedAccountant(m, run.dp_delta, sample_rate(run))
        self.server = ServerAccountant(m, run.dp_delta)
        loop.reporter.info(
            f"[{loop.label}] dp = distributed: each client clips its update to {m.clip:g}, "
            f"rotates it ({m.dim} values padded to {m.padded}), rounds it to a grid of "
            f"{m.gamma:.4g} within {m.l2:.6g} steps and adds discrete Gaussian noise of "
            f"{m.sigma:.4g} steps before masking: the noise multiplier of a sum of "
            f"{m.noised_for:g} clients is {m.multiplier:.4g}"
            f"{' (from dp-epsilon)' if run.dp_epsilon else ''}, mean over {m.expected:g} "
            f"expected clients, sample rate {self.accountant.rate:g}")
        for text in privacy_warnings(run, len(loop.server.training_clients())):
            loop.warn(text)

    def release(self, loop, server_round: int, updates: Sequence[Update], row: dict,
                ) -> list[Update]:
        """The one update secure aggregation released (the global model plus the noised sum)
        as the global model plus that sum over the expected clients."""
        if not updates:
            return []
        shared = loop.server.shared_model(loop.state)
        spec = self.secure.floats
        start = spec.flatten(shared, np.float64)
        total = spec.flatten(updates[0].model, np.float64) - start
        row["dp-clip"] = self.secure.mechanism.clip
        model = spec.unflatten(start + total / self.secure.mechanism.expected)
        return [Update(client=-1, num_examples=1, metrics={}, model={**shared, **model})]

    def trained(self, loop, server_round: int, row: dict) -> None:
        """Account the round if its sum was released (a round that unmasked nothing released
        nothing), and report the clients in the sum and both epsilons spent so far
        (:mod:`pflalign.server.distributed_dp`): for who sees the models (amplified by the
        sampling), and against the server (who took part is known to it); without noise,
        neither."""
        summed = self.secure.summed
        row["dp-clients"] = len(summed)
        if summed:
            self.accountant.step(len(summed))
            self.server.step(summed)
        if self.secure.mechanism.sigma > 0:
            row["dp-epsilon"] = self.accountant.epsilon()
            row["dp-epsilon-server"] = self.server.epsilon()

    def state_dict(self) -> dict:
        return {**self.accountant.state_dict(), **self.server.state_dict()}

    def checkpoint_refusal(self, loop, server_round: int) -> str | None:
        return untrusted_checkpoint(loop)

    def load_state_dict(self, state: Mapping) -> None:
        self.accountant.load_state_dict(dict(state))
        self.server.load_state_dict(dict(state))


@register
class LocalDPAccounting(RoundFeature):
    """The epsilon of ``dp = local`` (and of a method that uploads nothing under any dp)."""

    name = "local-dp"

    @classmethod
    def wanted(cls, settings: Settings, method: Method) -> bool:
        return settings.run.dp != "off" and not CentralDP.wanted(settings, method) and not (
            DistributedDP.wanted(settings, method))

    def __init__(self, loop):
        self.run = loop.server.settings.run
        self.uploads = loop.method.uploads_model

    def start(self, loop) -> None:
        if self.run.dp == "local":
            loop.reporter.info(
                f"[{loop.label}] dp = local: each client clips its update to "
                f"{self.run.dp_clip:g} and adds noise of multiplier "
                f"{run_noise_multiplier(self.run):.4g} before it leaves")
        if self.uploads:
            for text in privacy_warnings(self.run, len(loop.server.training_clients())):
                loop.warn(text)

    def trained(self, loop, server_round: int, row: dict) -> None:
        """The row's epsilon: what the client that trained most often so far has spent, each of
        its uploads a Gaussian release at :func:`~pflalign.server.privacy.local_multiplier` (no
        amplification: a client knows when it takes part); for a method that uploads nothing,
        0; without noise, none (there is no guarantee)."""
        if not self.uploads:
            row["dp-epsilon"] = 0.0
            return
        multiplier = run_noise_multiplier(self.run)
        if multiplier == 0:
            return
        trainings = max((sent for sent, _ in loop.usage.values()), default=0)
        row["dp-epsilon"] = epsilon_of([(local_multiplier(multiplier), 1.0, trainings)],
                                       self.run.dp_delta)

    def checkpoint_refusal(self, loop, server_round: int) -> str | None:
        return untrusted_checkpoint(loop) if self.run.dp == "local" else None


def untrusted_checkpoint(loop) -> str | None:
    """Why no checkpoint is written under a dp whose server is not trusted (local, distributed)
    on the Flower engine: it would ask the clients for their saved state."""
    run = loop.server.settings.run
    if run.engine == "flower" and loop.messaging.saved_state:
        return (f"no checkpoints are written under dp = {run.dp!r} on the Flower engine: they "
                "would ask the clients for their saved state, which must not leave them; a "
                "killed run starts over.")
    return None
