"""Reaching a Ray cluster: its address as ``ray start --head`` prints it, checked at once.

Both engines that run on Ray (``flower``, and ``batched`` on workers) take a cluster's address
(``--ray-address``); nothing here imports Ray.
"""

from __future__ import annotations

import socket

from pflalign.settings.options import ConfigError

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def parse_ray_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) of a Ray cluster's head, as ``ray start --head``
    prints it; a :class:`ConfigError` for anything else."""
    host, sep, port = address.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"Ray address '{address}' is not HOST:PORT; pass the address that "
                          "`ray start --head` prints (e.g. 127.0.0.1:6379).")
    return host, int(port)


def check_ray_address(address: str, timeout: float = 5.0) -> None:
    """Fail at once, in one line, when nothing listens at ``address`` (``ray.init`` would
    retry for minutes)."""
    host, port = parse_ray_address(address)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        raise ConfigError(f"No Ray cluster answers at '{address}' "
                          f"({err.strerror or type(err).__name__}); start its head with `ray "
                          f"start --head --port {port}` (see docs/usage.md) and pass the address "
                          "it prints.") from err
