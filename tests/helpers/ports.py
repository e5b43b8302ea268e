"""A free TCP port on loopback for a test's own server or rendezvous (gloo's TCP store,
PostgreSQL, torchrun's endpoint).

Binding port 0 asks the kernel for a port of its ephemeral range, the range it also hands to
every outgoing connection: between the check and the server's own bind, a connection of a test
running beside it (gloo opens many) can take that port, and the server fails with
EADDRINUSE. So the port is drawn at random below that range, where no connection is given one,
and checked free.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: Linux's default ``net.ipv4.ip_local_port_range``, where the file cannot be read
EPHEMERAL_START = 32768


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return EPHEMERAL_START


def free_port(low: int = 20000, high: int | None = None) -> int:
    """A port in ``[low, high]`` (``high``: the last below the ephemeral range) that nothing
    listens on now."""
    high = min(high or 65535, _ephemeral_start() - 1)
    if low > high:
        raise ValueError(f"free_port: no port between {low} and {high}")
    for _ in range(200):
        port = random.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"free_port: no free port between {low} and {high}")
