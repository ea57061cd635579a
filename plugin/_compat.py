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
from pathlib import Path
from typing import Any, NoReturn

_WRAPPED_MARK = "_kvops_wrapped"


def plugin_logger() -> logging.Logger:
    from vllm.logger import init_logger

    logger: logging.Logger = init_logger("vllm.plugins.kvops")
    return logger


def install_config_hook() -> None:
    """Wrap the current platform's config hook once per process."""
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    original = platform_cls.check_and_update_config
    if getattr(original, _WRAPPED_MARK, False):
        return

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        from kvops.plugin.hooks import after_platform_config, before_platform_config

        _fail_fast(before_platform_config, vllm_config)
        original(vllm_config)
        _fail_fast(after_platform_config, vllm_config)

    setattr(check_and_update_config, _WRAPPED_MARK, True)
    platform_cls.check_and_update_config = classmethod(check_and_update_config)


def _fail_fast(hook: Any, vllm_config: Any) -> None:
    """Run a hook; a KvopsPluginError stops the process with one line and exit code 2."""
    from kvops.plugin.errors import KvopsPluginError

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
    if os.getppid() != int(frontend):
        os.kill(os.getppid(), signal.SIGKILL)
    os._exit(2)



def register_offload_connector() -> None:
    """Register the kvops offload connector by dotted path (imported lazily by vLLM)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvops.plugin.offload import CONNECTOR_MODULE, CONNECTOR_NAME

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)

ATTENTION_MODULE = "vllm.model_executor.layers.attention.attention"


def install_attention_hook() -> None:
    """Wrap ``Attention.process_weights_after_loading`` in this process (fp8 scales), when vLLM
    imports the attention module: importing it ourselves costs ~5 s in processes (front end,
    ``vllm serve --help``) that never load a model.

    vLLM calls it for every attention layer in every worker after the quant methods have set
    checkpoint scales (vllm/model_executor/model_loader/utils.py:195-200), with the current
    VllmConfig set (vllm/v1/worker/gpu_worker.py:587-594): the last word on a layer's scales.
    """
    module = sys.modules.get(ATTENTION_MODULE)
    if module is not None:
        _wrap_process_weights(module.Attention)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs _wrap_process_weights right after vLLM's attention module executes."""

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
            _wrap_process_weights(module.Attention)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _wrap_process_weights(attention_cls: Any) -> None:
    original = attention_cls.process_weights_after_loading
    if getattr(original, _WRAPPED_MARK, False):
        return

    def process_weights_after_loading(self: Any, act_dtype: Any) -> None:
        original(self, act_dtype)
        from vllm.config import get_current_vllm_config

        from kvops.plugin.hooks import settings_of

        vllm_config = get_current_vllm_config()
        settings = settings_of(vllm_config)
        if settings is not None and settings.kv_scales is not None:
            from kvops.plugin.fp8.worker import after_attention_weights

            after_attention_weights(self, vllm_config, settings.kv_scales)

    setattr(process_weights_after_loading, _WRAPPED_MARK, True)
    attention_cls.process_weights_after_loading = process_weights_after_loading
