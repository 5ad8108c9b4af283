"""Telemetry: which processes ran the run's clients, and their peak memory.

The run's result lists its processes (``processes``): this one (the server's), and each client
process that sent an accepted training or evaluation reply, by the process metrics it reported
(:data:`~pflalign.wire.protocol.PROCESS_METRICS`), with its largest reported peak memory. A
diagnostic only: no row or metric uses it. A resumed run lists the processes of its own rounds
(checkpoints do not keep them).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from pflalign.methods.base import Method
from pflalign.process.memory import host_id, peak_rss_mb
from pflalign.round.feature import RoundFeature, register
from pflalign.settings.schema import Settings
from pflalign.wire.protocol import PROCESS_HOST, PROCESS_ID, PROCESS_METRICS, PROCESS_PEAK_RSS_MB


@register
class Telemetry(RoundFeature):
    """The processes that sent accepted replies (every run has it)."""

    name = "telemetry"

    @classmethod
    def wanted(cls, settings: Settings, method: Method) -> bool:
        return True

    def __init__(self, loop):
        #: per client process (host id, pid) that sent an accepted reply in this run: the
        #: largest peak memory it reported (MiB) and how many such replies it sent
        self.client_processes: dict[tuple[int, int], tuple[float, int]] = {}

    def accepted(self, loop, metrics: Iterable[Mapping[str, float]]) -> None:
        """Keep each reporting process's largest peak memory and its count of replies (a reply
        without the process metrics is passed over)."""
        for reply in metrics:
            if not all(key in reply for key in PROCESS_METRICS):
                continue
            key = (int(reply[PROCESS_HOST]), int(reply[PROCESS_ID]))
            peak, replies_so_far = self.client_processes.get(key, (0.0, 0))
            self.client_processes[key] = (max(peak, float(reply[PROCESS_PEAK_RSS_MB])),
                                          replies_so_far + 1)

    def result(self, loop) -> dict:
        """``processes``: first this one, the server's (its host id, pid and peak memory so
        far, in MiB), then each client process that sent an accepted reply, by pid, with the
        largest peak it reported and its number of accepted replies. Under the in-process engines
        the clients run here: the server's pid is then a client's too."""
        server = {"role": "server", "host": host_id(), "pid": os.getpid(),
                  "peak-rss-mb": peak_rss_mb(fresh=True)}
        clients = [{"role": "clients", "host": host, "pid": pid, "peak-rss-mb": peak,
                    "replies": count}
                   for (host, pid), (peak, count) in sorted(
                       self.client_processes.items(), key=lambda item: item[0][::-1])]
        return {"processes": [server, *clients]}
