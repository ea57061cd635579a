"""kvops.core.proc.free_port: a port a server can still bind seconds later, because nothing
but another such pick hands it out (below the kernel's ephemeral range). group_minor_faults: the
kernel's count of first touches, for one process group only."""

from __future__ import annotations

import mmap
import socket
import subprocess
import sys

from kvops.core.proc import LOWEST_PORT, ephemeral_range, free_port, group_minor_faults

PAGE = mmap.PAGESIZE
TOUCH = """
import mmap, sys
m = mmap.mmap(-1, int(sys.argv[1]))
m.madvise(mmap.MADV_NOHUGEPAGE)  # 4 KiB pages whatever the machine's THP setting
print("mapped", flush=True)
sys.stdin.readline()
for offset in range(0, len(m), mmap.PAGESIZE):
    m[offset] = 1  # the first touch of each page
print("touched", flush=True)
sys.stdin.readline()
"""


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


def test_a_groups_minor_faults_grow_by_the_pages_it_first_touches_and_by_nothing_else():
    """A process in its own session maps memory in 4 KiB pages and writes one byte per page:
    the kernel counts one minor fault per page. Pages this process touches meanwhile, in its
    own group, are not counted."""
    pages = 2048
    child = subprocess.Popen([sys.executable, "-c", TOUCH, str(pages * PAGE)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    assert child.stdin is not None
    assert child.stdout is not None
    try:
        assert child.stdout.readline() == "mapped\n"
        before = group_minor_faults(child.pid)
        assert before > 0  # the interpreter's own start
        mine = mmap.mmap(-1, 4 * pages * PAGE)
        mine.madvise(mmap.MADV_NOHUGEPAGE)
        for offset in range(0, len(mine), PAGE):
            mine[offset] = 1
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "touched\n"
        grown = group_minor_faults(child.pid) - before
        assert pages <= grown < pages + 500
        child.stdin.write("end\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == 0
    finally:
        child.kill()
        child.wait()
    assert group_minor_faults(child.pid) == 0  # nobody left in the group
