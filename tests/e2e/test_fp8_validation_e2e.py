"""fp8 KV combinations that cannot work are refused by the real `vllm serve` at start-up, with
exit code 2 and one line naming the cause and the fix (vLLM alone would fail in a worker after
loading the model, or run with wrong scales)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from fp8_cpu import CPU_RUNS_FP8, VLLM_REFUSAL

from kvops.core.fp8.scales import fingerprint_of_config, read_model_config

from .conftest import Refusals, RefusalStart, TinyModels

pytestmark = pytest.mark.e2e

LEN = ("--max-model-len", "2048")
FP8 = ("--kv-cache-dtype", "fp8")
FAKE_FLAGS = "KVOPS_FAKE_CPU_FLAGS"
# The refusals below come from the plugin in the front end, before any worker runs an fp8
# kernel. On a CPU without AVX-512/AMX the plugin would refuse them all for the ISA first, so
# there its CPU check reads an AVX-512 flag (simulated) to reach the rule under test.
ISA = {} if CPU_RUNS_FP8 else {FAKE_FLAGS: "sse4_2,avx2,avx512f"}


def _refusal(vllm, model: Path, *args: str, env: dict[str, str] | None = ISA) -> str:
    code, log = vllm.start_expecting_failure(model, *LEN, *args, env=env)
    assert code == 2, log[-3000:]
    reasons = [line for line in log.splitlines() if line.startswith("kvops: refusing to start:")]
    assert len(reasons) == 1, log[-3000:]
    assert "Traceback" not in log
    return reasons[0]


def _scales_doc(model: Path, k_scale: float = 0.5) -> dict[str, object]:
    fingerprint = fingerprint_of_config(read_model_config(model))
    return {
        "dtype": "fp8_e4m3",
        "model": fingerprint.model_dump(),
        "layers": {
            f"model.layers.{i}.self_attn.attn": {"k_scale": k_scale, "v_scale": 0.5}
            for i in range(fingerprint.num_layers)
        },
    }


def _kv_config(path: Path) -> str:
    return json.dumps({"kvops": {"kv_scales": str(path)}})


def _mla_model(tiny_model: Path, root: Path) -> Path:
    model = root / "tiny-mla"
    shutil.copytree(tiny_model, model)
    config = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "kv_lora_rank": 64, "q_lora_rank": None, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32,
        "v_head_dim": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 2,
        "vocab_size": 1024, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    (model / "config.json").write_text(json.dumps(config))
    return model


def _model_with_scales(tiny_model: Path, root: Path) -> Path:
    model = root / "tiny-with-scales"
    shutil.copytree(tiny_model, model)
    # A second shard that carries per-layer k/v scales, as fp8 checkpoints do.
    header = {}
    for i in range(4):
        for kind in ("k_scale", "v_scale"):
            offset = 4 * len(header)
            header[f"model.layers.{i}.self_attn.{kind}"] = {
                "dtype": "F32", "shape": [], "data_offsets": [offset, offset + 4],
            }
    raw = json.dumps(header).encode()
    (model / "scales.safetensors").write_bytes(
        struct.pack("<Q", len(raw)) + raw + struct.pack("<f", 0.5) * len(header)
    )
    return model


def _scales_file(root: Path, name: str, doc: dict[str, object]) -> Path:
    path = root / name
    path.write_text(json.dumps(doc))
    return path


def refusals(models: TinyModels, root: Path) -> Refusals:
    """Every refusal's model and scales file, by name, and the refusals (conftest
    ``module_refusals``: they start beside the unit tests, or three at a time before this
    module's first test)."""
    tiny_model = models()
    made = {
        "head_dim_80": models(hidden=320, heads=4, kv_heads=2, head_dim=80),
        "mla": _mla_model(tiny_model, root),
        "with_scales": _model_with_scales(tiny_model, root),
        "other_scales": _scales_file(root, "other-scales.json", _scales_doc(models(layers=2))),
        "zero": _scales_file(root, "zero-scales.json", _scales_doc(tiny_model, k_scale=0.0)),
        "nan": _scales_file(root, "nan-scales.json", _scales_doc(tiny_model, k_scale=float("nan"))),
        "scales": _scales_file(root, "scales.json", _scales_doc(tiny_model)),
    }
    starts: list[RefusalStart] = [
        (tiny_model, (*LEN, *FP8), {FAKE_FLAGS: "sse4_2,avx2,fma"} if CPU_RUNS_FP8 else None),
        (made["head_dim_80"], (*LEN, *FP8), ISA),
        (made["mla"], (*LEN, *FP8), ISA),
        (made["with_scales"], (*LEN, "--kv-cache-dtype", "fp8_e5m2"), ISA),
        *[(tiny_model, (*LEN, *FP8, "--additional-config", _kv_config(made[k])), ISA)
          for k in ("other_scales", "zero", "nan")],
        (tiny_model, (*LEN, "--additional-config", _kv_config(made["scales"])), ISA),
    ]
    if not CPU_RUNS_FP8:
        starts.append((tiny_model, (*LEN, *FP8), {"VLLM_PLUGINS": "none"}))
    return made, starts


@pytest.fixture(scope="module")
def inputs(refusals_under_way: dict[str, Path]) -> dict[str, Path]:
    return refusals_under_way


def test_cpu_without_avx512_or_amx(vllm, tiny_model, inputs):
    # Real on a CPU without AVX-512/AMX; simulated (the flags the plugin reads replaced) on one
    # that has them.
    env = {FAKE_FLAGS: "sse4_2,avx2,fma"} if CPU_RUNS_FP8 else None
    reason = _refusal(vllm, tiny_model, *FP8, env=env)
    assert "needs x86 with AVX-512 or AMX" in reason


@pytest.mark.skipif(CPU_RUNS_FP8, reason="this CPU has AVX-512/AMX: vLLM serves fp8 KV here "
                    "(tests/e2e/test_fp8_e2e.py runs it)")
def test_vllm_alone_refuses_fp8_on_this_cpu(vllm, tiny_model, inputs):
    """The oracle for the plugin's refusal: unmodified vLLM cannot serve fp8 KV on this CPU
    either; it fails later, in its worker, after loading the model."""
    code, log = vllm.start_expecting_failure(tiny_model, *LEN, *FP8, env={"VLLM_PLUGINS": "none"})
    assert code != 0
    assert VLLM_REFUSAL in log, log[-3000:]
    assert "kvops: refusing to start" not in log


def test_head_dim_not_a_multiple_of_32(vllm, inputs):
    reason = _refusal(vllm, inputs["head_dim_80"], *FP8)
    assert "head_dim % 32 == 0; this model's head_dim is 80" in reason


def test_mla_model_on_cpu(vllm, inputs):
    reason = _refusal(vllm, inputs["mla"], *FP8)
    assert "MLA models cannot use fp8 KV on CPU" in reason


def test_e5m2_with_checkpoint_scales(vllm, inputs):
    reason = _refusal(vllm, inputs["with_scales"], "--kv-cache-dtype", "fp8_e5m2")
    assert "fp8_e5m2 with a checkpoint that carries k/v scales" in reason
    assert "use --kv-cache-dtype fp8_e4m3" in reason


def test_scales_file_of_another_model(vllm, tiny_model, inputs):
    reason = _refusal(vllm, tiny_model, *FP8, "--additional-config", _kv_config(inputs["other_scales"]))
    assert "was calibrated for another model (num_layers is 2 in the scales file but 4" in reason


@pytest.mark.parametrize("bad", ["zero", "nan"])
def test_non_positive_or_non_finite_scale(vllm, tiny_model, inputs, bad):
    reason = _refusal(vllm, tiny_model, *FP8, "--additional-config", _kv_config(inputs[bad]))
    assert "layers.model.layers.0.self_attn.attn.k_scale: Value error, must be a positive finite" in reason


def test_scales_without_fp8_kv(vllm, tiny_model, inputs):
    reason = _refusal(vllm, tiny_model, "--additional-config", _kv_config(inputs["scales"]))
    assert "kv_scales is set but --kv-cache-dtype is 'auto'" in reason
