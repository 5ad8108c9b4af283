"""``record-uploads``: every training reply as it reached the server, before any check.

Each round writes ``<out-dir>/uploads/<entry>/round-<r>/client-<i>.npz`` for every client that
replied: its uploaded array records (``upload/<record>/<key>``) and the records the server sent
it (``sent/<record>/<key>``), so that an attack or a defence can be studied offline.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pflalign.methods.base import Method
from pflalign.outputs.results import slug
from pflalign.round.feature import RoundFeature, TrainingRound, register
from pflalign.settings.schema import Settings


@register
class RecordUploads(RoundFeature):
    """Writes each training reply's arrays, with what the client was sent, one file a client."""

    name = "record-uploads"

    @classmethod
    def wanted(cls, settings: Settings, method: Method) -> bool:
        return settings.run.record_uploads

    def __init__(self, loop):
        self.folder = Path(loop.server.settings.run.out_dir) / "uploads" / slug(loop.label)

    def received(self, loop, training: TrainingRound) -> None:
        if not training.messages:
            return
        folder = self.folder / f"round-{training.number}"
        folder.mkdir(parents=True, exist_ok=True)
        sent = {m.client: m.payload.arrays for m in training.messages}
        for reply in training.exchange.replies:
            if reply.error is not None or reply.sender not in sent:
                continue
            arrays = {f"{side}/{record}/{key}": np.asarray(value)
                      for side, records in (("upload", reply.arrays),
                                            ("sent", sent[reply.sender]))
                      for record, entries in records.items() for key, value in entries.items()}
            np.savez(folder / f"client-{reply.sender}.npz", **arrays)
