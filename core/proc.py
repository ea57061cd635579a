"""Small process helpers shared by the CLI, the load tests and the test fixtures."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

FALLBACK_EPHEMERAL = (32768, 60999)
"""Linux's default ephemeral range, where /proc/sys/net/ipv4/ip_local_port_range is unreadable."""
LOWEST_PORT = 10000


def free_port(host: str = "127.0.0.1", taken: frozenset[int] = frozenset()) -> int:
    """A port free on ``host`` (loopback by default) below the kernel's ephemeral range.

    A server is told its port seconds before it binds it (a vLLM binds after ~12 s of imports).
    A port the kernel handed out with bind(0) comes from the ephemeral range, where the kernel
    picks every outgoing connection's source port and every other bind(0) listener's port (a
    starting vLLM's own sockets among them): two vLLM servers started side by side lost that
    race here ("Address already in use"). Below the range only another such pick can take it.
    ``taken``: ports already promised to servers not started yet."""
    low = ephemeral_range()[0]
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(LOWEST_PORT, low) if low > LOWEST_PORT + 1000 else 0
        if port in taken:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise OSError(f"no free port below {low} on {host}")


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (net.ipv4.ip_local_port_range)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return FALLBACK_EPHEMERAL


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after "(comm)" (which may hold spaces and parentheses):
    [0] the state, [1] the parent pid, ... None when it cannot be read (gone, not Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields or None


def group_processes(pgid: int) -> dict[int, list[str]] | None:
    """pid -> its ``stat_fields`` for each process in process group ``pgid`` (field [2] of
    /proc/<pid>/stat), zombies included; None without /proc (not Linux)."""
    if not Path("/proc/self/stat").is_file():
        return None
    members = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = stat_fields(int(entry.name))
            if fields is not None and len(fields) > 7 and fields[2] == str(pgid):
                members[int(entry.name)] = fields
    return members


def group_minor_faults(pgid: int) -> int | None:
    """Minor page faults so far of the live processes in process group ``pgid`` (field 10 of
    /proc/<pid>/stat, summed): one per page a process maps on first touch of memory already in
    RAM, e.g. a shared-memory segment another process filled. None without /proc (not Linux)."""
    members = group_processes(pgid)
    return None if members is None else sum(int(fields[7]) for fields in members.values())


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file, or "(no log)" when it cannot be read."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def port_holder(port: int) -> tuple[int, str] | None:
    """(pid, command line) of the process listening on TCP ``port`` here, from /proc (Linux),
    or None when nobody listens or the holder cannot be seen."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = list((proc / "fd").iterdir())
        except OSError:
            continue  # gone, or not ours to look into
        if any(_link(fd) in inodes for fd in fds):
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmdline = "?"
            return int(proc.name), cmdline.strip()
    return None


def _link(fd: Path) -> str:
    try:
        return os.readlink(fd)
    except OSError:
        return ""  # closed meanwhile (the listing's own descriptor is one)


def _listening_inodes(port: int) -> set[str]:
    """socket:[inode] of the listening sockets on ``port`` (/proc/net/tcp{,6}, state 0A)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.add(f"socket:[{fields[9]}]")
    return found


def port_in_use(host: str, port: int) -> bool:
    """Whether binding ``host:port`` fails because something holds it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError:
        return False  # not an address of this machine: binding there is LMCache's own error
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError:
            return True
    return False
