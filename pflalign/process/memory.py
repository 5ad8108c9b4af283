"""This process's identity and peak resident memory, as a client's reply and results.json report
them (``processes`` of a method entry, :class:`pflalign.run.rounds.RoundLoop`)."""

from __future__ import annotations

import os
import resource
import socket
import sys
import zlib

from pflalign.wire.protocol import PROCESS_HOST, PROCESS_ID, PROCESS_PEAK_RSS_MB


def peak_rss_mb() -> float:
    """The largest resident memory this process has held so far, in MiB (``getrusage``'s
    ``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def host_id() -> int:
    """An integer id of this machine: the CRC-32 of its host name (a reply's metrics are
    numbers; two processes with one id and one pid are one process)."""
    return zlib.crc32(socket.gethostname().encode())


def process_metrics() -> dict[str, int | float]:
    """The process metrics of a training or evaluation reply: this machine's :func:`host_id`,
    this process's id and its :func:`peak_rss_mb` so far."""
    return {PROCESS_HOST: host_id(), PROCESS_ID: os.getpid(), PROCESS_PEAK_RSS_MB: peak_rss_mb()}
