"""Start, wait for and stop real local servers (``vllm serve``, ``lmcache server``).

Used by the demo, the benches and the e2e tests alike, so that every one of them drives the
same real processes. Servers get a free loopback port chosen at run time, a log file, their own
process group (so stop() takes their children too) and a readiness timeout whose error carries
the tail of the log.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import requests

from kvops.core.errors import KvopsError
from kvops.core.fp8.scales import read_cpu_flags
from kvops.core.proc import free_port, group_processes, log_tail
from kvops.core.units import GIB

DEFAULT_READY_TIMEOUT_S = 480.0

SERVER_NICE_ENV = "KVOPS_SERVER_NICE"
"""Niceness (0-19) of every server started here; unset: 0. A load generator that shares the
machine with a CPU vLLM (whose OpenMP threads spin on every core) falls seconds behind its
arrival schedule and the verdict turns inconclusive/client-bound; a niced server lets the
client keep its schedule, as it would on its own machine. The server's session (its scheduling
autogroup) gets the same niceness once it is ready, without which the threads' niceness has no
effect beside other sessions (``_autogroup_nice``). The e2e tests set 5."""
CPU_TEST_ENV: Mapping[str, str] = {
    # One of the two cores is reserved for the front end unless told otherwise.
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "LMCACHE_TRACK_USAGE": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


class ServerStartError(KvopsError):
    """A server did not become ready; the message ends with its log tail."""


def vllm_executable() -> str:
    """The `vllm` next to this interpreter (the venv's), else the one on PATH."""
    local = Path(sys.executable).with_name("vllm")
    if local.exists():
        return str(local)
    found = shutil.which("vllm")
    if not found:
        raise KvopsError("the `vllm` command is not installed: pip install 'vllm-kvops[gpu]' (GPU), "
                         "or in a kvops checkout `make setup` (CPU)")
    return found


@dataclass
class ManagedServer:
    """One server process we started."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    env: dict[str, str]
    host: str = "127.0.0.1"
    die_with_parent: bool = False
    """SIGTERM the server when the process that started it dies, even by SIGKILL (Linux
    PR_SET_PDEATHSIG): a supervisor's `kill -9` must not leave it holding memory and ports.
    Only for a server launched from the main thread: the kernel sends the signal when the
    *thread* that started the child ends, and one launched from a worker thread (the e2e pool
    starts two side by side) would die with that thread."""
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _raised: bool = field(default=False, init=False, repr=False)
    """``launch`` started its processes above the servers' niceness; ``settle`` lowers them."""
    _held_s: float = field(default=0.0, init=False, repr=False)
    """Seconds ``pause`` held the processes stopped: ``wait_ready`` does not count them."""
    _held_since: float | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, health_path: str = "/health", timeout_s: float = DEFAULT_READY_TIMEOUT_S) -> None:
        self.launch()
        self.wait_ready(health_path, timeout_s)
        self.settle()

    def launch(self, starting_nice: int = 0) -> None:
        """Start the process and return at once (``start`` also waits until it is ready).
        ``starting_nice``: its niceness until ``settle``, e.g. 19 for a start beside a running
        workload that should take only idle CPU; 0: the servers' niceness, as ``start`` does.
        It is the session's (scheduling autogroup's) niceness, and where we may lower it again
        (``can_renice``) its processes' too, which is what counts where autogroups are off."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        nice = server_nice()
        self._raised = bool(starting_nice > nice and can_renice())
        with open(self.log_path, "ab") as log:
            process = subprocess.Popen(  # noqa: S603 - argv built by us
                self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True,
                preexec_fn=_in_child(starting_nice if self._raised else nice,  # noqa: PLW1509
                                     os.getpid() if self._dies_with_parent() else None),
            )
        self.process = process
        if starting_nice:
            _autogroup_nice(process.pid, starting_nice)

    def _dies_with_parent(self) -> bool:
        return self.die_with_parent and threading.current_thread() is threading.main_thread()

    def settle(self) -> None:
        """Give the server the servers' niceness once it is ready (or needed): its session's
        (``_autogroup_nice``; from the 19 of ``launch(starting_nice=19)`` down to it needs no
        privilege, only a negative nice does) and, where ``launch`` raised them, every thread
        of its processes'."""
        if self.process is None:
            return
        nice = server_nice()
        _autogroup_nice(self.process.pid, nice, force=True)
        if self._raised:
            _renice_group(self.process.pid, nice)
            self._raised = False

    def pause(self) -> None:
        """Stop every process of the server (SIGSTOP to its group) until ``resume``: e.g. a
        start under way beside a latency measurement that must have the CPU to itself."""
        if self.process is not None and self.process.poll() is None and self._held_since is None:
            _signal_group(self.process.pid, signal.SIGSTOP)
            self._held_since = time.monotonic()

    def resume(self) -> None:
        if self._held_since is None or self.process is None:
            return
        _signal_group(self.process.pid, signal.SIGCONT)
        self._held_s += time.monotonic() - self._held_since
        self._held_since = None

    def _held(self) -> float:
        """Seconds the processes were held stopped, up to now."""
        now = time.monotonic()
        return self._held_s + (now - self._held_since if self._held_since is not None else 0.0)

    def wait_ready(self, health_path: str, timeout_s: float) -> None:
        began, held = time.monotonic(), self._held()
        while time.monotonic() - began - (self._held() - held) < timeout_s:
            code = self.returncode()
            if code is not None:
                raise ServerStartError(
                    f"{self.name} exited with code {code} before it was ready "
                    f"(log {self.log_path}):\n{log_tail(self.log_path)}"
                )
            try:
                if requests.get(self.url + health_path, timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(
            f"{self.name} was not ready after {timeout_s:.0f}s (log {self.log_path}):\n"
            f"{log_tail(self.log_path)}"
        )

    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the process group, SIGKILL after grace_s; returns the exit code. Processes
        left in the group after the server's main process exits get the rest of the grace to
        end on their own: vLLM's engine core unlinks its shared-memory queues (/dev/shm/psm_*,
        160 and 240 MiB) as it exits, and a SIGKILL then leaves them behind for good."""
        proc = self.process
        if proc is None:
            return None
        self.resume()  # a stopped process would keep SIGTERM pending until the grace ran out
        deadline = time.monotonic() + grace_s
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        _signal_group(proc.pid, signal.SIGKILL)  # stragglers left in the group
        killed_by = time.monotonic() + 5.0  # SIGKILL lands asynchronously: return once they are gone
        while _group_alive(proc.pid) and time.monotonic() < killed_by:
            time.sleep(0.01)
        return proc.returncode


def server_nice() -> int:
    """The niceness SERVER_NICE_ENV asks for (KvopsError naming it when it is not 0-19)."""
    raw = os.environ.get(SERVER_NICE_ENV, "").strip()
    if not raw:
        return 0
    if not raw.isdigit() or int(raw) > 19:
        raise KvopsError(f"{SERVER_NICE_ENV}={raw!r}: set a whole number from 0 to 19, or unset it")
    return int(raw)


def _in_child(nice: int, parent: int | None) -> Callable[[], None] | None:
    """What the child runs between fork and exec: run at niceness ``nice`` (absolute: a server
    that a niced `kvops offload serve` starts stays at the same niceness, not twice it; never
    raised above the caller's priority) and, with a ``parent``, die with it (None: nothing to do)."""
    if not nice and parent is None:
        return None
    death = _parent_death_signal(parent) if parent is not None else None

    def run() -> None:
        current = os.nice(0)
        if nice > current:
            os.nice(nice - current)
        if death is not None:
            death()

    return run


def _autogroup_nice(pid: int, nice: int, force: bool = False) -> None:
    """Give a ready server's session the niceness of its threads. The server runs in a session
    of its own (start_new_session, so a stop reaches the whole group), and with the kernel's
    autogroup scheduling on (/proc/sys/kernel/sched_autogroup_enabled, the default of most
    distributions) every session is one scheduling group whose weight is the autogroup's nice,
    not its threads': a thread's nice counts only against threads of its own group (sched(7),
    "The autogroup feature"). A niced vLLM therefore took as much CPU as the whole session
    running the load generator, whose sends fell seconds behind their schedule (CI, stops 19 and
    20: a Locust process at nice 0 waited 77 s on the run queue for 88 s of CPU beside servers at
    nice 10; 8.6 s for 76 s with the group niced). Set once the server is ready, not at its
    start: a start is mostly imports that no load generator waits beside, and in the clean-clone
    run that niced it from the start, starts averaged 62 s against 46 s in the run before.
    Nothing to do where autogroups are off or absent, or at nice 0; raising a group's nice needs
    no privilege. ``force``: write it at nice 0 too (a session niced for its start, put back)."""
    if not nice and not force:
        return
    for _ in range(5):  # without CAP_SYS_ADMIN one write per 100 ms machine-wide, else EAGAIN
        try:
            Path(f"/proc/{pid}/autogroup").write_text(str(nice))
            return
        except OSError as exc:
            if exc.errno != errno.EAGAIN:
                return
            time.sleep(0.11)


def can_renice() -> bool:
    """Whether this process may lower a niceness it raised (root: CAP_SYS_NICE), which
    ``launch(starting_nice=...)`` then does for the server's threads on ``settle``."""
    return os.geteuid() == 0


def autogroups_on() -> bool:
    """Whether the kernel schedules each session as one group whose niceness we can read back
    (sched_autogroup_enabled is 1 and /proc/self/autogroup shows a nice: some kernels show the
    file empty), which ``launch``'s ``starting_nice`` sets."""
    try:
        return (Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
                and " nice " in Path("/proc/self/autogroup").read_text())
    except OSError:
        return False


def _renice_group(pgid: int, nice: int) -> None:
    """Set every thread of every process in process group ``pgid`` to niceness ``nice``."""
    for pid in group_processes(pgid) or {}:
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
        except (OSError, ValueError):
            continue  # gone meanwhile


def _parent_death_signal(parent: int) -> Callable[[], None]:
    """Runs in the child between fork and exec: ask the kernel for SIGTERM when the parent dies
    (prctl PR_SET_PDEATHSIG, kept across exec), and exit if it died before we asked. The kernel
    sends it when the *thread* that forked exits: start such servers from the main thread.
    libc is loaded here, before the fork, so the child only makes the call."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return arm


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _group_alive(pid: int) -> bool:
    """Whether any process of the group ``pid`` leads is still running (zombies waiting for
    init to reap them count as gone; without /proc, any member counts)."""
    try:
        os.killpg(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    members = group_processes(pid)
    return members is None or any(fields[0] != "Z" for fields in members.values())


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


EAGER_WRONG_ON_AMX = (
    "vLLM 0.32's eager CPU path computes wrong outputs for a bfloat16 model on a CPU with AMX: "
    "measured on an Intel Xeon with AMX, stock vLLM, SmolLM2-135M-Instruct asked 'What is the "
    "capital of France?' answered 'L'Étoile, la Marseillaise, la femme, …' under --enforce-eager "
    "and 'The capital of France is Paris.' compiled (the default) or with --dtype float32"
)
"""Why kvops' own servers that must answer right (the demo) run compiled on such a CPU. The other
test and bench servers stay eager (a start costs much less) and compare with servers that are
eager too."""


def amx_cpu() -> bool:
    """The CPU reports AMX tiles (/proc/cpuinfo)."""
    return "amx_tile" in read_cpu_flags()


def vllm_server(
    model: Path | str,
    args: Sequence[str] = (),
    *,
    log_path: Path,
    kv_cache_bytes: int | None = GIB,
    env: Mapping[str, str] | None = None,
    port: int | None = None,
    name: str = "vllm",
    eager: bool = True,
) -> ManagedServer:
    """A not-yet-started `vllm serve` for the CPU build, eager mode (``eager=False``: compiled, a
    slower start; see ``EAGER_WRONG_ON_AMX``), on a free port.

    The KV space is given in bytes with --kv-cache-memory-bytes; VLLM_CPU_KVCACHE_SPACE (whole
    GiB only) would override it (vllm/platforms/cpu.py), so it is removed from the environment.
    ``kv_cache_bytes=None`` leaves the flag out: vLLM then sizes KV from --gpu-memory-utilization
    minus what the worker holds (vllm/v1/worker/cpu_worker.py:233-258), which is what a
    calibration (kvops verify --calibration-out) measures.
    """
    chosen = port or free_port()
    full_env = {**os.environ, **CPU_TEST_ENV, **(env or {})}
    full_env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    argv = [
        vllm_executable(), "serve", str(model), "--host", "127.0.0.1", "--port", str(chosen),
        *(["--enforce-eager"] if eager else []),
        *(["--kv-cache-memory-bytes", str(kv_cache_bytes)] if kv_cache_bytes is not None else []), *args,
    ]
    # a `kill -9` of the kvops command (or the test session) that started it takes it along;
    # vLLM's API server then stops its engine core and worker as on any SIGTERM
    return ManagedServer(name=name, argv=argv, port=chosen, log_path=log_path, env=full_env,
                         die_with_parent=True)
