"""The weights estimate against two oracles outside kvops: transformers' own modules (parameter
counts of each architecture family, built on the meta device from the same config.json), and
the "Model loading took X GiB" lines of published vLLM start-up logs (0.19 on H100s, and
0.15-0.31 on A100s, RTX 4090s and RTX PRO 6000s: per rank, with tensor and pipeline
parallelism, dtypes and a runtime fp8 quantization)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvops.core.errors import BadInputError
from kvops.ops.bench.gpu_logs import LOGS, PUBLIC_LOGS, find_config, read_runs, version_tuple
from kvops.ops.capacity.constants import GPU_CATALOG_GIB, GPU_SM
from kvops.ops.capacity.model import model_dtype, text_config
from kvops.ops.capacity.quantization import weight_format
from kvops.ops.capacity.weights import cuda_rounding, rank_params, stage_weights
from kvops.ops.cli.main import app

GIB = 2**30
_SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, vocab_size=1024, max_position_embeddings=128)
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "llama-tied": {"tie_word_embeddings": True},
    "qwen2": {"tie_word_embeddings": False},
    "qwen3": {"head_dim": 64},
    "qwen3_moe": {"head_dim": 64, "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {"moe_intermediate_size": 128, "shared_expert_intermediate_size": 256, "num_experts": 8,
                  "num_experts_per_tok": 2},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "gemma2": {"head_dim": 32},
    "phi": {"num_key_value_heads": 8},
    "granite": {},
    "deepseek_v2": {"num_hidden_layers": 3, "num_key_value_heads": 8, "moe_intermediate_size": 128,
                    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
                    "kv_lora_rank": 64, "q_lora_rank": 96, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
                    "v_head_dim": 32},
}


def _hf_config(family: str) -> tuple[dict[str, Any], int]:
    """The config.json transformers writes for a small model of this family, and its parameter count."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = family.split("-")[0]
    cfg = AutoConfig.for_model(model_type, **{**_SMALL, **FAMILIES[family]})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return json.loads(cfg.to_json_string(use_diff=False)), sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parameters_counted_as_transformers_builds_the_model(family: str) -> None:
    raw, expected = _hf_config(family)
    params = rank_params(raw)[0]
    total = params.total
    positions = raw["max_position_embeddings"]
    rotary_dim = raw.get("qk_rope_head_dim") or raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    rotary = positions * int(rotary_dim * raw.get("partial_rotary_factor", 1.0))  # vLLM's cos/sin cache, not in HF
    assert total - rotary == expected


def _logged_cases() -> list[Any]:
    cases = []
    for run in [*read_runs(LOGS), *read_runs(PUBLIC_LOGS)]:
        config = find_config(run.model)
        if config is not None:
            cases.append(pytest.param(run, config, id=f"{run.model}-{run.vllm_version}-tp{run.tp}pp{run.pp}"
                                                      f"-{run.args.get('dtype')}-{run.args.get('quantization')}"))
    return cases


@pytest.mark.parametrize(("run", "config"), _logged_cases())
def test_weights_of_one_rank_match_vllms_model_loading_line(run: Any, config: Path) -> None:
    raw = json.loads(config.read_text())
    cfg = text_config(raw)
    fmt = weight_format(cfg.get("quantization_config"), run.args.get("quantization"), run.catalog_gpu(),
                        version_tuple(run.vllm_version))
    weights = stage_weights(raw, model_dtype(cfg, run.args.get("dtype")), fmt, run.tp, run.pp, cuda=True)
    error = weights.per_stage_bytes[0] / GIB / run.weights_gib - 1  # the log is the first stage's TP0 worker
    assert abs(error) < 0.01, f"{weights.per_stage_bytes[0] / GIB:.3f} GiB vs logged {run.weights_gib}"


MIB = 2**20


@pytest.mark.parametrize(("nbytes", "extra"), [
    (80 * MIB, 0),  # a 2 MiB multiple: the block is the tensor
    (int(31.5 * MIB), MIB // 2),  # 0.5 MiB short of its 32 MiB segment: not split, counted
    (259 * MIB, MIB),  # 1 MiB left: split only when over 1 MiB (kSmallSize), so counted
    (int(64.75 * MIB), 0),  # 1.25 MiB left: split off, free, not counted
    (8 * MIB + 100, 412),  # under 10 MiB: carved from a shared 20 MiB segment, 512-byte rounding
    (1000, 24),  # small pool: 512-byte rounding
])
def test_cuda_rounding_follows_the_caching_allocators_rules(nbytes: int, extra: int) -> None:
    """Hand-worked from c10/cuda/CUDACachingAllocator.cpp (round_size, get_allocation_size,
    should_split), not from this code's output."""
    assert cuda_rounding(nbytes) == extra


# Logged runs whose large tensors are 0.5 or 1 MiB short of a 2 MiB multiple (Qwen2.5's and
# phi-4's fused qkv, gate_up and down; Qwen3-32B's at TP2): their parameters alone are
# 0.05-0.08 GiB under the log's "Model loading took"; with the allocator's rounding, within
# the log's print precision (0.005 GiB) plus 1 MiB.
_ROUNDED = {("Qwen/Qwen2.5-7B-Instruct", 1), ("Qwen/Qwen2.5-72B-Instruct", 2), ("microsoft/phi-4", 1),
            ("Qwen/Qwen3-32B", 2)}


def test_the_allocators_rounding_is_what_the_parameter_count_missed() -> None:
    checked = 0
    for run in [*read_runs(LOGS), *read_runs(PUBLIC_LOGS)]:
        config = find_config(run.model)
        if (run.model, run.tp) not in _ROUNDED or config is None or run.pp != 1:
            continue
        raw = json.loads(config.read_text())
        dtype = model_dtype(text_config(raw), run.args.get("dtype"))
        plain = stage_weights(raw, dtype, None, run.tp).max_bytes / GIB
        rounded = stage_weights(raw, dtype, None, run.tp, cuda=True).max_bytes / GIB
        assert run.weights_gib - plain > 0.05, run.model
        assert abs(rounded - run.weights_gib) <= 0.005 + MIB / GIB, (run.model, rounded, run.weights_gib)
        checked += 1
    assert checked >= len(_ROUNDED)


GPT_OSS_20B = Path(__file__).parents[2] / "../shared/fixtures/model-configs/openai--gpt-oss-20b.json"


def _gpt_oss_gib(gpu: str | None, version: tuple[int, int] = (0, 32), tp: int = 2) -> float:
    raw = json.loads(GPT_OSS_20B.read_text())
    fmt = weight_format(raw["quantization_config"], None, gpu, version)
    return stage_weights(raw, "bfloat16", fmt, tp).max_bytes / GIB


def test_mxfp4_experts_take_hoppers_triton_layout_only_on_sm90() -> None:
    """gpt-oss-20b TP2 (vLLM 0.19, H100: 'Model loading took 7.01 GiB'): the checkpoint's packing
    alone is 6.43 GiB; on SM90 the swizzled, padded layout, with 0.19's kept scales 6.97 and
    0.32's freed ones 6.70; GPUs whose layout is not modelled keep the checkpoint's bytes."""
    packed = _gpt_oss_gib(None)
    assert round(packed, 2) == 6.43
    assert _gpt_oss_gib("H100", (0, 19)) == pytest.approx(7.01, rel=0.01)
    assert _gpt_oss_gib("H100", (0, 19)) > _gpt_oss_gib("H100") > packed
    assert _gpt_oss_gib("H200") == _gpt_oss_gib("H100")
    assert _gpt_oss_gib("A100") == _gpt_oss_gib("B200") == packed


def test_every_catalog_gpu_has_a_compute_capability() -> None:
    assert set(GPU_SM) == set(GPU_CATALOG_GIB)


def test_quantized_checkpoint_is_read_from_config() -> None:
    fp8 = weight_format({"quant_method": "fp8", "weight_block_size": [128, 128]}, None)
    assert fp8 is not None
    assert fp8.method == "fp8"
    assert 1 < fp8.per_element < 1.001
    assert weight_format(None, None) is None


@pytest.mark.parametrize(("qcfg", "flag", "message"), [
    ("fp8", None, "'quantization_config' must be a mapping"),
    ({"quant_method": "fp8"}, "awq", "does not match the checkpoint's"),
    ({"quant_method": "nonesuch"}, None, "'nonesuch' is not one kvops sizes"),
    ({"quant_method": "compressed-tensors", "config_groups": []}, None, "config_groups' must be a non-empty"),
    ({"quant_method": "gptq", "bits": "4"}, None, "quantization_config.bits' must be an integer"),
    (None, "awq", "only fp8, bitsandbytes, experts_int8 quantize"),
])
def test_bad_quantization_is_one_line(qcfg: Any, flag: str | None, message: str) -> None:
    with pytest.raises(BadInputError, match=message):
        weight_format(qcfg, flag)


LLAMA_8B = Path(__file__).parents[2] / "../shared/fixtures/model-configs/meta-llama--Meta-Llama-3.1-8B.json"


def test_plan_quantization_flag_plans_the_logged_runtime_fp8_weights() -> None:
    """vLLM 0.19 on an H100, Llama-3.1-8B-Instruct with --quantization fp8: 'Model loading took 8.49 GiB'."""
    out = CliRunner().invoke(app, ["plan", "--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192",
                                   "--quantization", "fp8", "--json"])
    assert out.exit_code == 0, out.output
    assert abs(json.loads(out.output)["non_kv"]["weights_gib"] / 8.49 - 1) < 0.01


def test_plan_refuses_a_method_that_needs_a_quantized_checkpoint() -> None:
    out = CliRunner().invoke(app, ["plan", "--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192",
                                   "--quantization", "gptq"])
    assert out.exit_code == 2
    assert "--quantization gptq" in out.output
    assert "Traceback" not in out.output


def _checkpoint_header(raw: dict[str, Any], directory: Path) -> None:
    """A safetensors file holding only the header of the checkpoint transformers writes for this
    config (every state-dict tensor, its shape, bf16; tied weights once), built on the meta device."""
    import struct

    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{k: v for k, v in raw.items() if k not in ("architectures", "torch_dtype")})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    header, offset = {}, 0
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        size = tensor.numel() * 2
        header[name] = {"dtype": "BF16", "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text)


@pytest.mark.parametrize(("model", "tp"), sorted({*_ROUNDED, ("Qwen/Qwen2.5-7B-Instruct", 2), ("Qwen/Qwen2.5-7B-Instruct", 4)}))
def test_a_model_dir_plan_holds_what_vllm_builds_beyond_the_checkpoint(model: str, tp: int, tmp_path: Path) -> None:
    """--model-dir on a GPU: the checkpoint's bytes split over the ranks, plus what vLLM's
    "Model loading took" holds beyond them (rotary caches, the allocator's rounding of its fused
    tensors), meet the logged runs as the config.json count does."""
    run = next(r for r in [*read_runs(LOGS), *read_runs(PUBLIC_LOGS)] if (r.model, r.tp, r.pp) == (model, tp, 1))
    config = find_config(run.model)
    assert config is not None
    raw = json.loads(config.read_text())
    _checkpoint_header(raw, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    args = ["plan", "--config", str(tmp_path / "config.json"), "--model-dir", str(tmp_path), "--gpu", "H100",
            "--max-model-len", "4096", "-tp", str(tp), "--gpu-memory-utilization", "0.95", "--json"]
    if run.args.get("dtype"):
        args += ["--dtype", str(run.args["dtype"])]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    weights, source = plan["non_kv"]["weights_gib"], plan["non_kv_sources"]["weights_gib"]
    assert source.startswith("safetensors headers / (TP × PP) + rotary"), source
    assert abs(weights - run.weights_gib) <= 0.005 + MIB / GIB, (weights, run.weights_gib, source)
