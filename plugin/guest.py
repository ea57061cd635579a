"""Whether kvops enters this vLLM process, and what vLLM sees when it does not.

vLLM calls each general plugin unguarded in every process it starts (vllm/plugins/__init__.py
``load_general_plugins``: ``for func in plugins.values(): func()``), so an exception from
``register()`` would stop every ``vllm serve`` of the environment, those that never asked for
kvops too. kvops therefore enters only a vLLM of the range it supports (kvops.core.vllm_range)
whose hook points all are where that range has them, and installs its hooks all or none
(``_compat.install_all``). Where it cannot, a server that asks for kvops (``kvops_asked``)
refuses with one line naming the installed and supported versions (exit 2), and any other runs
as if kvops were not installed, with one warning line.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from kvops import __version__
from kvops.core.vllm_range import SUPPORTED_VLLM, SUPPORTED_VLLM_MINOR, supports_vllm
from kvops.plugin import _compat, hooks
from kvops.plugin.offload import CONNECTOR_MODULE, CONNECTOR_NAME

STOOD_DOWN_ENV = "KVOPS_STOOD_DOWN_PID"
"""The pid of the process that said kvops stays out: its engine processes, which inherit the
environment, stay out without saying it again (one warning line per server)."""
FIX = (f"install a vLLM kvops supports (pip install 'vllm=={SUPPORTED_VLLM_MINOR}.*') or serve "
       "without kvops settings")

logger = logging.getLogger("vllm.plugins.kvops")


def enter() -> bool:
    """Install kvops' hooks in this process; False where kvops stays out (the module says how)."""
    version = _compat.installed_vllm()
    if not supports_vllm(version):
        return stay_out(obstacle(version))
    try:
        _compat.install_all({
            "the platform config hook (Platform.check_and_update_config)": partial(
                _compat.install_config_hook, hooks.before_platform_config, hooks.after_platform_config),
            "the KV connector registry (KVConnectorFactory)": partial(
                _compat.register_connector, CONNECTOR_NAME, CONNECTOR_MODULE),
            _compat.ATTENTION_HOOK: partial(
                _compat.install_attention_hook, hooks.after_attention_weights, late_failure),
        })
    except _compat.HookError as exc:
        return stay_out(obstacle(version, exc))
    return True


def obstacle(version: str, hook: _compat.HookError | None = None) -> str:
    """Why kvops cannot enter: the installed and the supported vLLM, and the hook that failed."""
    said = f"vLLM {version} is installed and kvops {__version__} supports vLLM {SUPPORTED_VLLM}"
    return f"{said} only" if hook is None else f"{said}, but cannot install {hook}"


def stay_out(why: str, argv: Sequence[str] | None = None) -> bool:
    """Refuse a server that asks for kvops; let any other run without kvops, saying so once."""
    asked = kvops_asked(sys.argv if argv is None else argv)
    if asked is not None:
        _compat.refuse_in_engine(f"{why}; this server asks for kvops ({asked}): {FIX}")
    if not _said_by_ancestor():
        logger.warning("kvops: %s: kvops stays out, this vLLM runs as without it (nothing "
                       "patched; kvops settings would be refused)", why)
        os.environ[STOOD_DOWN_ENV] = str(os.getpid())
    return False


def late_failure(error: _compat.HookError) -> None:
    """The attention hook failed where vLLM imports the module (a worker), after its source
    read well: fp8 scales would not be applied. Refuse where kvops was asked, else say it."""
    why = obstacle(_compat.installed_vllm(), error)
    if kvops_asked(sys.argv) is not None:
        _compat.refuse_in_engine(f"{why}: {FIX}")
    logger.warning("kvops: %s: kvops' fp8 scales cannot be applied in this vLLM", why)


def _said_by_ancestor() -> bool:
    """Whether this process's parent or grandparent (front end -> engine core -> worker) said
    it: a marker left by another process tree (a test run's) is not one."""
    marker = os.environ.get(STOOD_DOWN_ENV)
    parent = os.getppid()
    return marker is not None and marker in {str(parent), str(_compat.parent_of(parent))}


def kvops_asked(argv: Sequence[str]) -> str | None:
    """The flag of this command line that asks vLLM for kvops, or None.

    The command line is all there is to read: vLLM loads general plugins in the front end while
    it builds its parser (vllm/engine/arg_utils.py ``AsyncEngineArgs.add_cli_args``), and its
    engine processes get the same ``sys.argv`` (multiprocessing passes it on). kvops is asked for
    by ``--additional-config`` with a ``kvops`` key, our connector in ``--kv-transfer-config``,
    or our scheduler in ``--scheduler-cls``, in any spelling vLLM's parser takes (``_`` for
    ``-``, ``--flag=value``, ``--flag.key value``, a ``--config`` YAML file).
    """
    for flag, value in _flag_values(argv):
        if _asks_for_kvops(flag, value):
            return f"--{flag}"
    return None


def _flag_values(argv: Sequence[str]) -> Iterator[tuple[str, str]]:
    """(flag, value) pairs, flags spelled as vLLM's parser normalises them (``_`` to ``-``
    before the first dot: vllm/utils/argparse_utils.py ``FlexibleArgumentParser.parse_args``)."""
    args = list(argv)
    for index, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name, equals, value = arg[2:].partition("=")
        if not equals:
            value = args[index + 1] if index + 1 < len(args) else ""
        head, dot, rest = name.partition(".")
        flag = head.replace("_", "-") + dot + rest
        if flag == "config":
            yield from _config_file_values(Path(value))
        else:
            yield flag, value


def _config_file_values(path: Path) -> Iterator[tuple[str, str]]:
    """The flags of a ``--config`` YAML file (vLLM's ``_pull_args_from_config``); none where it
    does not read as a mapping (vLLM itself says what is wrong with it)."""
    import yaml

    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield str(key).replace("_", "-"), value if isinstance(value, str) else json.dumps(value)


def _asks_for_kvops(flag: str, value: str) -> bool:
    base, _, path = flag.partition(".")
    if base == "additional-config":
        if path:
            return path.split(".")[0] == "kvops"
        doc = _json(value)
        return doc.get("kvops") is not None if isinstance(doc, dict) else '"kvops"' in value
    if base == "kv-transfer-config":
        return CONNECTOR_NAME in value
    if base == "scheduler-cls":
        return "kvops" in value
    return False


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
