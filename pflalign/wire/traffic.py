"""What a message costs: the bytes of its array records as Flower carries them.

Every engine counts the same bytes (the Flower engine reads them off its Messages, the in-process
engines compute them here), so rows' ``bytes-up`` and ``bytes-down`` and the simulated clock's
transfer times agree across engines.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from pflalign.process.caches import cached
from pflalign.wire.protocol import RESTORE


@cached(maxsize=256)
def _npy_header_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    buffer = io.BytesIO()
    header = {"descr": dtype, "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.tell()


def npy_bytes(array: np.ndarray | torch.Tensor) -> int:
    """The bytes of ``array`` in NumPy's .npy format: what a Flower ``Array`` carries."""
    if isinstance(array, torch.Tensor):
        array = array.detach().cpu().numpy()
    array = np.asarray(array)
    return _npy_header_bytes(np.lib.format.dtype_to_descr(array.dtype),
                             tuple(array.shape)) + array.nbytes


def records_bytes(records: Iterable[Mapping[str, np.ndarray | torch.Tensor]]) -> int:
    return sum(npy_bytes(a) for record in records for a in record.values())


def sent_bytes(sent: Mapping[str, Mapping[str, np.ndarray]]) -> int:
    """The bytes :func:`sent_records` carry down, a restored state aside (no round of the run
    sends it)."""
    return records_bytes(record for name, record in sent.items() if name != RESTORE)
