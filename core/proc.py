"""Small process helpers shared by the CLI, the load tests and the test fixtures."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS has just called free on ``host`` (loopback by default)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after "(comm)" (which may hold spaces and parentheses):
    [0] the state, [1] the parent pid, ... None when it cannot be read (gone, not Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields or None


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
