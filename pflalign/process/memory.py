"""This process's identity and peak resident memory, as a client's reply and results.json report
them (a reply's process metrics, :func:`pflalign.wire.protocol.process_metrics`; the
``processes`` of a method entry, :mod:`pflalign.round.features.telemetry`)."""

from __future__ import annotations

import resource
import socket
import sys
import zlib


def peak_rss_mb() -> float:
    """The largest resident memory this process has held so far, in MiB (``getrusage``'s
    ``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def host_id() -> int:
    """An integer id of this machine: the CRC-32 of its host name (a reply's metrics are
    numbers; two processes with one id and one pid are one process)."""
    return zlib.crc32(socket.gethostname().encode())
