"""Puts the real stack into a runbook state and runs a page's command block there.

Servers come from the e2e session pool (tests/e2e/conftest.py ``vllm``), so a configuration
starts once per session (the later states' servers start ahead, at low priority, while the
earlier states' commands run) and at most MAX_LIVE_SERVERS run at a time; the load of a state runs in background threads only while
that state is active.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
from e2e.conftest import AHEAD_AT_ONCE, Want
from load_threads import LoadThreads

from kvops.core.prom import parse_metrics, samples_by_name, selector_sum

from .states import STATES, State, state

COMMAND_TIMEOUT_S = 420
READY_TIMEOUT_S = 480  # generous: several CPU servers share two cores while tests run
VENV_BIN = str(Path(sys.executable).parent)


@dataclass
class CommandResult:
    exit_code: int
    output: str


def plain_refusals(models: Callable[..., Path]) -> list[tuple[Path, tuple[str, ...], None]]:
    """The refusing states' starts that need no LMCache and read no file a page writes
    (startup-refused): the runbook module's ``refusals`` hook, so that they start beside the unit
    tests; ``Stack.enter`` then takes the recorded outcome (``start_expecting_failure``, same
    model, arguments and environment) instead of a start in the foreground (~35 s)."""
    return [(models(**dict(st.model_shape)), st.args, None) for st in STATES
            if st.server and st.refuses_start and not st.lmcache and "{" not in " ".join(st.args)]


class Stack:
    """The one active state: its server, its load and the environment commands see."""

    def __init__(self, servers: Any, models: Callable[..., Path], root: Path,
                 visits: Sequence[str] = ()) -> None:
        self.servers = servers
        self.models = models
        self.root = root
        self.visits = list(visits)
        """The states the session's selected tests enter, in order: the later ones' servers
        that need no LMCache and start are started ahead (VllmServers.ahead)."""
        self.active: str | None = None
        self.env: dict[str, str] = {}
        self._load: LoadThreads | None = None
        self.lmcache = LmcacheServer(root / "lmcache")

    def workdir(self, page: str) -> Path:
        path = self.root / "pages" / page.removesuffix(".md")
        path.mkdir(parents=True, exist_ok=True)
        return path

    def enter(self, name: str) -> dict[str, str]:
        if name != self.active:
            self.leave()
            self.env = self._start(state(name))
            self.active = name
        return self.env

    def leave(self) -> None:
        if self._load is not None:
            self._load.stop()
            self._load = None
        self.active = None

    def close(self) -> None:
        self.leave()
        self.lmcache.stop()

    def _want(self, st: State) -> Want:
        args = tuple(a.replace("{pages}", str(self.root / "pages"))
                     .replace("{kvops_yaml}", str(self.lmcache.config)) for a in st.args)
        return Want(self.models(**dict(st.model_shape)), args, kv_cache_bytes=st.kv_cache_bytes)

    def ahead(self, *after: Want) -> None:
        """Between tests: the next later states' servers (AHEAD_AT_ONCE of them) start ahead
        where the pool has a place for them (the state entered last asked for some only once),
        then ``after`` (the next modules'). The states' keep no memory beside them for others:
        they are what the module asks for next (with two servers' memory kept, a state's own
        live server left room for none, and five states started in the foreground)."""
        if self.active is not None:
            self._states_ahead(state(self.active))
            self.servers.ahead(*after)

    def _states_ahead(self, st: State) -> None:
        """The next later states' servers (AHEAD_AT_ONCE) start ahead. One that offloads
        (offload-down's) needs the LMCache server up while it starts (its plugin checks it at
        start-up), which is then started now, and is ready before a refusal's state stops it:
        started in its own state, after the refusal, it was a start in the foreground (27-39 s
        in CI runs)."""
        later = self._later_plain(st)[:AHEAD_AT_ONCE]
        # not one the pool holds: offload-restored's is offload-down's, whose LMCache stays down
        offloading = [want for nxt, want in later if nxt.lmcache and not self.servers.holds(want)]
        if offloading:
            self.lmcache.start()
        self.servers.ahead(*(want for _, want in later), reserve=0)

    def _later_plain(self, st: State) -> list[tuple[State, Want]]:
        """The states visited after this one whose servers can start now, nearest first: they
        run (no refusal) and read no file that a page has not written yet."""
        later = self.visits[self.visits.index(st.name) + 1:] if st.name in self.visits else []
        pages = re.escape(str(self.root / "pages")) + r"/[^\s\"']+"
        wants = []
        for nxt in map(state, later):
            if not nxt.server or nxt.refuses_start:
                continue
            want = self._want(nxt)
            if all(Path(m).exists() for a in want.args for m in re.findall(pages, a)):
                wants.append((nxt, want))
        return wants

    def _start(self, st: State) -> dict[str, str]:
        want = self._want(st)
        model, args = want.model, want.args
        assert model is not None
        env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}",
               "MODEL_DIR": str(model), "KVOPS_DEBUG": "0"}
        if st.lmcache:
            env.update(LMCACHE_URL=self.lmcache.url, KVOPS_YAML=str(self.lmcache.config))
            if st.lmcache == "up" or (not st.refuses_start and not self.servers.holds(want)):
                self.lmcache.start()  # a running "down" state needs it up while vLLM starts
            elif st.refuses_start:
                # the later offloading states' servers starting ahead need it until ready
                self.servers.finish_ahead(*(w for nxt, w in self._later_plain(st) if nxt.lmcache))
                self.lmcache.stop()
        self.servers.new_phase()  # the servers of states already left may make room
        server = None
        if st.server and st.refuses_start:
            code, log = self.servers.start_expecting_failure(model, *args, timeout_s=READY_TIMEOUT_S)
            log_path = self.root / f"{st.name}.log"
            log_path.write_text(log)
            env.update(VLLM_LOG=str(log_path), VLLM_EXIT_CODE=str(code))
        elif st.server:
            server = self.servers.many(want)[0]
            env.update(VLLM_URL=server.url, VLLM_LOG=str(server.log_path))
        # this state's server is up (or refused); the next ones are what the module asks for
        # next, so no memory is kept beside them for others (VllmServers.ahead's ``reserve``)
        self._states_ahead(st)
        if server is None:
            return env
        if st.lmcache == "down":
            self.lmcache.stop()
        if st.load is not None:
            self._load = LoadThreads(server.url, str(model), st.load)
        _wait_for(server.url, st.ready)
        return env

    def run(self, command: str, cwd: Path) -> CommandResult:
        proc = subprocess.run(  # noqa: S603 - the page's own command, in a scratch directory
            ["bash", "-euo", "pipefail", "-c", command], env=self.env, cwd=cwd,
            capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False,
        )
        return CommandResult(proc.returncode, proc.stdout + proc.stderr)


def _wait_for(url: str, ready: dict[str, float],
              scrape: Callable[[str], str] | None = None) -> None:
    """Block until every ``ready`` metric reaches its minimum (a precondition, not a timing)."""
    if not ready:
        return
    get = scrape or (lambda u: requests.get(u + "/metrics", timeout=10).text)
    deadline = time.monotonic() + READY_TIMEOUT_S
    values: dict[str, float] = {}
    while time.monotonic() < deadline:
        text = get(url)
        sample = parse_metrics(text)
        values = {key: _special(key, text) if key.startswith("kvops_") else sample.get(key)
                  for key in ready}
        if all(values[key] >= minimum for key, minimum in ready.items()):
            return
        time.sleep(1.0)
    raise AssertionError(f"state never reached {ready} (last seen {values}) at {url}")


def _special(key: str, metrics_text: str) -> float:
    """kvops conditions: rejections so far, LMCache server seen up / down by the plugin, the
    connector degraded / recovered (read whatever labels the series carry: model_name, engine)."""
    by_name = samples_by_name(metrics_text)

    def values(name: str) -> list[float]:
        return [value for _, value in by_name.get(name, [])]

    if key == "kvops_rejected":
        return selector_sum(by_name, 'kvops_admission_decisions_total{decision="rejected"}')
    up = values("kvops_offload_server_up")
    if key == "kvops_offload_server_up":
        return 1.0 if up and up[0] == 1.0 else 0.0
    if key == "kvops_offload_server_down":
        return 1.0 if up and up[0] == 0.0 else 0.0
    degraded = values("kvops_offload_degraded")
    if key == "kvops_offload_degraded":
        return max(degraded, default=0.0)
    if key == "kvops_offload_recovered":
        return 1.0 if degraded and max(degraded) == 0.0 else 0.0
    raise KeyError(key)


class LmcacheServer:
    """`kvops offload serve` on ports fixed for the session, so vLLM's config stays valid
    across a stop and a restart (what an operator does)."""

    def __init__(self, root: Path) -> None:
        from kvops.core.proc import free_port

        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.settings = {"port": free_port(), "http_port": free_port(), "l1_gib": 0.25,
                         "disk_path": str(root / "l2"), "disk_gib": 0.016, "heartbeat_s": 1.0}
        self.config = root / "kvops.yaml"
        self.config.write_text(json.dumps({"offload": self.settings}))
        self.url = f"http://127.0.0.1:{self.settings['http_port']}"
        self._serve: Any = None

    def start(self) -> None:
        from kvops.ops.launch import ManagedServer

        if self._serve is not None and self._serve.returncode() is None:
            return
        n = len(list(self.root.glob("serve-*.out"))) + 1
        self._serve = ManagedServer(
            name="kvops-offload-serve",
            argv=[str(Path(VENV_BIN) / "kvops"), "offload", "serve", "--config", str(self.config),
                  "--log", str(self.root / f"lmcache-{n}.log")],
            port=int(self.settings["http_port"]), log_path=self.root / f"serve-{n}.out",
            env={**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"},
        )
        self._serve.start(health_path="/healthcheck", timeout_s=READY_TIMEOUT_S)

    def stop(self) -> None:
        if self._serve is not None:
            self._serve.stop()
            self._serve = None
