"""This process's identity and peak resident memory, as a client's reply and results.json report
them (a reply's process metrics, :func:`pflalign.wire.protocol.process_metrics`; the
``processes`` of a method entry, :mod:`pflalign.round.features.telemetry`)."""

from __future__ import annotations

import resource
import socket
import sys
import time
import zlib

#: how long a read of the peak is reused by :func:`peak_rss_mb` (seconds)
PEAK_READ_EVERY = 0.5
_last_read: list[float] = [-float("inf"), 0.0]  # (when, MiB)


def peak_rss_mb(fresh: bool = False) -> float:
    """The largest resident memory this process has held so far, in MiB (``getrusage``'s
    ``ru_maxrss``: KiB on Linux, bytes on macOS). Read at most every ``PEAK_READ_EVERY``
    seconds unless ``fresh``: each reply carries it, and the first ``getrusage`` after a spell
    of training costs about 0.3 ms on this project's machines (measured in a run: 324 us, and
    4 us for a second call at once), which at 10,000 evaluation replies was 3 s."""
    now = time.monotonic()
    if fresh or now - _last_read[0] >= PEAK_READ_EVERY:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        _last_read[:] = [now, peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024]
    return _last_read[1]


def host_id() -> int:
    """An integer id of this machine: the CRC-32 of its host name (a reply's metrics are
    numbers; two processes with one id and one pid are one process)."""
    return zlib.crc32(socket.gethostname().encode())
