"""The server's view of a run for one method: its settings, clients and model layout.

A :class:`ServerRuntime` is what a method's server rules work with (:mod:`pflalign.methods.base`):
the run's clients as discovered, which entries of the model are exchanged, the round's sampled
clients, and the run's aggregation rule. It holds no method state and knows no engine; the round
loop (:mod:`pflalign.round.loop`) owns one per method entry.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from pflalign.server.aggregation import FlatSpec, combine, fedavg
from pflalign.server.privacy import poisson_sample
from pflalign.server.robust import Kept, bulyan, centered_clip, fltrust, krum, multi_krum
from pflalign.server.sampling import (
    EVAL_SAMPLING_STREAM,
    draw_eval_population,
    sample_clients,
)
from pflalign.settings.schema import Settings
from pflalign.wire.messages import ClientInfo
from pflalign.wire.state import ServerState, State


class ServerRuntime:
    """The server's view of a run for one method: its settings, clients and model layout."""

    def __init__(self, settings: Settings, label: str, initial_model: State,
                 trainable: tuple[str, ...], template: Callable[[], object],
                 num_classes: int = 0):
        self.settings = settings
        #: the task's number of classes (0: unknown), which bounds the losses a reply may report
        self.num_classes = num_classes
        self.label = label
        self.seed = settings.run.seed
        #: the key of the privacy mechanism's draws (dp's noise and Poisson sampling): the seed, or
        #: under dp-secure a key from the operating system that no output carries
        self.private_key = (secrets.randbits(62) + 1
                            if settings.run.dp != "off" and settings.run.dp_secure else self.seed)
        self.rounds = settings.run.rounds
        self.eval_every = settings.run.eval_every
        self.fraction_train = settings.run.fraction_train
        self.trainable = trainable
        self._build_template = template
        self._template: object | None = None
        self.clients: dict[int, ClientInfo] = {}
        self._initial = initial_model
        #: the trainable entries (control variates, mixing)
        self.trainable_spec = FlatSpec.of({k: initial_model[k] for k in trainable})
        self.keep_personal(())
        self._samples: dict[int | tuple[int, float], list[int]] = {}
        #: the training clients of :attr:`clients` (the dict they were found in, their ids, its
        #: size then, and the ids sorted as an array)
        self._training: tuple = (None, [], -1, np.empty(0, np.int64))
        #: ``eval-clients``'s sample, by (number of clients, eval-clients) it was drawn for
        self._eval_population: tuple[tuple[int, int] | None, frozenset[int] | None] = (None, None)
        self._notices: list[str] = []
        self._weak_sizes: set[int] = set()
        #: what the round's aggregation is relative to (the global model and the server state's
        #: other parts, :meth:`set_references`), and under fltrust the server's root reply
        self._references: tuple[Mapping[str, np.ndarray], ...] = ()
        self._root: tuple[Mapping[str, np.ndarray], ...] = ()
        #: what the robust rules kept since :meth:`take_defence_log`, and their seconds
        self._kept: list[Kept] = []
        self._defence_seconds = 0.0

    @property
    def initial(self) -> State:
        """The run's initial model: the keys, shapes and dtypes of the model."""
        return self._initial

    def keep_personal(self, personal: Iterable[str]) -> None:
        """Make the entries ``personal`` stay on the clients (never sent, uploaded or averaged: the
        method's :meth:`~pflalign.methods.base.Method.personal_keys`); the others are exchanged."""
        personal = set(personal)
        model = self._initial
        self.shared = tuple(k for k in model if k not in personal)
        #: the exchanged part of the model: what is sent, uploaded, validated and averaged
        self.flat = FlatSpec.of({k: model[k] for k in self.shared})
        #: the trainable exchanged entries: what an update's norm and cosine are taken over
        self.trainable_shared = FlatSpec.of({k: model[k] for k in self.trainable
                                             if k in set(self.shared)})
        #: the exchanged floating-point entries that are not trained (batch-norm statistics)
        self.buffer_spec = FlatSpec.of({k: model[k] for k in self.shared
                                        if k not in set(self.trainable)
                                        and np.asarray(model[k]).dtype.kind == "f"})

    def template_model(self) -> object:
        """A model of the run, built once, for looking up its layers (read-only; its weights
        are not the run's)."""
        if self._template is None:
            self._template = self._build_template()
        return self._template

    def shared_model(self, state: ServerState) -> State:
        """The exchanged entries of the global model."""
        return {k: state.model[k] for k in self.shared}

    @staticmethod
    def with_model(state: ServerState, new: State) -> ServerState:
        """``state`` with some model entries replaced."""
        return dataclasses.replace(state, model={**state.model, **new})

    def combine(self, vectors: Sequence[np.ndarray], weights: Sequence[float],
                keys: tuple[str, ...] = ()) -> np.ndarray:
        """Client vectors combined by the run's ``aggregation`` rule (``mean``: weighted by
        ``weights``; the others unweighted; ``keys``: the entries the vectors hold, by which
        centered-clip and fltrust find their reference and root, :meth:`set_references`)."""
        run = self.settings.run
        rule = run.aggregation
        self._note_weak_rule(len(vectors))
        if rule == "mean":
            return combine(vectors, weights, rule)
        start = time.perf_counter()
        n = len(vectors)
        f = self.byzantine_count(n)
        if rule in ("trimmed-mean", "median"):
            out, kept = combine(vectors, weights, rule, run.trim_fraction), Kept(tuple(range(n)))
        elif rule == "krum":
            out, kept = krum(vectors, f)
        elif rule == "multi-krum":
            out, kept = multi_krum(vectors, f, min(n, run.krum_select or n - f))
        elif rule == "bulyan" and n < 3:  # n >= 4f + 3 fails even for f = 0 (said once)
            out, kept = np.mean(np.stack(vectors), axis=0), Kept(tuple(range(n)))
        elif rule == "bulyan":
            out, kept = bulyan(vectors, f)
        elif rule == "centered-clip":
            reference = self._lookup(self._references, keys)
            center = (reference if reference is not None
                      else np.median(np.stack(vectors), axis=0))
            out, kept = centered_clip(vectors, center, run.cc_tau, run.cc_iterations)
        elif rule == "fltrust":
            reference, root = self._lookup(self._references, keys), self._lookup(self._root, keys)
            if root is None:
                raise RuntimeError(f"fltrust has no root update for the entries {keys[:3]}.")
            out, kept = fltrust(vectors, np.zeros_like(root) if reference is None else reference,
                                root)
        else:
            raise ValueError(f"Unknown aggregation rule {rule!r}.")
        self._kept.append(kept)
        self._defence_seconds += time.perf_counter() - start
        return out

    def byzantine_count(self, n: int) -> int:
        """The f Krum, Multi-Krum and Bulyan assume among ``n`` uploads: ``floor(byzantine-fraction
        * n)``, lowered for Bulyan to what ``n >= 4f + 3`` allows."""
        f = int(np.floor(self.settings.run.byzantine_fraction * n))
        if self.settings.run.aggregation == "bulyan":
            f = min(f, max(0, (n - 3) // 4))
        return f

    def set_references(self, references: Iterable[Mapping[str, np.ndarray]],
                       root: Iterable[Mapping[str, np.ndarray]] = ()) -> None:
        """What the next aggregation's updates are taken from (the global model and the server
        state's other parts: centered-clip's centre) and, under fltrust, the arrays of the
        server's own training reply on its root set (its reference update)."""
        self._references, self._root = tuple(references), tuple(root)

    @staticmethod
    def _lookup(states: Sequence[Mapping[str, np.ndarray]], keys: tuple[str, ...],
                ) -> np.ndarray | None:
        """The first of ``states`` holding every entry of ``keys``, flattened (float64)."""
        for state in states:
            if keys and all(k in state for k in keys):
                return np.concatenate([np.asarray(state[k], dtype=np.float64).reshape(-1)
                                       for k in keys])
        return None

    def take_defence_log(self) -> tuple[list[Kept], float]:
        """What the robust rules kept since the last call, and the seconds they took."""
        log, seconds = self._kept, self._defence_seconds
        self._kept, self._defence_seconds = [], 0.0
        return log, seconds

    def _note_weak_rule(self, count: int) -> None:
        """Remember, once per round size, that the robust rule does not act at ``count``
        uploads (:meth:`take_notices` hands the lines to the round loop)."""
        run = self.settings.run
        if count in self._weak_sizes:
            return
        text = None
        if run.aggregation == "trimmed-mean" and int(np.floor(run.trim_fraction * count)) == 0:
            text = (f"aggregation = 'trimmed-mean' trims nothing at {count} uploads "
                    f"(trim-fraction = {run.trim_fraction:g} needs at least "
                    f"{int(np.ceil(1 / run.trim_fraction)) if run.trim_fraction else 'inf'}); "
                    "such rounds are a plain unweighted mean.")
        elif run.aggregation == "median" and count <= 2:
            text = (f"aggregation = 'median' at {count} upload{'s' if count > 1 else ''} is "
                    "their mean: one client moves it freely.")
        elif run.aggregation in ("krum", "multi-krum") and count < 3:
            text = (f"aggregation = {run.aggregation!r} at {count} upload"
                    f"{'s' if count > 1 else ''} cannot tell an outlier: "
                    + ("it takes the first by client id." if run.aggregation == "krum"
                       else "it takes them all, unweighted."))
        elif run.aggregation == "bulyan":
            wanted = int(np.floor(run.byzantine_fraction * count))
            if self.byzantine_count(count) < wanted or count < 3:
                text = (f"aggregation = 'bulyan' at {count} uploads assumes f = "
                        f"{self.byzantine_count(count)} Byzantine, not {wanted} (byzantine-"
                        f"fraction = {run.byzantine_fraction:g}): it needs n >= 4f + 3"
                        + ("; below 3 uploads it is their unweighted mean." if count < 3
                           else "."))
        if text:
            self._weak_sizes.add(count)
            self._notices.append(text)

    def take_notices(self) -> list[str]:
        """The notes gathered since the last call (each said once per run)."""
        notices, self._notices = self._notices, []
        return notices

    def average(self, states: Sequence[State], weights: Sequence[float],
                spec: FlatSpec | None = None) -> State:
        """Client states (by default the exchanged model entries) combined by the run's
        ``aggregation`` rule; ``mean`` is FedAvg's sample-weighted average
        (docs/algorithms.md 1.6)."""
        spec = spec or self.flat
        if self.settings.run.aggregation == "mean":
            return fedavg(states, weights, spec)
        return spec.unflatten(self.combine([spec.flatten(s, np.float64) for s in states],
                                           weights, spec.keys))

    def training_clients(self) -> list[int]:
        """The clients that train (every client but the unseen), in discovery order; walked
        once per discovery, not per round (a million clients took 0.1 s a walk). The list is
        shared: not to be changed."""
        if self._training[0] is not self.clients or self._training[2] != len(self.clients):
            ids = [cid for cid, info in self.clients.items() if not info.unseen]
            self._training = (self.clients, ids, len(self.clients),
                              np.sort(np.asarray(ids, dtype=np.int64)))
        return self._training[1]

    def training_ids(self) -> np.ndarray:
        """:meth:`training_clients` as a sorted int64 array (shared: not to be changed)."""
        self.training_clients()
        return self._training[3]

    def sample(self, server_round: int, over: float = 1.0) -> list[int]:
        """This round's training clients: reproducible from (seed, round), the same for every
        method; ``over`` > 1 samples that factor more (``over-selection``: a draw of
        ``min(1, fraction-train * over)`` of the clients). Under ``sampling = poisson``, each
        training client independently with probability ``fraction-train`` (possibly none)."""
        key = server_round if over == 1.0 else (server_round, over)
        if key not in self._samples and self.settings.run.sampling == "poisson":
            self._samples[key] = poisson_sample(self.training_ids(), self.fraction_train,
                                                self.private_key, server_round)
        if key not in self._samples:
            self._samples[key] = sample_clients(
                self.training_ids(), min(1.0, self.fraction_train * over), self.seed,
                server_round)
        return self._samples[key]

    def forget_samples(self) -> None:
        """Drop the drawn samples (a resumed run's key replaced the one they were drawn by)."""
        self._samples.clear()

    def eval_sample(self, clients: Iterable[int], server_round: int) -> list[int]:
        """The clients of ``clients`` evaluated in ``server_round``: all of them in the last
        round or with ``eval-fraction = 1``; else a sample of that fraction (at least one), the
        same for every method (seed, round and its own stream)."""
        clients = list(clients)
        population = self.eval_population()
        if population is not None:
            clients = [cid for cid in clients if cid in population]
        fraction = self.settings.run.eval_fraction
        if fraction >= 1.0 or server_round == self.rounds or not clients:
            return clients
        return sample_clients(clients, fraction, self.seed, server_round, EVAL_SAMPLING_STREAM)

    def eval_sampled(self, server_round: int) -> bool:
        """Whether ``server_round``'s evaluation scores a sample of the method's clients drawn
        for it (``eval-clients``, or ``eval-fraction`` before the last round), whose metrics
        then estimate the whole population's."""
        return self.eval_population() is not None or (
            self.settings.run.eval_fraction < 1.0 and server_round != self.rounds)

    def eval_population(self) -> frozenset[int] | None:
        """The clients evaluations may score under ``eval-clients`` (drawn once by the seed from
        every client: the same for every method), or None when all of them."""
        key = (len(self.clients), self.settings.run.eval_clients)
        if self._eval_population[0] != key:
            unseen = [cid for cid, info in self.clients.items() if info.unseen]
            drawn = draw_eval_population(self.training_ids(), unseen,
                                         self.settings.run.eval_clients, self.seed)
            self._eval_population = (key, None if drawn is None else frozenset(drawn))
        return self._eval_population[1]

    def largest_first(self, clients: Iterable[int]) -> list[int]:
        """Clients in decreasing order of data size: engines hand messages to free workers in
        order, so the longest jobs go first and workers stay evenly busy (LPT scheduling)."""
        return sorted(clients, key=lambda c: (-self.clients[c].num_train - self.clients[c].num_test,
                                              c))

    def is_eval_round(self, server_round: int) -> bool:
        return server_round % self.eval_every == 0 or server_round == self.rounds
