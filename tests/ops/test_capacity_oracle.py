"""The planner against vLLM 0.32's own allocator, which runs on CPU.

The oracle side builds every layer's KVCacheSpec with vLLM's classes (FullAttentionSpec,
SlidingWindowSpec, MLAAttentionSpec, MambaSpec with shapes from vLLM's model classes), lets
vLLM's platform code align hybrid block sizes, and calls ``get_kv_cache_configs`` +
``get_kv_cache_capacity``. Our side only sees the config.json and the flags. The numbers must be
EQUAL; a case where vLLM refuses (not enough memory for one request) must be refused by us too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvops.core.errors import BadInputError
from kvops.ops.capacity.allocator import SizingFlags, kv_capacity
from kvops.ops.capacity.model import ModelKV, read_model

FIXTURES = Path(__file__).parents[2] / "../shared/fixtures/model-configs"
GIB = 1 << 30


class Oracle:
    """vLLM imported once per session; each call builds a fresh VllmConfig."""

    def __init__(self) -> None:
        import torch
        from vllm.config import VllmConfig
        from vllm.model_executor.models import ModelRegistry
        from vllm.platforms.interface import Platform
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            MambaSpec,
            MLAAttentionSpec,
            SlidingWindowSpec,
        )
        self.torch, self.VllmConfig, self.registry, self.platform = torch, VllmConfig, ModelRegistry, Platform
        self.backends = {"cuda": FlashAttentionBackend, "cpu": CPUAttentionBackend}
        self.utils = kv_cache_utils
        self.Full, self.Mamba, self.MLA, self.SW = FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    def vllm_config(self, cfg: dict[str, Any], case: dict[str, Any]) -> Any:
        torch = self.torch
        vc = self.VllmConfig()
        tp, device = case["tp"], case["device"]
        total_kv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        use_mla = cfg.get("kv_lora_rank") is not None
        head = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) if use_mla else (
            cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        hf = SimpleNamespace(**cfg)
        vc.model_config = SimpleNamespace(
            max_model_len=case["mml"], original_max_model_len=case["mml"], use_mla=use_mla,
            dtype=torch.bfloat16, architecture=cfg["architectures"][0], hf_config=hf,
            hf_text_config=hf, model_impl="auto", runner_type="generate", convert_type="none",
            is_hybrid=True, get_head_size=lambda: head,
            get_num_kv_heads=lambda pc: 1 if use_mla else max(1, total_kv // pc.tensor_parallel_size),
        )
        vc.parallel_config.tensor_parallel_size = tp
        vc.cache_config.kv_cache_layout = "LBHNC"
        vc.cache_config.block_size = case.get("block_size") or (
            16 if device == "cuda" or use_mla else 128)
        vc.cache_config.cache_dtype = case["kv"]
        vc.cache_config.mamba_cache_mode = "align"
        vc.cache_config.mamba_ssm_cache_dtype = "auto"
        vc.scheduler_config.max_num_batched_tokens = case["mnbt"]
        vc.scheduler_config.async_scheduling = device == "cuda"
        vc.head, vc.use_mla, vc.total_kv = head, use_mla, total_kv  # type: ignore[attr-defined]
        return vc

    def specs(self, cfg: dict[str, Any], vc: Any, case: dict[str, Any]) -> dict[str, Any]:
        """Per-layer specs as the model's layers would return them, from vLLM's classes."""
        torch, kinds = self.torch, oracle_layer_kinds(cfg)
        dtype = torch.float8_e4m3fn if case["kv"].startswith("fp8") else torch.bfloat16
        backend = self.backends[case["device"]]
        has_mamba = any(k == "mamba" for k in kinds)
        model_cls = None
        if has_mamba:
            self.platform._find_non_ssm_backends = classmethod(lambda c, v: [backend])
            self.platform._align_hybrid_block_size(vc, backend)
            model_cls, _ = self.registry.resolve_model_cls(vc.model_config.architecture,
                                                           model_config=vc.model_config)
        bs = vc.cache_config.block_size
        heads = vc.model_config.get_num_kv_heads(vc.parallel_config)
        out: dict[str, Any] = {}
        for i, kind in enumerate(kinds):
            name = f"model.layers.{i}.attn"
            if kind == "mamba":
                assert model_cls is not None
                out[name] = self.Mamba(
                    block_size=bs, shapes=model_cls.get_mamba_state_shape_from_config(vc),
                    dtypes=model_cls.get_mamba_state_dtype_from_config(vc),
                    page_size_padded=vc.cache_config.mamba_page_size_padded,
                    num_prefill_checkpoint_blocks=1 if cfg.get("hybrid_override_pattern") else 0)
            elif vc.use_mla:
                out[name] = self.MLA(block_size=bs, num_kv_heads=1, max_tp_shards=1, head_size=vc.head,
                                     dtype=dtype, cache_dtype_str=case["kv"],
                                     state_content_bytes={"fp8_ds_mla": 656}.get(case["kv"]))
            elif kind == "sliding":
                out[name] = self.SW(block_size=bs, num_kv_heads=heads, head_size=vc.head, dtype=dtype,
                                    sliding_window=cfg["sliding_window"])
            else:
                out[name] = self.Full(block_size=bs, num_kv_heads=heads, head_size=vc.head, dtype=dtype)
        return out

    def run(self, cfg: dict[str, Any], case: dict[str, Any]) -> tuple[int, int, float] | None:
        vc = self.vllm_config(cfg, case)
        specs = self.specs(cfg, vc, case)
        try:
            [config] = self.utils.get_kv_cache_configs(vc, [specs], [case["budget"]])
        except ValueError:
            return None
        tokens, conc = self.utils.get_kv_cache_capacity(vc, config)
        return config.num_blocks, tokens, conc


def oracle_layer_kinds(cfg: dict[str, Any]) -> list[str]:
    """Layer kinds read straight from the config fields each family uses."""
    if "hybrid_override_pattern" in cfg:  # Nemotron-H: M = Mamba2, * = attention, -/E none
        return [{"M": "mamba", "*": "full"}.get(c, "none") for c in cfg["hybrid_override_pattern"]
                if c in "M*"]
    if "full_attention_interval" in cfg:  # Qwen3-Next: every interval-th layer is attention
        n = cfg["full_attention_interval"]
        return ["full" if (i + 1) % n == 0 else "mamba" for i in range(cfg["num_hidden_layers"])]
    if cfg.get("layer_types"):
        return ["sliding" if t == "sliding_attention" else "full" for t in cfg["layer_types"]]
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        return ["sliding"] * cfg["num_hidden_layers"]
    return ["full"] * cfg["num_hidden_layers"]


@pytest.fixture(scope="session")
def oracle() -> Oracle:
    return Oracle()


def capacity_or_none(model: ModelKV, budget: int, flags: SizingFlags) -> tuple[int, int, float] | None:
    """Our (num_blocks, tokens, concurrency) for one rank's budget; None where we refuse, as vLLM fails."""
    try:
        cap = kv_capacity(model, budget, flags)
    except BadInputError:
        return None
    return cap.num_blocks, cap.kv_cache_size_tokens, cap.max_concurrency


def ours(cfg: dict[str, Any], case: dict[str, Any]) -> tuple[int, int, float] | None:
    model = read_model(cfg, tp=case["tp"], kv_cache_dtype=case["kv"])
    flags = SizingFlags(max_model_len=case["mml"], device=case["device"],
                        block_size=case.get("block_size"), max_num_batched_tokens=case["mnbt"])
    return capacity_or_none(model, case["budget"], flags)


def assert_equal(oracle: Oracle, cfg: dict[str, Any], case: dict[str, Any]) -> None:
    expected, got = oracle.run(cfg, case), ours(cfg, case)
    assert got == expected, f"{cfg['architectures'][0]} {case}: ours {got} vLLM {expected}"


FIXTURE_FILES = sorted(FIXTURES.glob("*.json"))
BUDGETS = (int(2.5 * GIB), 20 * GIB, 70 * GIB + 12345)


def test_fixture_dir_is_populated() -> None:
    assert len(FIXTURE_FILES) >= 10, f"fixtures missing under {FIXTURES.resolve()}"


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.stem)
def test_fixture_configs_match_vllm(oracle: Oracle, path: Path) -> None:
    cfg = json.loads(path.read_text())
    cfg.setdefault("torch_dtype", "bfloat16")
    use_mla = cfg.get("kv_lora_rank") is not None
    tps = (1, 8) if use_mla or cfg.get("hybrid_override_pattern") else (1, 2, 16)
    kvs = ("auto", "fp8", "fp8_ds_mla") if use_mla else ("auto", "fp8")
    for budget in BUDGETS:
        for mml in (4096, 32_000):
            for tp in tps:
                for kv in kvs:
                    for device in ("cuda", "cpu"):
                        if kv == "fp8_ds_mla" and device == "cpu":
                            continue
                        case = {"budget": budget, "mml": mml, "tp": tp, "kv": kv,
                                "device": device, "mnbt": 2048}
                        assert_equal(oracle, cfg, case)


def synthetic_configs() -> dict[str, dict[str, Any]]:
    """One config per family, shaped after public models (values stated here)."""
    base = {"num_attention_heads": 32, "hidden_size": 4096, "torch_dtype": "bfloat16",
            "num_hidden_layers": 8}
    return {
        "mha": {**base, "architectures": ["LlamaForCausalLM"], "num_key_value_heads": 32},
        "mqa": {**base, "architectures": ["FalconForCausalLM"], "num_key_value_heads": 1},
        "gqa_head_dim": {**base, "architectures": ["Qwen3ForCausalLM"], "num_key_value_heads": 4,
                         "head_dim": 256},
        "mistral_all_sw": {**base, "architectures": ["MistralForCausalLM"], "num_key_value_heads": 8,
                           "sliding_window": 4096},
        "gemma_like_5to1": {**base, "architectures": ["Gemma3ForCausalLM"], "num_key_value_heads": 16,
                            "num_hidden_layers": 62, "head_dim": 128, "sliding_window": 1024,
                            "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                            for i in range(62)]},
        "mla": {**base, "architectures": ["DeepseekV2ForCausalLM"], "num_key_value_heads": 16,
                "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_hidden_layers": 27},
        "qwen3_next": {**base, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
                       "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
                       "head_dim": 256, "hidden_size": 2048, "full_attention_interval": 4,
                       "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                       "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                       "linear_conv_kernel_dim": 4},
    }


@pytest.mark.parametrize("name", sorted(synthetic_configs()))
def test_synthetic_families_match_vllm(oracle: Oracle, name: str) -> None:
    cfg = synthetic_configs()[name]
    tps = (1, 2) if name == "qwen3_next" else (1, 2, 4)
    for budget in BUDGETS:
        for mml in (2048, 8192, 131_072):
            for tp in tps:
                for kv in ("auto", "fp8"):
                    for device, mnbt in (("cuda", 2048), ("cuda", 8192), ("cpu", 4096)):
                        case = {"budget": budget, "mml": mml, "tp": tp, "kv": kv,
                                "device": device, "mnbt": mnbt}
                        assert_equal(oracle, cfg, case)


def test_user_block_size_matches_vllm(oracle: Oracle) -> None:
    cfg = json.loads((FIXTURES / "meta-llama--Meta-Llama-3.1-8B.json").read_text())
    for bs in (16, 32, 128):
        case = {"budget": 7 * GIB + 1, "mml": 10_000, "tp": 1, "kv": "auto", "device": "cuda",
                "mnbt": 2048, "block_size": bs}
        assert_equal(oracle, cfg, case)


def test_qwen3_next_block_size_is_544_as_logged_by_vllm() -> None:
    # vLLM v0.10.2 log on 2×H200 (planner.md §3.1 row A): "Setting attention block size to 544".
    cfg = synthetic_configs()["qwen3_next"]
    for tp in (1, 2):
        cap = kv_capacity(read_model(cfg, tp=tp), 20 * GIB, SizingFlags(max_model_len=8192))
        assert cap.block_size == 544
    # page arithmetic: 544 tokens × 1 head × 2 × 256 × 2 B = 557,056 B per layer page at TP2
    assert math.prod((544, 1, 2, 256, 2)) == 557_056


def run_pp(oracle: Oracle, cfg: dict[str, Any], case: dict[str, Any]) -> tuple[int, int, float] | None:
    """Each PP stage gets the layers vLLM's own get_pp_indices gives it; one worker per stage."""
    from vllm.distributed.utils import get_pp_indices

    vc = oracle.vllm_config(cfg, case)
    vc.parallel_config.pipeline_parallel_size = case["pp"]
    specs = oracle.specs(cfg, vc, case)
    names = list(specs)
    workers = []
    for rank in range(case["pp"]):
        first, last = get_pp_indices(len(names), rank, case["pp"])
        workers.append({name: specs[name] for name in names[first:last]})
    try:
        configs = oracle.utils.get_kv_cache_configs(vc, workers, [case["budget"]] * case["pp"])
    except ValueError:
        return None
    tokens, conc = oracle.utils.get_kv_cache_capacity(vc, configs[0])
    return configs[0].num_blocks, tokens, conc


def ours_pp(cfg: dict[str, Any], case: dict[str, Any]) -> tuple[int, int, float] | None:
    model = read_model(cfg, tp=case["tp"], kv_cache_dtype=case["kv"])
    flags = SizingFlags(max_model_len=case["mml"], device=case["device"], max_num_batched_tokens=case["mnbt"],
                        pipeline_parallel_size=case["pp"])
    return capacity_or_none(model, case["budget"], flags)


@pytest.mark.parametrize("name", ["llama_8b", "gpt_oss_20b", "gemma_like_5to1", "mistral_all_sw", "qwen3_next"])
def test_pipeline_parallel_matches_vllm(oracle: Oracle, name: str) -> None:
    fixtures = {"llama_8b": "meta-llama--Meta-Llama-3.1-8B.json", "gpt_oss_20b": "openai--gpt-oss-20b.json"}
    cfg = json.loads((FIXTURES / fixtures[name]).read_text()) if name in fixtures else synthetic_configs()[name]
    cfg.setdefault("torch_dtype", "bfloat16")
    for pp in (2, 3, 5):
        for budget in (int(2.5 * GIB), 20 * GIB):
            for mml, device in ((4096, "cuda"), (32_000, "cuda"), (8192, "cpu")):
                case = {"budget": budget, "mml": mml, "tp": 1, "kv": "auto", "device": device,
                        "mnbt": 2048, "pp": pp}
                expected, got = run_pp(oracle, cfg, case), ours_pp(cfg, case)
                assert got == expected, f"{name} {case}: ours {got} vLLM {expected}"


def run_draft(oracle: Oracle, cfg: dict[str, Any], case: dict[str, Any]) -> tuple[int, int, float] | None:
    """Target layers plus ``draft`` drafter attention layers registered after them (MTP/EAGLE:
    the drafter's layers join the groups, v1/core/kv_cache_utils.py:2029-2119), on the last stage."""
    from vllm.distributed.utils import get_pp_indices

    vc = oracle.vllm_config(cfg, case)
    vc.parallel_config.pipeline_parallel_size = case["pp"]
    specs = oracle.specs(cfg, vc, case)
    names = list(specs)
    attention = next(spec for name, spec in specs.items() if not isinstance(spec, oracle.SW))
    workers = []
    for rank in range(case["pp"]):
        first, last = get_pp_indices(len(names), rank, case["pp"])
        workers.append({name: specs[name] for name in names[first:last]})
    for i in range(case["draft"]):
        workers[-1][f"draft.layers.{i}.attn"] = attention
    try:
        configs = oracle.utils.get_kv_cache_configs(vc, workers, [case["budget"]] * case["pp"])
    except ValueError:
        return None
    tokens, conc = oracle.utils.get_kv_cache_capacity(vc, configs[0])
    return configs[0].num_blocks, tokens, conc


@pytest.mark.parametrize("path", ["meta-llama--Meta-Llama-3.1-8B.json", "deepseek-ai--DeepSeek-V3.json",
                                  "openai--gpt-oss-20b.json"])
def test_draft_layers_match_vllm(oracle: Oracle, path: str) -> None:
    cfg = json.loads((FIXTURES / path).read_text())
    cfg.setdefault("torch_dtype", "bfloat16")
    for draft in (1, 3):
        for pp in (1, 2):
            for budget, mml in ((int(2.5 * GIB), 4096), (20 * GIB, 32_000)):
                case = {"budget": budget, "mml": mml, "tp": 1, "kv": "auto", "device": "cuda", "mnbt": 2048,
                        "pp": pp, "draft": draft}
                model = read_model(cfg, kv_cache_dtype="auto", draft_layers=draft)
                flags = SizingFlags(max_model_len=mml, max_num_batched_tokens=2048, pipeline_parallel_size=pp)
                try:
                    cap = kv_capacity(model, budget, flags)
                    got: tuple[int, int, float] | None = (cap.num_blocks, cap.kv_cache_size_tokens,
                                                          cap.max_concurrency)
                except BadInputError:
                    got = None
                expected = run_draft(oracle, cfg, case)
                assert got == expected, f"{path} {case}: ours {got} vLLM {expected}"
