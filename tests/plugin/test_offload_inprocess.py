"""The in-process LMCache path: the LMCACHE_* mapping read back by LMCache's own config loader,
and the refusal/warning for LMCacheConnectorV1 on real vLLM KVTransferConfig objects.

The CUDA path itself cannot run here (no GPU); only its configuration is checked, and the
refusal when LMCache's compiled CUDA kernels do not load (they never load here: the import fails
for real, on the missing libc10_cuda.so).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from types import SimpleNamespace

import pytest
from lmcache.v1.config import LMCacheEngineConfig
from vllm.config import KVTransferConfig

from kvops.core.errors import KvopsPluginError
from kvops.core.offload.settings import OffloadSettings
from kvops.plugin.offload import CONNECTOR_NAME, wiring
from kvops.plugin.offload.inprocess import (
    apply_lmcache_env,
    kernels_problem,
    lmcache_env,
    names_in_process_connector,
)
from kvops.plugin.offload.wiring import IN_PROCESS_WARNED_ENV, configure, ensure_connector

MULTI = {"connectors": [{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}]}


def _lmcache_reads(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> LMCacheEngineConfig:
    for key in list(os.environ):
        if key.startswith("LMCACHE_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return LMCacheEngineConfig.from_env()


def _forget_env_after_test(monkeypatch: pytest.MonkeyPatch, keys: list[str]) -> None:
    for key in keys:  # set then delete: monkeypatch restores "absent" afterwards
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)


def test_lmcache_loader_reads_the_kvops_sizes(monkeypatch, tmp_path):
    settings = OffloadSettings(
        lmcache_mode="in_process", l1_gib=1.5, disk_path=str(tmp_path), disk_gib=0.25, chunk_size=512
    )
    config = _lmcache_reads(monkeypatch, lmcache_env(settings))
    assert config.chunk_size == 512
    assert config.local_cpu is True
    assert config.max_local_cpu_size == 1.5
    assert config.local_disk == str(tmp_path)
    assert config.max_local_disk_size == 0.25


def test_without_a_disk_tier_lmcache_has_none(monkeypatch):
    config = _lmcache_reads(monkeypatch, lmcache_env(OffloadSettings(l1_gib=2.0)))
    assert config.local_disk is None
    assert config.max_local_disk_size == 0.0
    assert config.max_local_cpu_size == 2.0
    assert config.chunk_size == 256


def test_an_operator_value_that_contradicts_kvops_is_refused():
    environ = {"LMCACHE_CHUNK_SIZE": "1024"}
    with pytest.raises(KvopsPluginError, match="LMCACHE_CHUNK_SIZE='1024' contradicts"):
        apply_lmcache_env(environ, OffloadSettings(chunk_size=256))
    with pytest.raises(KvopsPluginError, match="LMCACHE_CONFIG_FILE is set"):
        apply_lmcache_env({"LMCACHE_CONFIG_FILE": "/x.yaml"}, OffloadSettings())
    same = {"LMCACHE_CHUNK_SIZE": "256"}
    apply_lmcache_env(same, OffloadSettings(chunk_size=256))  # agreeing values are fine
    assert same["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "4.0"


@pytest.mark.parametrize(
    ("connector", "extra", "expected"),
    [
        ("LMCacheConnectorV1", {}, True),
        ("MultiConnector", MULTI, True),
        ("MultiConnector", {"connectors": [{"kv_connector": CONNECTOR_NAME}]}, False),
        ("LMCacheMPConnector", {}, False),
    ],
)
def test_in_process_connector_is_found_directly_or_in_a_multi_connector(connector, extra, expected):
    transfer = KVTransferConfig(kv_connector=connector, kv_role="kv_both", kv_connector_extra_config=extra)
    assert names_in_process_connector(transfer) is expected


@pytest.mark.parametrize(("connector", "extra"), [("LMCacheConnectorV1", {}), ("MultiConnector", MULTI)])
def test_cpu_with_an_offload_section_refuses_naming_the_fix(connector, extra):
    transfer = KVTransferConfig(kv_connector=connector, kv_role="kv_both", kv_connector_extra_config=extra)
    with pytest.raises(KvopsPluginError, match="no cpu KV connector") as info:
        ensure_connector(SimpleNamespace(kv_transfer_config=transfer), OffloadSettings(), "cpu")
    assert "KVOpsOffloadConnector" in str(info.value)
    assert "kvops offload serve" in str(info.value)


@pytest.mark.parametrize(("device", "said"), [
    ("cpu", ["would run degraded"]),
    # LMCache's kernels fail to import here for real (no libc10_cuda.so)
    ("cuda", ["lmcache.cuda_ops", "torch copies"]),
])
def test_without_an_offload_section_a_degraded_in_process_connector_warns_once_and_changes_nothing(
        caplog, monkeypatch, device, said):
    _forget_env_after_test(monkeypatch, [IN_PROCESS_WARNED_ENV])
    transfer = KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both")
    config = SimpleNamespace(kv_transfer_config=transfer)
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.kvops.offload"):
        ensure_connector(config, None, device)
        ensure_connector(config, None, device)  # the engine core rebuilding the config
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    for words in said:
        assert words in warnings[0]
    assert config.kv_transfer_config is transfer
    assert transfer.kv_connector == "LMCacheConnectorV1"


def test_in_process_mode_refuses_off_cuda():
    with pytest.raises(KvopsPluginError, match="no cpu KV connector"):
        ensure_connector(SimpleNamespace(kv_transfer_config=None),
                         OffloadSettings(lmcache_mode="in_process"), "cpu")
    with pytest.raises(KvopsPluginError, match="CUDA only, not xpu"):
        ensure_connector(SimpleNamespace(kv_transfer_config=None),
                         OffloadSettings(lmcache_mode="in_process"), "xpu")


def test_in_process_mode_on_cuda_picks_lmcache_connector_v1():
    config = SimpleNamespace(kv_transfer_config=None)
    ensure_connector(config, OffloadSettings(lmcache_mode="in_process"), "cuda")
    assert config.kv_transfer_config.kv_connector == "LMCacheConnectorV1"
    wrong = SimpleNamespace(kv_transfer_config=KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_role="kv_both"))
    with pytest.raises(KvopsPluginError, match="lmcache_mode is in_process"):
        ensure_connector(wrong, OffloadSettings(lmcache_mode="in_process"), "cuda")


def test_in_process_configure_runs_the_disk_preflight_and_exports_the_sizes(monkeypatch, tmp_path):
    # Stand-in: LMCache's kernels loading, which cannot happen on this CPU-only machine (they were
    # seen to work with the engine on an H200 once: kvops.plugin.offload.inprocess docstring).
    monkeypatch.setattr(wiring, "kernels_problem", lambda: None)
    settings = OffloadSettings(lmcache_mode="in_process", disk_path=str(tmp_path), disk_gib=0.01)
    _forget_env_after_test(monkeypatch, list(lmcache_env(settings)))
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    transfer = KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both")
    config = SimpleNamespace(kv_transfer_config=transfer, cache_config=SimpleNamespace(block_size=16))
    configure(config, settings)
    assert os.environ["LMCACHE_LOCAL_DISK"] == str(tmp_path)
    assert transfer.kv_load_failure_policy == "recompute"
    unwritable = OffloadSettings(lmcache_mode="in_process", disk_path="/proc/kvops-x", disk_gib=0.01)
    with pytest.raises(KvopsPluginError, match="is not writable"):
        configure(config, unwritable)


def test_in_process_refuses_when_lmcache_kernels_do_not_load_and_exports_nothing(monkeypatch, tmp_path):
    problem = kernels_problem()  # the real import of lmcache.cuda_ops, failing here
    assert problem is not None
    assert "libc10_cuda" in problem
    settings = OffloadSettings(lmcache_mode="in_process", disk_path=str(tmp_path), disk_gib=0.01)
    _forget_env_after_test(monkeypatch, list(lmcache_env(settings)))
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    transfer = KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both")
    config = SimpleNamespace(kv_transfer_config=transfer, cache_config=SimpleNamespace(block_size=16))
    with pytest.raises(KvopsPluginError) as info:
        configure(config, settings)
    message = str(info.value)
    assert "\n" not in message
    assert "lmcache.cuda_ops" in message
    assert "libc10_cuda" in message
    assert f"torch {importlib.metadata.version('torch')} (" in message  # the installed one
    assert not any(key in os.environ for key in lmcache_env(settings))
    assert transfer.kv_load_failure_policy != "recompute"
