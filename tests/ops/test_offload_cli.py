"""`kvops offload serve|status` without a server: flags checked by LMCache's own argument
parser, status summaries from a real server's /status and /metrics, one-line bad input."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from typer.testing import CliRunner

from kvops.ops.cli.main import app
from kvops.ops.offload.server import load_offload_settings, server_args
from kvops.ops.offload.status import render, summarize

runner = CliRunner()


def lmcache_parses(args: list[str]) -> tuple[object, object]:
    """Parse our flags with the parsers `lmcache server` itself uses (lmcache 0.5.6)."""
    from lmcache.v1.distributed.config import add_storage_manager_args, parse_args_to_config
    from lmcache.v1.multiprocess.config import (
        add_http_frontend_args,
        add_mp_server_args,
        parse_args_to_mp_server_config,
    )

    parser = argparse.ArgumentParser()
    add_mp_server_args(parser)
    add_storage_manager_args(parser)
    add_http_frontend_args(parser)
    parsed, unknown = parser.parse_known_args(args)
    assert unknown == []
    return parse_args_to_mp_server_config(parsed), parse_args_to_config(parsed)


def test_server_flags_mean_what_the_settings_say(tmp_path: Path):
    settings = load_offload_settings(None, {
        "port": 6001, "l1_gib": 0.5, "disk_path": str(tmp_path), "disk_gib": 2.0,
        "chunk_size": 512,
    })
    mp, storage = lmcache_parses(server_args(settings))
    assert mp.port == 6001
    assert mp.chunk_size == 512
    assert mp.supported_transfer_mode == "auto"
    memory = storage.l1_manager_config.memory_config
    assert memory.size_in_bytes == 1 << 29
    assert memory.use_lazy is False
    [adapter] = storage.l2_adapter_config.adapters
    assert type(adapter).__name__.startswith("FSNative")
    assert adapter.base_path == str(tmp_path.resolve())
    assert adapter.max_capacity_gb == 2.0
    assert adapter.eviction_config.eviction_policy == "LRU"


def test_without_disk_there_is_no_l2(tmp_path: Path):
    _, storage = lmcache_parses(server_args(load_offload_settings(None, {})))
    assert storage.l2_adapter_config.adapters == []


def test_yaml_and_flags_merge_flags_winning(tmp_path: Path):
    config = tmp_path / "kvops.yaml"
    config.write_text("offload:\n  port: 7000\n  l1_gib: 2\n")
    settings = load_offload_settings(config, {"l1_gib": 1.5, "port": None})
    assert (settings.port, settings.l1_gib) == (7000, 1.5)


def test_bad_settings_are_one_line_exit_2(tmp_path: Path):
    config = tmp_path / "kvops.yaml"
    config.write_text("offload:\n  l1_gb: 2\n")
    result = runner.invoke(app, ["offload", "serve", "--config", str(config)])
    assert result.exit_code == 2
    assert "unknown key 'offload.l1_gb'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = runner.invoke(app, ["offload", "serve", "--config", str(tmp_path / "none.yaml")])
    assert result.exit_code == 2
    assert "none.yaml: cannot read it" in result.stderr
    result = runner.invoke(app, ["offload", "serve", "--disk-path", "/proc/kvops", "--disk-gib", "1"])
    assert result.exit_code == 2
    assert "is not writable" in result.stderr


def test_in_process_mode_has_no_server_to_serve(tmp_path: Path):
    config = tmp_path / "kvops.yaml"
    config.write_text("offload:\n  lmcache_mode: in_process\n")
    result = runner.invoke(app, ["offload", "serve", "--config", str(config)])
    assert result.exit_code == 2
    assert "lmcache_mode is in_process" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_status_of_an_absent_server_is_an_error():
    result = runner.invoke(app, ["offload", "status", "--url", "http://127.0.0.1:9"])
    assert result.exit_code == 1
    assert "LMCache server not reachable at http://127.0.0.1:9" in result.stderr


STATUS = {  # trimmed from a real server's GET /status after one L1 and one L2 hit
    "is_healthy": True, "chunk_size": 256,
    "storage_manager": {
        "l1_manager": {"total_object_count": 2, "memory_used_bytes": 1048576,
                       "memory_total_bytes": 268435456},
        "l2_adapters": [{"is_healthy": True, "type": "FSNativeL2Adapter", "base_path": "/tmp/o5/l2"}],
        "l2_eviction_controller": {"adapters": [{"total_bytes_used": 1048576,
                                                 "total_capacity_bytes": 10737418}]},
    },
}
METRICS = """\
# TYPE lmcache_mp_lookup_requested_tokens_total counter
lmcache_mp_lookup_requested_tokens_total 1536.0
# TYPE lmcache_mp_lookup_hit_l1_tokens_total counter
lmcache_mp_lookup_hit_l1_tokens_total 512.0
# TYPE lmcache_mp_lookup_hit_l2_tokens_total counter
lmcache_mp_lookup_hit_l2_tokens_total 512.0
# TYPE lmcache_mp_l1_evicted_chunks_total counter
lmcache_mp_l1_evicted_chunks_total{l1_tag="_default"} 4.0
"""


def test_status_summary_reads_usage_hits_and_evictions():
    summary = summarize("http://x", STATUS, METRICS)
    assert summary["l1"] == {"used_bytes": 1048576, "capacity_bytes": 268435456, "objects": 2,
                             "transfer": "unknown", "pool": "",
                             "reason": "the server's /config did not answer"}
    assert summary["l2"][0]["capacity_bytes"] == 10737418
    assert summary["counters"]["hit_tokens_l2"] == 512
    assert summary["counters"]["l1_evicted_chunks"] == 4
    assert summary["counters"]["l2_evicted_chunks"] == 0
    assert abs(summary["hit_ratio"] - 1024 / 1536) < 1e-12
    text = render(summary)
    assert "hits L1 512 + L2 512 tokens (66.7%)" in text
    json.dumps(summary)


def test_engine_driven_l1_pool_is_a_flag_lmcache_takes(tmp_path: Path):
    from kvops.core.offload.l1_shm import L1Transfer

    settings = load_offload_settings(None, {"port": 6001, "transfer_mode": "engine_driven"})
    args = server_args(settings, L1Transfer("lmcache_l1_pool_kvops_6001", "room"))
    mp, storage = lmcache_parses(args)
    assert mp.shm_name == "lmcache_l1_pool_kvops_6001"
    assert storage.l1_manager_config.memory_config.shm_name == "lmcache_l1_pool_kvops_6001"
    assert "--shm-name" not in server_args(settings, L1Transfer(None, "no room"))
    assert "--shm-name" not in server_args(settings)


def test_status_says_how_engine_driven_loads_leave_l1():
    config = {"mp": {"shm_name": "lmcache_l1_pool_kvops_6001"}, "storage_manager": {
        "l1_manager_configs": [{"memory_config": {"shm_name": "lmcache_l1_pool_kvops_6001"}}]}}
    shared = summarize("http://x", STATUS, METRICS, config)
    assert (shared["l1"]["transfer"], shared["l1"]["pool"]) == ("shm", "lmcache_l1_pool_kvops_6001")
    assert "L1 transfer for engine_driven loads: shm: L1 lives in /dev/shm/lmcache_l1_pool_kvops_6001" in render(shared)
    private = summarize("http://x", STATUS, METRICS, {"mp": {"shm_name": ""}})
    assert private["l1"]["transfer"] == "pickled"
    assert "runs without --shm-name" in render(private)


def test_shared_l2_is_a_resp_adapter_lmcache_accepts():
    settings = load_offload_settings(None, {"shared_l2": "redis://127.0.0.1:6390"})
    _, storage = lmcache_parses(server_args(settings))
    [adapter] = storage.l2_adapter_config.adapters
    assert type(adapter).__name__.startswith("RESP")
    assert (adapter.host, adapter.port) == ("127.0.0.1", 6390)


def test_shared_l2_that_does_not_answer_is_refused(tmp_path: Path):
    config = tmp_path / "kvops.yaml"
    config.write_text("offload:\n  shared_l2: redis://127.0.0.1:9\n")
    result = runner.invoke(app, ["offload", "serve", "--config", str(config)])
    assert result.exit_code == 1
    assert "shared L2 redis://127.0.0.1:9 (kvops.offload.shared_l2) is not reachable" in result.stderr
