"""Real servers for e2e tests: tiny models built once per session, `vllm serve` started once
per distinct configuration and shared across tests, at most MAX_LIVE_SERVERS alive at a time
(the least recently used is stopped). An idle CPU server costs ~1% of a core (measured over 5 s
on its three processes) and ~2 GiB plus its KV cache, a start 30-60 s: keeping up to six alive
(while memory allows, FREE_GIB) spares restarts that fewer caused (with two the default
2048-token server was started 4 times in one session).

Usage in a test::

    def test_x(vllm, tiny_model):
        server = vllm(tiny_model, "--max-model-len", "2048")
        requests.post(server.url + "/v1/completions", ...)

A server that fails to start raises ServerStartError carrying its log tail; ``vllm.log_of``
gives the log of any server for assertions on what vLLM printed.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvops.ops.launch import ManagedServer, vllm_server
from kvops.ops.models.tiny import TinyModelSpec, build_tiny_model

from .staging import staging_fleet  # noqa: F401 - the session's staging fleet (issue 14)

MAX_LIVE_SERVERS = 6
SERVER_GIB = 2.5
"""Memory of one more tiny-model CPU vLLM besides its KV cache: its three processes (API
server, engine core, worker) measured ~2.1 GiB RSS together."""
FREE_GIB = 4.0
"""Left available beside the servers for what the test runs next to them (LMCache, Prometheus,
Locust, the test itself). A start that would leave less stops the least recently used first.
With up to six alive the session restarts fewer configurations than with four (which restarted
the plugin-free 2048-token server three times, ~50 s a start)."""
SHARED_ARGS = {("--max-model-len", "1024"), ("--max-model-len", "2048")}
"""The configurations most e2e tests share (1 GiB of KV, no env): evicted last."""
REFUSING_AT_ONCE = 3
STARTS: list[tuple[str, float]] = []
"""Every `vllm serve` the pool started this session: its arguments and seconds to ready."""

pytestmark = pytest.mark.e2e


def _refusal_key(model: Path, args: tuple[str, ...], env: dict[str, str] | None) -> tuple[object, ...]:
    return (str(model), tuple(args), tuple(sorted((env or {}).items())))


class TinyModels:
    """Builds each distinct TinyModelSpec once per session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: dict[TinyModelSpec, Path] = {}

    def __call__(self, **shape: object) -> Path:
        spec = TinyModelSpec(**shape)  # type: ignore[arg-type]
        if spec not in self._built:
            name = "tiny-" + "-".join(f"{k}{v}" for k, v in sorted(shape.items())) if shape else "tiny"
            self._built[spec] = build_tiny_model(self.root / name, spec)
        return self._built[spec]


class VllmServers:
    """Session pool of started `vllm serve` processes keyed by their configuration."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._live: OrderedDict[tuple[object, ...], ManagedServer] = OrderedDict()
        self._count = 0
        self._lock = threading.Lock()
        self._refused: dict[tuple[object, ...], tuple[int | None, str]] = {}

    def __call__(
        self,
        model: Path,
        *args: str,
        kv_cache_bytes: int | None = 1 << 30,
        env: dict[str, str] | None = None,
        fresh: bool = False,
    ) -> ManagedServer:
        key = (str(model), args, kv_cache_bytes, tuple(sorted((env or {}).items())))
        server = self._live.get(key)
        if server is not None and not fresh and server.returncode() is None:
            self._live.move_to_end(key)
            return server
        if server is not None:
            self._stop(key)
        while self._live and (len(self._live) >= MAX_LIVE_SERVERS
                              or not memory_for(1, kv_cache_bytes or 0)):
            self._stop(self._victim())
        self._count += 1
        server = vllm_server(
            model, args, kv_cache_bytes=kv_cache_bytes, env=env,
            log_path=self.log_dir / f"vllm-{self._count}.log", name=f"vllm-{self._count}",
        )
        began = time.monotonic()
        server.start()
        STARTS.append((" ".join((Path(model).name, *args)), time.monotonic() - began))
        self._live[key] = server
        return server

    def refusals_ahead(self, starts: list[tuple[Path, tuple[str, ...], dict[str, str] | None]]) -> None:
        """Start these servers that must refuse to start, REFUSING_AT_ONCE at a time, now;
        ``start_expecting_failure`` with the same arguments then returns the recorded outcome.
        A refusal is the API server's start-up only (no engine busy-polls): three at once
        share the two cores without starving anything, in half the time of one after another."""
        def one(start: tuple[Path, tuple[str, ...], dict[str, str] | None]) -> None:
            model, args, env = start
            try:
                outcome = self._refuse(model, args, env, 180)
            except AssertionError as exc:  # it started: the test that expects a refusal says so
                outcome = (0, str(exc))
            self._refused[_refusal_key(model, args, env)] = outcome

        with ThreadPoolExecutor(REFUSING_AT_ONCE) as pool:
            list(pool.map(one, starts))

    def start_expecting_failure(
        self, model: Path, *args: str, env: dict[str, str] | None = None, timeout_s: float = 180
    ) -> tuple[int | None, str]:
        """Start a server that must refuse to start; returns (exit code, its log)."""
        done = self._refused.pop(_refusal_key(model, args, env), None)
        return done if done is not None else self._refuse(model, args, env, timeout_s)

    def _refuse(self, model: Path, args: tuple[str, ...], env: dict[str, str] | None,
                timeout_s: float) -> tuple[int | None, str]:
        with self._lock:
            self._count += 1
            count = self._count
        server = vllm_server(
            model, args, env=env, log_path=self.log_dir / f"vllm-{count}-fail.log",
            name=f"vllm-{count}",
        )
        try:
            server.start(timeout_s=timeout_s)
        except Exception:  # noqa: BLE001 - the failure is what we want to observe
            code = server.stop()
            return code, server.log_path.read_text(errors="replace")
        server.stop()
        raise AssertionError(f"server started although it should have refused:\n{server.argv}")

    @staticmethod
    def log_of(server: ManagedServer) -> str:
        return server.log_path.read_text(errors="replace")

    def _stop(self, key: tuple[object, ...]) -> None:
        self._live.pop(key).stop()

    def stop_all(self) -> None:
        self.make_room(MAX_LIVE_SERVERS)

    def make_room(self, outside: int) -> None:
        """Stop the least recently used servers so that ``outside`` servers started by hand fit
        under MAX_LIVE_SERVERS beside the pool's (the ones used last stay up for the tests after)."""
        while self._live and (len(self._live) > MAX_LIVE_SERVERS - outside
                              or not memory_for(outside, outside << 30)):
            self._stop(self._victim())

    def _victim(self) -> tuple[object, ...]:
        """The least recently used server, sparing the two default configurations (SHARED_ARGS)
        while another can go: most tests use them, and plain LRU restarted each three times."""
        spare = [k for k in self._live if not _shared(k)]
        return spare[0] if spare else next(iter(self._live))


def available_gib() -> float:
    """MemAvailable of /proc/meminfo, in GiB (the kernel's estimate of what a start can take)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / (1 << 20)
    return float("inf")


def memory_for(servers: int, kv_cache_bytes: int) -> bool:
    """Whether ``servers`` more servers with that much KV in all fit beside what runs now."""
    return available_gib() >= FREE_GIB + servers * SERVER_GIB + kv_cache_bytes / (1 << 30)


def _shared(key: tuple[object, ...]) -> bool:
    model, args, kv_cache_bytes, env = key
    return Path(str(model)).name == "tiny" and args in SHARED_ARGS and kv_cache_bytes == 1 << 30 and not env


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_model(tiny_models: TinyModels) -> Path:
    """The default shape: 4 layers, 2 KV heads × head_dim 64, bf16."""
    return tiny_models()


@pytest.fixture(scope="session")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServers]:
    servers = VllmServers(tmp_path_factory.mktemp("server-logs"))
    yield servers
    servers.stop_all()


ServerFactory = Callable[..., ManagedServer]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """CI's log says what the servers cost: starts, seconds, and configurations started twice
    (the pool keeps two alive; a test order that alternates configurations restarts them)."""
    if not STARTS:
        return
    again = Counter(args for args, _ in STARTS)
    terminalreporter.write_sep("=", f"vllm servers: {len(STARTS)} starts, "
                                    f"{sum(s for _, s in STARTS):.0f} s to ready, "
                                    f"{len(again)} configurations")
    for args, n in again.most_common():
        if n > 1:
            terminalreporter.write_line(f"started {n}x: {args}")
