"""Start and stop the staging fleet: every process is a ManagedServer on a loopback port chosen
at run time, in its own process group, stopped in reverse order."""

from __future__ import annotations

import json
import shutil
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import requests

from kvops.core.errors import KvopsError
from kvops.core.proc import free_port
from kvops.ops.launch import ManagedServer, vllm_server
from kvops.ops.staging.configs import alertmanager_yml, fast_rules, haproxy_cfg, prometheus_yml
from kvops.ops.staging.webhook import Notification, Webhook

BLOCK_BYTES = 256 * 1024  # one 128-token block of the default tiny model (4 layers x 2 x 64 x bf16)
JOB = "vllm"
# Debian package -> executable the fleet runs (`make setup` installs them).
EXECUTABLES = {"prometheus": "prometheus", "prometheus-alertmanager": "prometheus-alertmanager",
               "haproxy": "haproxy"}


@dataclass(frozen=True)
class FleetSpec:
    """What the fleet serves and how small its KV is.

    Replica 0 offloads to a real LMCache server and runs strict KV reservations (it sheds load
    with 429 instead of preempting); replica 1 runs the plugin with admission off (policy ``off``
    installs neither the gate nor the front door), so the KV incident the alerts are about can
    happen there. Both require
    ``api_key`` and serve ``served_model_name``."""

    model: Path
    root: Path
    alerts: Path
    api_key: str = "staging-key"
    served_model_name: str = "staging-llm"
    kv_cache_bytes: int = 16 * BLOCK_BYTES
    max_model_len: int = 1024
    fast_alerts: bool = True
    replica_env: tuple[tuple[str, str], ...] = ()
    """Extra environment for the replicas' `vllm serve` (e.g. the e2e tests' executor)."""


@dataclass
class Fleet:
    spec: FleetSpec
    on_notification: Callable[[Notification], None] | None = None
    replicas: list[ManagedServer] = field(default_factory=list)
    lmcache: ManagedServer | None = None
    proxy: ManagedServer | None = None
    prometheus: ManagedServer | None = None
    alertmanager: ManagedServer | None = None
    webhook: Webhook | None = None
    offload_yaml: Path | None = None

    @property
    def proxy_url(self) -> str:
        assert self.proxy is not None
        return self.proxy.url

    @property
    def prometheus_url(self) -> str:
        assert self.prometheus is not None
        return self.prometheus.url

    @property
    def alertmanager_url(self) -> str:
        assert self.alertmanager is not None
        return self.alertmanager.url

    def instances(self) -> list[str]:
        """Prometheus' ``instance`` label of each replica (host:port)."""
        return [f"{r.host}:{r.port}" for r in self.replicas]

    def start(self) -> Fleet:
        """Start everything, or stop what started and raise."""
        _require_executables()
        self.spec.root.mkdir(parents=True, exist_ok=True)
        try:
            self._start_lmcache_and_replicas()
            self._start_proxy()
            self.webhook = Webhook(self.on_notification)
            self.webhook.start()
            self._start_alertmanager()
            self._start_prometheus()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for server in (self.prometheus, self.alertmanager, self.proxy, *self.replicas, self.lmcache):
            if server is not None and server.process is not None:
                server.stop()
                server.process = None  # a second stop() must not signal a recycled process group
        if self.webhook is not None:
            self.webhook.stop()
            self.webhook = None

    def kill_replica(self, index: int) -> None:
        """Stop one replica the way a crash would look to Prometheus: its target stops answering."""
        self.replicas[index].stop(grace_s=5)
        self.replicas[index].process = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.spec.api_key}"}

    def summary(self) -> dict[str, str]:
        return {"proxy": self.proxy_url, "prometheus": self.prometheus_url,
                "alertmanager": self.alertmanager_url,
                "webhook": self.webhook.url if self.webhook else "",
                "replicas": " ".join(r.url for r in self.replicas),
                "lmcache": self.lmcache.url if self.lmcache else "",
                "model": self.spec.served_model_name, "api_key": self.spec.api_key,
                "logs": str(self.spec.root)}

    # -- the parts ---------------------------------------------------------------------------

    def _start_lmcache_and_replicas(self) -> None:
        """LMCache and the replicas side by side: replica 1 (no offload) from the start,
        replica 0, whose plugin checks the LMCache server at start-up, once LMCache answers."""
        lmcache = self._lmcache()
        replicas = self._replicas()
        _start_all([[(lmcache, "/healthcheck"), (replicas[0], "/health")], [(replicas[1], "/health")]])

    def _lmcache(self) -> ManagedServer:
        root = self.spec.root / "lmcache"
        root.mkdir(parents=True, exist_ok=True)
        http_port = free_port()
        settings: dict[str, object] = {"port": free_port(), "http_port": http_port, "l1_gib": 0.25,
                    "disk_path": str(root / "l2"), "disk_gib": 0.016, "heartbeat_s": 1.0}
        config = root / "kvops.yaml"
        config.write_text(json.dumps({"offload": settings}))
        kvops = str(Path(sys.executable).with_name("kvops"))
        self.lmcache = ManagedServer(
            name="lmcache", argv=[kvops, "offload", "serve", "--config", str(config),
                                  "--log", str(root / "lmcache.log")],
            port=http_port, log_path=root / "serve.out",
            env=_env({"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}),
        )
        self.offload_yaml = config
        return self.lmcache

    def _replicas(self) -> list[ManagedServer]:
        spec = self.spec
        common = ("--api-key", spec.api_key, "--served-model-name", spec.served_model_name,
                  "--max-model-len", str(spec.max_model_len))
        kvops_sections = [
            {"config": str(self.offload_yaml), "admission": {"policy": "strict", "max_queued_requests": 64}},
            {"admission": {"policy": "off", "max_queued_requests": 64}},
        ]
        for i, section in enumerate(kvops_sections):
            self.replicas.append(vllm_server(
                spec.model, (*common, "--additional-config", json.dumps({"kvops": section})),
                kv_cache_bytes=spec.kv_cache_bytes, env=dict(spec.replica_env),
                log_path=spec.root / f"replica-{i}.log", name=f"replica-{i}"))
        return self.replicas

    def _start_proxy(self) -> None:
        port = free_port()
        cfg = self.spec.root / "haproxy.cfg"
        cfg.write_text(haproxy_cfg(port, [(r.name, f"{r.host}:{r.port}") for r in self.replicas]))
        self.proxy = ManagedServer(
            name="haproxy", argv=[_exe("haproxy"), "-db", "-f", str(cfg)], port=port,
            log_path=self.spec.root / "haproxy.log", env=_env())
        self.proxy.start(health_path="/haproxy-health", timeout_s=60)

    def _start_alertmanager(self) -> None:
        assert self.webhook is not None
        port = free_port()
        root = self.spec.root / "alertmanager"
        root.mkdir(parents=True, exist_ok=True)
        (root / "alertmanager.yml").write_text(alertmanager_yml(self.webhook.url))
        self.alertmanager = ManagedServer(
            name="alertmanager",
            argv=[_exe("prometheus-alertmanager"), f"--config.file={root / 'alertmanager.yml'}",
                  f"--storage.path={root / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                  "--cluster.listen-address="],
            port=port, log_path=root / "alertmanager.log", env=_env())
        self.alertmanager.start(health_path="/-/ready", timeout_s=60)

    def _start_prometheus(self) -> None:
        assert self.alertmanager is not None
        self.prometheus = start_prometheus(self.spec.root / "prometheus", self.instances(), self.spec.alerts,
                                           f"127.0.0.1:{self.alertmanager.port}", fast=self.spec.fast_alerts)
        wait_targets_up(self.prometheus.url, len(self.replicas))


def start_prometheus(root: Path, targets: list[str] | Path, alerts: Path, alertmanager: str | None,
                     fast: bool = True) -> ManagedServer:
    """A started Prometheus scraping ``targets`` (host:port list, or a file_sd JSON file) as job
    JOB every second with ``alerts`` loaded (staging durations when ``fast``)."""
    port = free_port()
    root.mkdir(parents=True, exist_ok=True)
    rules = root / "alerts.yaml"
    text = alerts.read_text()
    rules.write_text(fast_rules(text) if fast else text)
    (root / "prometheus.yml").write_text(prometheus_yml(
        str(targets) if isinstance(targets, Path) else targets, str(rules), alertmanager, job=JOB))
    server = ManagedServer(
        name="prometheus",
        argv=[_exe("prometheus"), f"--config.file={root / 'prometheus.yml'}",
              f"--storage.tsdb.path={root / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
              "--web.enable-lifecycle"],
        port=port, log_path=root / "prometheus.log", env=_env())
    server.start(health_path="/-/ready", timeout_s=60)
    return server


def _start_all(chains: list[list[tuple[ManagedServer, str]]]) -> None:
    """Start chains of servers side by side (each vLLM takes a minute or more to load), the
    servers of a chain one after another, each once the one before answers on its health path."""
    errors: list[BaseException] = []

    def one(chain: list[tuple[ManagedServer, str]]) -> None:
        try:
            for server, health_path in chain:
                server.start(health_path=health_path)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, with the log tail
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(c,)) for c in chains]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def wait_targets_up(prometheus: str, n: int, timeout_s: float = 60) -> None:
    """Return once ``prometheus`` has scraped ``n`` targets of the vLLM job up; KvopsError after
    ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        data = requests.get(prometheus + "/api/v1/query", params={"query": f"up{{job='{JOB}'}} == 1"},
                            timeout=5).json()
        if len(data.get("data", {}).get("result", [])) >= n:
            return
        time.sleep(0.5)
    raise KvopsError(f"Prometheus at {prometheus} did not see {n} replicas up within {timeout_s:.0f}s")


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    import os

    return {**os.environ, **(extra or {})}


def _exe(name: str) -> str:
    found = shutil.which(EXECUTABLES[name]) or shutil.which(EXECUTABLES[name], path="/usr/sbin:/usr/bin")
    if not found:
        raise KvopsError(f"`{EXECUTABLES[name]}` is not installed: run `make setup` (Debian package {name})")
    return found


def _require_executables() -> None:
    missing = [name for name in EXECUTABLES if not (shutil.which(EXECUTABLES[name])
                                                   or shutil.which(EXECUTABLES[name], path="/usr/sbin:/usr/bin"))]
    if missing:
        raise KvopsError(f"the staging fleet needs {' '.join(missing)}: run `make setup` "
                         f"(or `sudo apt-get install {' '.join(missing)}`)")
