"""Free TCP ports on 127.0.0.1 that nothing else on this machine is about to take.

The usual trick (bind port 0, read the number, close) hands out a port from the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default). Between closing it and the real
server binding it, any outgoing connection or any server that binds port 0 may take the same number; a
local Ray cluster starts dozens of such processes. One CI run lost the platform service's port that way
(``[Errno 98] address already in use``). This module picks instead at random below the ephemeral range and
outside Ray's worker port range (10002-19999 by default), where nothing is assigned without being asked
for, and checks that the port binds.

    python -m eagle_platform.ports [PREFERRED]   prints PREFERRED when it binds, else a free port
"""

from __future__ import annotations

import random
import socket
import sys
from pathlib import Path

RAY_WORKER_PORTS = range(10002, 20000)  # ray start --min-worker-port / --max-worker-port defaults
FLOOR = RAY_WORKER_PORTS.stop  # the window starts above Ray's worker ports


def ephemeral_range() -> range:
    """The kernel's ephemeral port range (where bind(0) and outgoing connections draw from)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def bindable(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(preferred: int = 0, host: str = "127.0.0.1") -> int:
    """``preferred`` when it binds; else a random bindable port in [20000, start of the ephemeral range)
    (or the kernel's pick when that window is empty or full)."""
    if preferred and bindable(preferred, host):
        return preferred
    ephemeral = ephemeral_range()
    window = range(FLOOR, ephemeral.start)  # empty when the ephemeral range starts below FLOOR
    for port in random.sample(window, min(len(window), 256)):
        if bindable(port, host):
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    print(free_port(int(sys.argv[1]) if len(sys.argv) > 1 else 0, host="0.0.0.0"))
