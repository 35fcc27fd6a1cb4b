"""eagle_platform.ports: ports handed to servers come from outside the kernel's ephemeral range and Ray's
worker range, so a process that binds port 0 in between cannot take them."""

from __future__ import annotations

import socket

from eagle_platform.ports import RAY_WORKER_PORTS, bindable, ephemeral_range, free_port


def test_free_ports_avoid_the_ephemeral_and_ray_worker_ranges():
    ephemeral = ephemeral_range()
    ports = {free_port() for _ in range(50)}
    assert len(ports) > 40  # random, so two servers started together rarely draw the same one
    for port in ports:
        assert port not in ephemeral and port not in RAY_WORKER_PORTS and port >= 1024
        assert bindable(port)


def test_a_preferred_port_is_kept_only_while_it_binds():
    port = free_port()
    assert free_port(port) == port
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        assert not bindable(port)
        assert free_port(port) != port
