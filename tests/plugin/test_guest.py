"""register() in a vLLM kvops does not support: all hooks or none, one warning line without kvops
settings, one refusal line (exit 2) with them, never an exception out of register().

A vLLM of another version or with a renamed internal cannot be installed here: those tests set
``vllm.__version__`` or remove a hook point in this process (monkeypatch), a simulated upgrade.
tests/e2e/test_guest_e2e.py does the same to real ``vllm serve`` processes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvops.plugin as plugin
from kvops import __version__
from kvops.core.vllm_range import SUPPORTED_VLLM
from kvops.plugin import _compat, guest
from kvops.plugin.offload import CONNECTOR_NAME

OTHER_VERSION = "0.33.0"
ASKING = ["vllm", "serve", "m", "--additional-config", json.dumps({"kvops": {}})]


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


@pytest.fixture
def kvops_log() -> Iterator[list[str]]:
    """What kvops logs (vLLM's "vllm" logger does not propagate to pytest's root handler)."""
    handler = Lines()
    logger = logging.getLogger("vllm.plugins.kvops")
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


@pytest.fixture
def hook_points(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, object]]:
    """vLLM's objects kvops would change, as they are before the test (none hooked yet), put
    back after it; register() starts afresh in this process, with a command line without kvops."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    config_hook = platform_cls.__dict__["check_and_update_config"]
    assert not getattr(config_hook.__func__, "_kvops_wrapped", False), "a test left the hook in place"
    registered = KVConnectorFactory._registry.pop(CONNECTOR_NAME, None)
    finders = [f for f in sys.meta_path if isinstance(f, _compat._PatchOnImport)]
    for finder in finders:
        sys.meta_path.remove(finder)
    monkeypatch.setattr(sys, "argv", ["vllm", "serve", "m"])
    monkeypatch.setenv(guest.STOOD_DOWN_ENV, "")  # no marker; removed again after the test
    plugin.reset_for_tests()
    before = _snapshot()
    yield before
    platform_cls.check_and_update_config = config_hook
    attention = sys.modules.get(REAL_ATTENTION_MODULE)
    if before["attention"] is not None and attention is not None:
        attention.Attention.process_weights_after_loading = before["attention"]
    KVConnectorFactory._registry.pop(CONNECTOR_NAME, None)
    if registered is not None:
        KVConnectorFactory._registry[CONNECTOR_NAME] = registered
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _compat._PatchOnImport)]
    sys.meta_path[0:0] = finders
    plugin.reset_for_tests()


# The real module's name, read once: a test that simulates a moved module patches
# _compat.ATTENTION_MODULE, and the snapshot must still look where the hook would have gone.
REAL_ATTENTION_MODULE = _compat.ATTENTION_MODULE


def _snapshot() -> dict[str, object]:
    """The hook points as objects (compared by identity) and the connector registry's names."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.platforms import current_platform

    attention = sys.modules.get(REAL_ATTENTION_MODULE)
    return {
        "config_hook": type(current_platform).__dict__["check_and_update_config"],
        "connectors": sorted(KVConnectorFactory._registry),
        "finders": list(sys.meta_path),
        "attention": attention and attention.Attention.__dict__["process_weights_after_loading"],
    }


def _same(before: dict[str, object], after: dict[str, object]) -> bool:
    """The same objects at the hook points (``is``: a wrapper is another object) and the same
    connector names and import finders."""
    return (before["config_hook"] is after["config_hook"] and before["attention"] is after["attention"]
            and before["connectors"] == after["connectors"] and before["finders"] == after["finders"])


def _warnings(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("WARNING")]


def test_another_vllm_version_is_left_as_it_was_with_one_warning(hook_points, monkeypatch, kvops_log):
    import vllm

    monkeypatch.setattr(vllm, "__version__", OTHER_VERSION)  # simulated upgrade
    plugin.register()
    assert _same(hook_points, _snapshot())
    assert plugin.stays_out()
    assert _warnings(kvops_log) == [
        f"WARNING kvops: vLLM {OTHER_VERSION} is installed and kvops {__version__} supports vLLM "
        f"{SUPPORTED_VLLM} only: kvops stays out, this vLLM runs as without it (nothing patched; "
        "kvops settings would be refused)"]
    assert os.environ[guest.STOOD_DOWN_ENV] == str(os.getpid())


def test_the_same_register_in_a_supported_vllm_hooks_all_three(hook_points, kvops_log):
    """The control for the test above and the one below: their snapshots can differ."""
    plugin.register()
    after = _snapshot()
    assert after["config_hook"] is not hook_points["config_hook"]
    assert CONNECTOR_NAME in after["connectors"]  # type: ignore[operator]
    assert after["attention"] is not hook_points["attention"] or after["finders"] != hook_points["finders"]
    assert not plugin.stays_out()
    assert _warnings(kvops_log) == []


@pytest.mark.parametrize("missing", ["connector registry", "attention module"])
def test_a_missing_hook_point_undoes_the_hooks_installed_before_it(hook_points, monkeypatch, kvops_log, missing):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # simulated upgrades: vLLM renamed register_connector, or moved its attention module
    if missing == "connector registry":
        monkeypatch.delattr(KVConnectorFactory, "register_connector")
    else:
        monkeypatch.setattr(_compat, "ATTENTION_MODULE", "vllm.model_executor.layers.attention.moved")
    plugin.register()
    assert _same(hook_points, _snapshot())
    assert plugin.stays_out()
    warnings = _warnings(kvops_log)
    assert len(warnings) == 1
    assert f"vLLM {_compat.installed_vllm()} is installed" in warnings[0]
    assert f"supports vLLM {SUPPORTED_VLLM}, but cannot install the" in warnings[0]
    assert ("register_connector" if missing == "connector registry" else "moved") in warnings[0]


def test_with_kvops_settings_an_unsupported_vllm_refuses_with_one_line(hook_points, monkeypatch, capsys):
    import vllm

    monkeypatch.setattr(vllm, "__version__", OTHER_VERSION)  # simulated upgrade
    monkeypatch.setattr(sys, "argv", ASKING)
    monkeypatch.delenv(_compat.FRONTEND_PID_ENV, raising=False)
    with pytest.raises(SystemExit) as stop:
        plugin.register()
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"kvops: refusing to start: vLLM {OTHER_VERSION} is installed and kvops {__version__} "
        f"supports vLLM {SUPPORTED_VLLM} only; this server asks for kvops (--additional-config): "
        f"{guest.FIX}"]
    assert _same(hook_points, _snapshot())


def test_no_exception_leaves_register(hook_points, monkeypatch, kvops_log):
    def broken() -> str:  # a fault in kvops itself, which no installed vLLM produces
        raise RuntimeError("kvops bug\nin two lines")

    monkeypatch.setattr(_compat, "installed_vllm", broken)
    plugin.register()
    assert kvops_log == ["WARNING kvops: plugin not loaded, this vLLM runs as without it: "
                         "RuntimeError: kvops bug in two lines"]
    assert _same(hook_points, _snapshot())


def test_a_late_attention_failure_warns_or_refuses(monkeypatch, kvops_log, capsys):
    error = _compat.HookError(_compat.ATTENTION_HOOK, AttributeError("no Attention"))
    monkeypatch.setattr(sys, "argv", ["vllm", "serve", "m"])
    guest.late_failure(error)
    assert len(_warnings(kvops_log)) == 1
    assert "AttributeError: no Attention" in kvops_log[0]
    monkeypatch.setattr(sys, "argv", ASKING)
    monkeypatch.delenv(_compat.FRONTEND_PID_ENV, raising=False)
    with pytest.raises(SystemExit) as stop:
        guest.late_failure(error)
    assert stop.value.code == 2
    assert len(capsys.readouterr().err.splitlines()) == 1


STAY_OUT = "from kvops.plugin import guest; guest.stay_out('vLLM 9 is installed', argv=[])"


@pytest.mark.parametrize(("marker", "warns"), [("parent", False), ("other", True), (None, True)])
def test_an_engine_process_stays_out_without_saying_it_again(marker, warns):
    """A real child process stands in for the engine core its front end (this test) started."""
    env = {k: v for k, v in os.environ.items() if k != guest.STOOD_DOWN_ENV}
    if marker is not None:
        # "other": a pid above Linux's PID_MAX_LIMIT (2**22), no ancestor's ("1" was init's,
        # this test's grandparent when pytest ran detached under nohup)
        env[guest.STOOD_DOWN_ENV] = str(os.getpid()) if marker == "parent" else str(2**22 + 1)
    done = subprocess.run([sys.executable, "-c", STAY_OUT], env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    said = [line for line in done.stderr.splitlines() if "kvops stays out" in line]
    assert len(said) == (1 if warns else 0), done.stderr


def _vllm_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


@pytest.fixture(scope="module")
def vllm_parser():
    """vLLM's own `vllm serve` parser: the oracle of which spellings reach which setting.
    Building it loads the general plugins (vllm/engine/arg_utils.py): not again here."""
    import vllm.plugins

    loaded = vllm.plugins.plugins_loaded
    vllm.plugins.plugins_loaded = True
    try:
        yield _vllm_parser()
    finally:
        vllm.plugins.plugins_loaded = loaded


def _vllm_sees_kvops(args: object) -> bool:
    transfer = getattr(args, "kv_transfer_config", None)
    return ((getattr(args, "additional_config", None) or {}).get("kvops") is not None
            or getattr(transfer, "kv_connector", None) == CONNECTOR_NAME
            or "kvops" in str(getattr(args, "scheduler_cls", None) or ""))


SPELLINGS = [
    ["--additional-config", '{"kvops": {}}'],
    ["--additional_config", '{"kvops": {"config": "k.yaml"}}'],
    ['--additional-config={"kvops": {"offload": {}}}'],
    ["--additional-config.kvops.config", "k.yaml"],
    ["--additional-config", '{"other": 1}'],
    ["--additional-config", '{"kvops": null}'],
    ["--kv-transfer-config", json.dumps({"kv_connector": CONNECTOR_NAME, "kv_role": "kv_both"})],
    ["--kv_transfer_config.kv_connector", CONNECTOR_NAME, "--kv-transfer-config.kv_role", "kv_both"],
    ["--kv-transfer-config", '{"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both"}'],
    ["--scheduler-cls", "kvops.plugin.admission.KVBudgetScheduler"],
    ["--scheduler_cls=kvops.plugin.admission.KVBudgetAsyncScheduler"],
    ["--max-model-len", "2048"],
    ["--config", "CONFIG"],
]


@pytest.mark.parametrize("flags", SPELLINGS, ids=lambda flags: " ".join(flags)[:60])
def test_kvops_is_asked_for_exactly_where_vllms_parser_sees_it(vllm_parser, tmp_path: Path, flags):
    config = tmp_path / "serve.yaml"
    config.write_text("additional_config:\n  kvops:\n    config: k.yaml\nmax_model_len: 2048\n")
    flags = [str(config) if flag == "CONFIG" else flag for flag in flags]
    args = vllm_parser.parse_args(["--model", "m", *flags])
    asked = guest.kvops_asked(["vllm", "serve", "m", *flags])
    assert (asked is not None) == _vllm_sees_kvops(args), (asked, args)
