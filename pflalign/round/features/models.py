"""``save-models``: the global model and every client's personal model, written at the end.

In the run's final evaluation (under ``save-models = best``, in every evaluation round, whose
models are kept while its pooled validation score is the best so far: :func:`round_score`) each
client is asked to send back the model that scored it
(:data:`~pflalign.wire.protocol.SAVE_SCORED`); its reply carries it as the record
:data:`~pflalign.wire.protocol.SCORED`, which must have exactly the entries, shapes and dtypes of
the method's scored module (:meth:`~pflalign.methods.base.Method.saved_keys`) and finite values,
or it is not saved (the client's metrics stand: they passed their own checks). The models go to
``<out-dir>/models/<entry>/`` (:mod:`pflalign.outputs.models`), with the server state after the
last round as the global model. A model sent back is the run's output, not the method's traffic:
it is not counted in ``bytes-up``. A deployed SuperNode saves its own model in its node directory
and replies without it (``model-saved-on-node``); the manifest lists it under ``on-node``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from pflalign.data.federated import federated_dataset
from pflalign.methods.base import Method
from pflalign.outputs.models import (
    FORMAT,
    GLOBAL,
    client_file,
    entry_dir,
    models_fingerprint,
    write_arrays,
    write_manifest,
)
from pflalign.round.feature import RoundFeature, register
from pflalign.server.aggregation import FlatSpec
from pflalign.server.validation import Collected, quote
from pflalign.settings.schema import Settings
from pflalign.wire.messages import Outgoing
from pflalign.wire.protocol import (
    ARRAY_HEADER,
    NUM_TEST,
    PARTITION_ID,
    PERSONAL_CORRECT,
    PERSONAL_LOSS,
    SAVE_SCORED,
    SAVED_ON_NODE,
    SCORED,
)


@register
class SavedModels(RoundFeature):
    """Asks for each client's scored model in the final evaluation and writes the models."""

    name = "saved-models"

    @classmethod
    def wanted(cls, settings: Settings, method: Method) -> bool:
        return settings.run.save_models != "none"

    def __init__(self, loop):
        self.folder = entry_dir(loop.server.settings.run.out_dir, loop.label)
        #: what a client's saved model must be (the scored module's entries), and the most
        #: bytes it may take: known at the final evaluation (:meth:`_expect`)
        self.spec: FlatSpec | None = None
        self.limit = 0
        #: per client: the manifest's record of its saved model
        self.saved: dict[int, dict] = {}
        self.on_node: list[int] = []
        #: save-models = best: every evaluation is a candidate, the best so far by the seen
        #: clients' pooled validation score (accuracy, or a regression's mean squared error)
        self.best = loop.server.settings.run.save_models == "best"
        self.best_score: float | None = None
        self.best_round = 0

    def _expect(self, loop) -> None:
        """The spec of a client's saved model: the entries of the method's scored module around
        the run's model (:meth:`~pflalign.methods.base.Method.saved_keys`)."""
        if self.spec is None:
            server = loop.server
            model = copy.deepcopy(server.template_model())
            keys = loop.method.saved_keys(model, server.num_classes)
            state = loop.method.scored_module(model, server.num_classes).state_dict()
            self.spec = FlatSpec.of({k: state[k].detach().cpu().numpy() for k in keys})
            self.limit = self.spec.nbytes + ARRAY_HEADER * len(self.spec.keys)

    def _candidate(self, loop, server_round: int) -> bool:
        """Whether this evaluation's models may be the ones saved."""
        return server_round == loop.server.rounds or (self.best and server_round > 0)

    def evaluating(self, loop, messages: list[Outgoing], server_round: int) -> list[Outgoing]:
        if not self._candidate(loop, server_round):
            return messages
        self._expect(loop)
        return [replace(m, config={**m.config, SAVE_SCORED: True},
                        limits={**(m.limits or {}), SCORED: self.limit}) for m in messages]

    def evaluated(self, loop, server_round: int, messages: Sequence[Outgoing],
                  collected: Collected, metrics: dict) -> Collected:
        if not self._candidate(loop, server_round):
            return collected
        regression = loop.server.settings.run.task == "regression"
        if self.best:
            score = round_score(loop, collected, regression)
            if score is None or (self.best_score is not None and (
                    score >= self.best_score if regression else score <= self.best_score)):
                return collected  # not better than the best so far: its models are not kept
            self.best_score, self.best_round = score, server_round
            for path in (self.folder / "clients").glob("*.safetensors"):
                path.unlink()  # the previous best's
            if loop.state is not None:
                write_arrays(self.folder / GLOBAL, loop.state.to_arrays(),
                             {"round": str(server_round)})
        self.saved, self.on_node = {}, []
        missing = []
        for reply, arrays in collected.good:
            cid = int(reply[PARTITION_ID])
            if reply.get(SAVED_ON_NODE):
                self.on_node.append(cid)
                continue
            model = arrays.get(SCORED)
            self._expect(loop)
            problem = "it sent none" if model is None else self.spec.problem_with(model)
            if problem is None and not all(np.isfinite(np.asarray(v)).all()
                                           for v in model.values()
                                           if np.asarray(v).dtype.kind == "f"):
                problem = "it is not finite"
            if problem:
                missing.append(f"client {cid} ({quote(problem, 160)})")
                continue
            file = client_file(cid)
            write_arrays(self.folder / file, model, {"client": str(cid),
                                                     "round": str(server_round)})
            count = int(reply[NUM_TEST])
            self.saved[cid] = {"id": cid, "file": file, "round": server_round,
                               "unseen": bool(loop.server.clients[cid].unseen),
                               NUM_TEST: count,
                               # a regression's loss is its mean squared error; no accuracy
                               ("personal-mse" if regression else "personal-acc"): (
                                   float(reply[PERSONAL_LOSS]) if regression
                                   else reply[PERSONAL_CORRECT] / max(count, 1)),
                               PERSONAL_LOSS: float(reply[PERSONAL_LOSS])}
        if missing:
            loop.warn(f"round {server_round}: the personal models of {len(missing)} clients are "
                      f"not saved: {'; '.join(missing[:3])}"
                      f"{' ...' if len(missing) > 3 else ''}.")
        return collected

    def result(self, loop) -> dict:
        server = loop.server
        settings = server.settings
        fingerprint = models_fingerprint(settings, loop.label)
        global_saved = loop.method.has_global_model and loop.state is not None
        if loop.state is not None and not self.best:
            write_arrays(self.folder / GLOBAL, loop.state.to_arrays(),
                         {"round": str(len(loop.rounds))})
        data = federated_dataset(settings)
        dataset = data.dataset  # under dataset = clients, what the config says of the data
        names = dict(enumerate(getattr(data.partition, "names", ()) or ()))
        manifest = {
            "format": FORMAT, "label": loop.label, "method": loop.method.name,
            "fingerprint": fingerprint,
            "round": self.best_round if self.best else len(loop.rounds),
            "chosen": ("the evaluation round with the best pooled validation "
                       + ("personal-mse" if settings.run.task == "regression" else "personal-acc")
                       + " of the seen clients" if self.best else "the final round"),
            "model": {"name": settings.run.model, "input-shape": list(dataset.input_shape),
                      "num-classes": dataset.num_classes,
                      "parameters": server.trainable_spec.size},
            "inputs": {"kind": dataset.kind, "mean": list(dataset.mean or ()),
                       "std": list(dataset.std or ())},
            "data-fingerprint": data.fingerprint() if hasattr(data, "fingerprint") else None,
            "class-names": list(getattr(dataset, "class_names", ()) or ()),
            "feature-names": list(getattr(dataset, "feature_names", ()) or ()),
            "settings": settings.to_dict(),
            "global": GLOBAL if global_saved else None,
            "server-state": GLOBAL if loop.state is not None else None,
            "clients": [{**record, **({"name": names[cid]} if cid in names else {})}
                        for cid, record in sorted(self.saved.items())],
            "on-node": sorted(self.on_node)}
        path = write_manifest(self.folder, manifest)
        loop.reporter.info(f"[{loop.label}] saved the models of {len(self.saved)} clients"
                           + (f" ({len(self.on_node)} more on their nodes)" if self.on_node
                              else "")
                           + (" and the global model" if global_saved else "")
                           + f" in {Path(path).parent}")
        # what results.json says of them: the same on every engine and in every out-dir
        return {"models": {"fingerprint": fingerprint, "clients": len(self.saved),
                           "on-node": len(self.on_node), "global": global_saved}}


def round_score(loop, collected: Collected, regression: bool) -> float | None:
    """An evaluation's score for save-models = best: the seen clients' pooled accuracy (correct
    over test samples), or a regression's pooled mean squared error; None without a seen
    client."""
    rows = [m for m, _ in collected.good
            if not loop.server.clients[int(m[PARTITION_ID])].unseen]
    tested = sum(m[NUM_TEST] for m in rows)
    if not tested:
        return None
    if regression:
        return sum(m[PERSONAL_LOSS] * m[NUM_TEST] for m in rows) / tested
    return sum(m[PERSONAL_CORRECT] for m in rows) / tested
