"""kvops.core.proc.free_port: a port a server can still bind seconds later, because nothing
but another such pick hands it out (below the kernel's ephemeral range)."""

from __future__ import annotations

import socket

from kvops.core.proc import LOWEST_PORT, ephemeral_range, free_port


def test_free_ports_sit_below_the_ephemeral_range_are_distinct_and_bind():
    low, high = ephemeral_range()
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:  # the kernel's own answer
        assert (low, high) == tuple(int(x) for x in f.read().split())
    taken: set[int] = set()
    for _ in range(50):
        port = free_port(taken=frozenset(taken))
        assert port not in taken
        assert LOWEST_PORT <= port < low
        taken.add(port)
    held = []
    try:
        for port in taken:  # every one of them binds (and listens) now
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind(("127.0.0.1", port))
            sock.listen()
        # with all 50 held, no new pick is one of them: a pick is checked by binding it
        for _ in range(50):
            assert free_port() not in taken
    finally:
        for sock in held:
            sock.close()


def test_bind_zero_ports_come_from_the_ephemeral_range_that_free_port_avoids():
    """The hazard itself, from the kernel: what bind(0) hands out lies in the range."""
    low, high = ephemeral_range()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        assert low <= sock.getsockname()[1] <= high
