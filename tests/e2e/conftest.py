"""Real servers for e2e tests: tiny models built once per session, `vllm serve` started once
per distinct configuration and shared across tests, at most MAX_LIVE_SERVERS alive at a time
(this machine has 2 cores; each CPU server busy-polls most of one).

Usage in a test::

    def test_x(vllm, tiny_model):
        server = vllm(tiny_model, "--max-model-len", "2048")
        requests.post(server.url + "/v1/completions", ...)

A server that fails to start raises ServerStartError carrying its log tail; ``vllm.log_of``
gives the log of any server for assertions on what vLLM printed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvops.ops.launch import ManagedServer, vllm_server
from kvops.ops.models.tiny import TinyModelSpec, build_tiny_model

MAX_LIVE_SERVERS = 2

pytestmark = pytest.mark.e2e


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
        while len(self._live) >= MAX_LIVE_SERVERS:
            self._stop(next(iter(self._live)))
        self._count += 1
        server = vllm_server(
            model, args, kv_cache_bytes=kv_cache_bytes, env=env,
            log_path=self.log_dir / f"vllm-{self._count}.log", name=f"vllm-{self._count}",
        )
        server.start()
        self._live[key] = server
        return server

    def start_expecting_failure(
        self, model: Path, *args: str, env: dict[str, str] | None = None, timeout_s: float = 180
    ) -> tuple[int | None, str]:
        """Start a server that must refuse to start; returns (exit code, its log)."""
        self._count += 1
        server = vllm_server(
            model, args, env=env, log_path=self.log_dir / f"vllm-{self._count}-fail.log",
            name=f"vllm-{self._count}",
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
        while self._live:
            self._stop(next(iter(self._live)))


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
