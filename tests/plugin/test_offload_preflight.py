"""Offload settings and the front-end preflight checks, without servers.

The server configurations below are trimmed copies of what a real `lmcache server` 0.5.6
answers on GET /config and /config/adapters (captured from `kvops offload serve`)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from shm_mount import findmnt_huge_policy

from kvops.core.errors import KvopsPluginError
from kvops.core.offload.preflight import (
    ServerConfig,
    check_disk_dir,
    check_server,
    check_shm,
    choose_transfer_mode,
    cpu_kv_cache_bytes,
    huge_pages_note,
    shm_huge_pages,
)
from kvops.core.offload.settings import OffloadSettings
from kvops.core.settings import load_settings

REAL_CONFIG: dict[str, Any] = {
    "mp": {"transport": "zmq", "host": "127.0.0.1", "port": 25555, "chunk_size": 256,
           "hash_algorithm": "blake3", "supported_transfer_mode": "auto"},
    "storage_manager": {"l2_adapter_config": {"adapters": [{
        "base_path": "/tmp/o5/l2", "num_workers": 2, "relative_tmp_dir": "", "use_odirect": False,
        "read_ahead_size": None, "max_capacity_gb": 0.1, "affinity_tag": "_default",
        "shared": False,
        "eviction_config": "EvictionConfig(eviction_policy='LRU', trigger_watermark=0.8, "
                           "eviction_ratio=0.2, extra_logging_enabled=False, extra_logging_interval=10.0)",
        "persist_config": "PersistConfig(persist_enabled=True)", "serde_config": None,
    }]}},
}
REAL_ADAPTERS = {"adapters": [{"index": 0, "type_name": "fs_native", "tier": "l2",
                               "primary": True, "reconfigurable": False}]}


def server(**mp: Any) -> ServerConfig:
    config = copy.deepcopy(REAL_CONFIG)
    config["mp"].update(mp)
    return ServerConfig.from_json(config, REAL_ADAPTERS)


def settings(**kw: Any) -> OffloadSettings:
    return OffloadSettings(**{"port": 25555, "disk_path": "/tmp/o5/l2", "disk_gib": 0.1, **kw})


def test_matching_server_passes():
    check_server(settings(), server(), block_size=128)


@pytest.mark.parametrize(
    ("server_mp", "ours", "expected"),
    [
        ({"port": 5555}, {}, "serves KV on port 5555 but kvops.offload.port is 25555"),
        ({"supported_transfer_mode": "lmcache_driven"}, {"transfer_mode": "engine_driven"},
         "would hang for 300 s"),
        ({"supported_transfer_mode": "engine_driven"}, {"transfer_mode": "lmcache_driven"},
         "accepts only transfer mode 'engine_driven'"),
        ({"chunk_size": 512}, {}, "uses chunk size 512 but kvops.offload.chunk_size is 256"),
        ({"chunk_size": 200}, {"chunk_size": 200}, "not a multiple of vLLM's block size 128"),
        ({}, {"disk_gib": 0.5}, "caps /tmp/o5/l2 at 0.1 GiB but kvops.offload.disk_gib is 0.5"),
        ({}, {"disk_path": "/elsewhere"}, "has no disk tier at /elsewhere"),
    ],
    ids=["port", "mode-server-lmcache", "mode-server-engine", "chunk", "chunk-block", "cap", "path"],
)
def test_mismatched_server_is_refused_with_the_reason(server_mp, ours, expected):
    with pytest.raises(KvopsPluginError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        check_server(settings(**ours), server(**server_mp), block_size=128)


def test_disk_tier_without_eviction_is_refused():
    adapters = {"adapters": [{**REAL_ADAPTERS["adapters"][0], "type_name": "fs"}]}
    config = copy.deepcopy(REAL_CONFIG)
    config["storage_manager"]["l2_adapter_config"]["adapters"][0]["eviction_config"] = None
    with pytest.raises(KvopsPluginError, match="without eviction"):
        check_server(settings(), ServerConfig.from_json(config, adapters), block_size=128)


def test_disk_dir_checks_use_the_real_filesystem(tmp_path: Path):
    check_disk_dir(str(tmp_path / "new" / "dir"), 0.001)
    assert (tmp_path / "new" / "dir").is_dir()
    assert not list((tmp_path / "new" / "dir").iterdir())  # the probe file is gone
    with pytest.raises(KvopsPluginError, match="is not writable"):
        check_disk_dir("/proc/kvops-offload", None)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(KvopsPluginError, match="is not writable"):
        check_disk_dir(str(blocker / "sub"), None)
    with pytest.raises(KvopsPluginError, match="GiB free"):
        check_disk_dir(str(tmp_path), 1e9)


def test_shm_check_compares_with_the_real_free_space(tmp_path: Path):
    check_shm(1 << 20, shm=tmp_path)
    with pytest.raises(KvopsPluginError, match="enlarge"):
        check_shm(1 << 60, shm=tmp_path)
    with pytest.raises(KvopsPluginError, match="--kv-cache-memory-bytes"):
        check_shm(None, shm=tmp_path)


@pytest.mark.parametrize(
    ("offload", "expected"),
    [
        ({"disk_gib": 1}, "disk_gib is set but disk_path is not"),
        ({"disk_path": "/tmp/x"}, "disk_path is set but disk_gib is not"),
        ({"transfer_mode": "fast"}, "offload.transfer_mode"),
        ({"nope": 1}, "unknown key 'offload.nope'"),
        ({"timeout_s": 0}, "offload.timeout_s"),
    ],
)
def test_bad_offload_settings_name_the_field(offload, expected):
    with pytest.raises(KvopsPluginError, match=expected):
        load_settings({"kvops": {"offload": offload}})


def test_offload_settings_switch_the_feature_on():
    parsed = load_settings({"kvops": {"offload": {}}})
    assert parsed is not None
    assert "offload" in parsed.features()
    assert parsed.offload == OffloadSettings()


def test_shared_l2_must_be_the_servers():
    resp = {"host": "127.0.0.1", "port": 6390, "num_workers": 2, "username": "", "password": "",
            "max_capacity_gb": 0.0, "affinity_tag": "_default"}
    config = copy.deepcopy(REAL_CONFIG)
    config["storage_manager"]["l2_adapter_config"]["adapters"].append(resp)
    adapters = {"adapters": [*REAL_ADAPTERS["adapters"], {"index": 1, "type_name": "resp"}]}
    with_resp = ServerConfig.from_json(config, adapters)
    check_server(settings(shared_l2="redis://127.0.0.1:6390"), with_resp, block_size=128)
    with pytest.raises(KvopsPluginError, match="does not use the shared L2 redis://127.0.0.1:6391"):
        check_server(settings(shared_l2="redis://127.0.0.1:6391"), with_resp, block_size=128)
    with pytest.raises(KvopsPluginError, match="offload.shared_l2"):
        load_settings({"kvops": {"offload": {"shared_l2": "http://x:1"}}})


def test_auto_takes_zero_copy_where_the_kv_cache_fits_the_real_free_shm(tmp_path: Path):
    choice = choose_transfer_mode("auto", "auto", 1 << 20, "cpu", shm=tmp_path)
    assert choice.mode == "lmcache_driven"
    assert "fits the free space" in choice.reason


@pytest.mark.parametrize(("server_mode", "kv_bytes", "device", "reason"), [
    ("engine_driven", 1 << 20, "cpu", "accepts only engine_driven"),
    ("auto", 1 << 20, "cuda", "the KV cache is on cuda"),
    ("auto", None, "cpu", "--kv-cache-memory-bytes"),
    ("auto", 1 << 60, "cpu", "docker --shm-size"),
])
def test_auto_falls_back_to_engine_driven_with_one_reason(tmp_path, server_mode, kv_bytes, device,
                                                          reason):
    choice = choose_transfer_mode("auto", server_mode, kv_bytes, device, shm=tmp_path)
    assert choice.mode == "engine_driven"
    assert reason in choice.reason
    assert "\n" not in choice.reason


MOUNTS = """overlay / overlay rw,relatime,lowerdir=/l,upperdir=/u 0 0
tmpfs /dev/shm tmpfs rw,nosuid,nodev,size=65536k 0 0
tmpfs /dev/shm/with\\040huge tmpfs rw,relatime,huge=within_size 0 0
"""


@pytest.mark.parametrize(("shm", "kernel", "expected"), [
    ("/dev/shm", "always within_size advise [never] deny force", "never"),
    ("/dev/shm/with huge", "always within_size advise [never] deny force", "within_size"),
    ("/dev/shm/with huge/deeper", "always within_size advise [never] deny force", "within_size"),
    ("/dev/shm", "always within_size advise never deny [force]", "force"),
    ("/dev/shm/with huge", "always within_size advise never [deny] force", "deny"),
    ("/var/tmp", "always within_size advise [never] deny force", None),
])
def test_huge_pages_are_the_policy_of_the_tmpfs_holding_shm(tmp_path, shm, kernel, expected):
    """A /proc/mounts and a transparent_hugepage/shmem_enabled as the kernel writes them."""
    (tmp_path / "mounts").write_text(MOUNTS)
    (tmp_path / "shmem_enabled").write_text(kernel + "\n")
    assert shm_huge_pages(Path(shm), tmp_path / "mounts", tmp_path / "shmem_enabled") == expected


@pytest.mark.parametrize(("shm", "kernel", "says"), [
    ("/dev/shm", "[never]", "`mount -o remount,huge=within_size /dev/shm`"),
    ("/dev/shm/with huge", "[never]", "uses huge pages (huge=within_size)"),
    ("/dev/shm", "[deny]", "shmem_enabled is deny"),
    ("/var/tmp", "[never]", "unknown"),
])
def test_the_zero_copy_line_says_what_loads_pay_for_pages(tmp_path, shm, kernel, says):
    (tmp_path / "mounts").write_text(MOUNTS)
    (tmp_path / "shmem_enabled").write_text(kernel)
    note = huge_pages_note(Path(shm), tmp_path / "mounts", tmp_path / "shmem_enabled")
    assert says in note
    assert "\n" not in note


def test_huge_pages_of_this_machines_dev_shm_match_findmnt():
    """Oracle: util-linux's findmnt reads the same mount; the kernel's shmem_enabled overrides."""
    expected = findmnt_huge_policy()
    assert shm_huge_pages(Path("/dev/shm")) == expected
    choice = choose_transfer_mode("auto", "auto", 1 << 20, "cpu")
    assert choice.reason.endswith(huge_pages_note())


def test_explicit_modes_are_kept_and_checked(tmp_path: Path):
    assert choose_transfer_mode("engine_driven", "auto", None, "cpu", tmp_path).mode == "engine_driven"
    assert choose_transfer_mode("lmcache_driven", "auto", 1, "cpu", tmp_path).mode == "lmcache_driven"
    with pytest.raises(KvopsPluginError, match="enlarge"):
        choose_transfer_mode("lmcache_driven", "auto", 1 << 60, "cpu", tmp_path)


def test_a_server_that_only_takes_zero_copy_where_it_cannot_work_is_refused(tmp_path: Path):
    with pytest.raises(KvopsPluginError, match="accepts only lmcache_driven"):
        choose_transfer_mode("auto", "lmcache_driven", None, "cpu", tmp_path)


def test_cpu_kv_cache_size_comes_from_the_flag_or_the_cpu_variable():
    assert cpu_kv_cache_bytes(1 << 30, {"VLLM_CPU_KVCACHE_SPACE": "4"}) == 1 << 30
    assert cpu_kv_cache_bytes(None, {"VLLM_CPU_KVCACHE_SPACE": "4"}) == 4 << 30
    assert cpu_kv_cache_bytes(None, {"VLLM_CPU_KVCACHE_SPACE": "x"}) is None
    assert cpu_kv_cache_bytes(None, {}) is None


def test_kvops_info_names_the_resolved_transfer_mode_only_with_kvops_offload():
    from types import SimpleNamespace

    from kvops.plugin.metrics import offload_transfer_mode

    def config(extra: dict[str, Any] | None) -> Any:
        transfer = None if extra is None else SimpleNamespace(kv_connector_extra_config=extra)
        return SimpleNamespace(kv_transfer_config=transfer)

    ours = {"kvops.offload": {}, "lmcache.mp.mp_transfer_mode": "lmcache_driven"}
    assert offload_transfer_mode(config(ours)) == "lmcache_driven"
    assert offload_transfer_mode(config({"lmcache.mp.mp_transfer_mode": "engine_driven"})) == ""
    assert offload_transfer_mode(config(None)) == ""


def test_engine_driven_says_how_its_loads_leave_l1_in_the_reason_line_and_kvops_info(tmp_path):
    from types import SimpleNamespace

    from kvops.core.offload.l1_shm import describe_l1
    from kvops.core.offload.preflight import TransferChoice
    from kvops.plugin.metrics import offload_l1_transfer
    from kvops.plugin.offload.wiring import L1_TRANSFER_KEY, with_l1_transfer

    shared = server(shm_name="lmcache_l1_pool_kvops_25555")
    assert (shared.l1_shm_asked, shared.l1_pool) == ("lmcache_l1_pool_kvops_25555", "")
    extra: dict[str, Any] = {"kvops.offload": {}}
    l1 = describe_l1(shared.l1_pool, shared.l1_shm_asked, local=True)
    choice = with_l1_transfer(TransferChoice("engine_driven", "set in kvops.offload.transfer_mode"), l1, extra)
    assert choice.mode == "engine_driven"
    assert choice.reason.startswith("set in kvops.offload.transfer_mode; L1 pickled: the server "
                                    "asked for lmcache_l1_pool_kvops_25555 but LMCache found too "
                                    "little room")
    assert extra[L1_TRANSFER_KEY] == "pickled"
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    assert offload_l1_transfer(vllm_config) == "pickled"
    zero_copy = with_l1_transfer(TransferChoice("lmcache_driven", "zero-copy"), l1, extra)
    assert zero_copy.reason == "zero-copy"
    assert offload_l1_transfer(vllm_config) == ""
