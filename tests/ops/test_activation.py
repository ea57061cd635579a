"""The default profile-run peak (capacity/activation.py) against the terms vLLM's profile run
holds, and against the published vLLM 0.19 H100 logs' own "torch peak memory increase" lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvops.ops.bench import gpu_logs
from kvops.ops.capacity.activation import activation_shape

GIB = 2**30
SHARED = Path(__file__).parents[2] / "../shared/fixtures/model-configs"
LOCAL = Path(__file__).parents[1] / "fixtures/model-configs"
SEQS, MNBT = 1024, 8192  # vLLM 0.19's defaults on an H100, as the logs ran


def _peak(config: Path, tp: int = 1, gpu: str | None = "H100", last_stage: bool = True) -> float:
    shape = activation_shape(json.loads(config.read_text()), "bfloat16", tp, 1, gpu)
    return shape.peak_gib(SEQS, MNBT, last_stage)


@pytest.mark.parametrize(("config", "logged"), [
    (SHARED / "meta-llama--Meta-Llama-3.1-8B.json", 1.89),  # fit
    (LOCAL / "Qwen--Qwen2.5-7B-Instruct.json", 2.21),  # fit
    (LOCAL / "google--gemma-2-9b-it.json", 3.65),
    (LOCAL / "Qwen--Qwen2.5-72B-Instruct.json", 2.29),
    (LOCAL / "microsoft--phi-4.json", 1.52),
    (SHARED / "Qwen--Qwen3-8B.json", 2.21),
])
def test_a_dense_models_peak_is_its_sampler_warm_up_at_every_tp(config: Path, logged: float) -> None:
    """The logs' torch peak does not move with TP (Llama-3.1-8B: 1.89 GiB at TP1, 2 and 4): the
    sampler sees the whole vocabulary on every rank, and it outweighs the forward."""
    assert _peak(config) == pytest.approx(logged, abs=0.05)
    assert _peak(config, tp=2) == _peak(config, tp=4) == _peak(config)


def test_the_fused_moe_workspace_is_held_through_the_sampler() -> None:
    """Qwen3-30B-A3B (0.19 H100 log: torch peak 2.68 GiB, 0.47 above Qwen3-8B's with the same
    vocabulary): TritonExperts' workspaces at 8192 tokens, top_k 8, width 768, hidden 2048."""
    raw = json.loads((SHARED / "Qwen--Qwen3-30B-A3B.json").read_text())
    shape = activation_shape(raw, "bfloat16", 1, 1)
    assert shape.held_gib(MNBT) == MNBT * 8 * (2048 + 2048) * 2 / GIB
    assert shape.peak_gib(SEQS, MNBT) == shape.sampler_gib(SEQS, MNBT) + shape.held_gib(MNBT)
    assert _peak(SHARED / "Qwen--Qwen3-30B-A3B.json") == pytest.approx(2.68, abs=0.05)


def test_gpt_oss_on_hopper_runs_a_monolithic_kernel_without_a_workspace() -> None:
    gpt_oss = SHARED / "openai--gpt-oss-20b.json"
    assert _peak(gpt_oss, tp=2) == pytest.approx(2.87, abs=0.05)  # the 0.19 H100 log
    assert _peak(gpt_oss, tp=2, gpu="A100") > _peak(gpt_oss, tp=2) + 0.1  # a modular kernel's workspace


def test_a_multimodal_models_dummy_images_are_held_through_the_sampler() -> None:
    """gemma-3 (logs: 3.89 / 3.99 GiB for 4b / 27b, gemma-2's text-only 3.62-3.66): the encoder
    profiling's 32 dummy 896x896 images of 256 tokens each, and their embeddings."""
    for name, hidden, logged in (("google--gemma-3-4b-it.json", 2560, 3.89), ("google--gemma-3-27b-it.json", 5376, 3.99)):
        raw = json.loads((LOCAL / name).read_text())
        shape = activation_shape(raw, "bfloat16", 1, 1)
        assert shape.held_gib(MNBT) == pytest.approx(MNBT * (3 * 896 * 896 // 256 + hidden) * 2 / GIB)
        assert shape.peak_gib(SEQS, MNBT) == pytest.approx(logged, abs=0.05)


def test_a_first_pipeline_stage_runs_no_sampler() -> None:
    llama = SHARED / "meta-llama--Meta-Llama-3.1-8B.json"
    assert _peak(llama, last_stage=False) < _peak(llama) / 2


def test_held_out_moe_and_multimodal_logs_get_no_more_kv_than_they_had() -> None:
    """The issue's bound, +0.5% available KV at most, on every logged MoE or multimodal run (they
    were up to +3.5% when the activation summed a forward and a sampler fitted on dense models)."""
    out = gpu_logs.run()
    moe_or_mm = {"deepseek-ai/DeepSeek-V2-Lite-Chat", "google/gemma-3-27b-it", "google/gemma-3-4b-it",
                 "meta-llama/Llama-4-Scout-17B-16E-Instruct", "mistralai/Mixtral-8x7B-Instruct-v0.1",
                 "openai/gpt-oss-20b", "Qwen/Qwen3-30B-A3B"}
    cases = [c for c in out["gpu_logs"] if c["model"] in moe_or_mm]
    assert {c["model"] for c in cases} == moe_or_mm
    assert max(c["available_kv_error_pct"] for c in cases) <= 0.5
