"""Speculative decoding (K tokens, MTP/EAGLE/ngram) on sliding-window and mamba/GDN layers.

The oracle gives vLLM's VllmConfig a speculative config whose ``use_eagle`` /
``use_eagle_block_drop`` / ``use_multi_module_mtp`` are vLLM's own SpeculativeConfig methods, so
vLLM itself decides the sliding-window ``extra_retained_tokens`` (get_kv_cache_configs) and the
hybrid block alignment (the model classes' ``get_mamba_state_shape_from_config`` widen the conv
state by K). Mamba specs get ``num_speculative_blocks = vllm_config.num_speculative_tokens`` as
MambaBase.get_kv_cache_spec sets it (model_executor/layers/mamba/abstract.py:65-82). Drafter
layers are copies of the target's full-attention spec registered after the target's layers.
"""

from __future__ import annotations

import json
from dataclasses import replace
from types import MethodType, SimpleNamespace
from typing import Any

import pytest
from test_capacity_oracle import FIXTURES, GIB, Oracle, capacity_or_none, synthetic_configs

from kvops.core.errors import BadInputError
from kvops.ops.capacity.allocator import SizingFlags, kv_capacity
from kvops.ops.capacity.model import read_model

Result = tuple[int, int, float] | None


def speculative_config(method: str, k: int, draft: int) -> Any:
    from vllm.config.speculative import SpeculativeConfig

    ns = SimpleNamespace(method=method, num_speculative_tokens=k, disable_eagle_block_drop=False,
                         draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(num_nextn_predict_layers=draft)))
    for name in ("use_eagle", "use_eagle_block_drop", "use_multi_module_mtp"):
        setattr(ns, name, MethodType(getattr(SpeculativeConfig, name), ns))
    return ns


def run_vllm(oracle: Oracle, cfg: dict[str, Any], case: dict[str, Any]) -> Result:
    vc = oracle.vllm_config(cfg, case)
    vc.speculative_config = speculative_config(case["method"], case["k"], case["draft"])
    vc.model_config.hf_config.model_type = cfg.get("model_type", "unknown")
    specs = oracle.specs(cfg, vc, case)
    specs = {name: replace(spec, num_speculative_blocks=vc.num_speculative_tokens)
             if isinstance(spec, oracle.Mamba) else spec for name, spec in specs.items()}
    for i in range(case["draft"]):
        specs[f"mtp.layers.{i}.attn"] = next(spec for spec in specs.values() if type(spec) is oracle.Full)
    try:
        [config] = oracle.utils.get_kv_cache_configs(vc, [specs], [case["budget"]])
    except ValueError:
        return None
    tokens, conc = oracle.utils.get_kv_cache_capacity(vc, config)
    return config.num_blocks, tokens, conc


def ours(cfg: dict[str, Any], case: dict[str, Any]) -> Result:
    model = read_model(cfg, tp=case["tp"], kv_cache_dtype=case["kv"], draft_layers=case["draft"],
                       num_speculative_tokens=case["k"], speculative_method=case["method"])
    flags = SizingFlags(max_model_len=case["mml"], device=case["device"], max_num_batched_tokens=case["mnbt"])
    return capacity_or_none(model, case["budget"], flags)


def config(name: str) -> dict[str, Any]:
    files = {"gpt_oss_20b": "openai--gpt-oss-20b.json", "nemotron_h": "nvidia--Nemotron-H-56B-Base-8K.json"}
    cfg = json.loads((FIXTURES / files[name]).read_text()) if name in files else synthetic_configs()[name]
    cfg.setdefault("torch_dtype", "bfloat16")
    return cfg


@pytest.fixture(scope="module")
def oracle() -> Oracle:
    return Oracle()


# (method, K, drafter layers): multi-module MTP (3 layers, K ≥ 2) retains K − 1 extra sliding tokens,
# single-module MTP and EAGLE none; every method widens mamba states and adds K state blocks.
METHODS = [("mtp", 1, 1), ("mtp", 3, 1), ("mtp", 2, 3), ("mtp", 4, 3), ("eagle", 3, 1), ("ngram", 4, 0)]


@pytest.mark.parametrize("name", ["gpt_oss_20b", "gemma_like_5to1", "mistral_all_sw", "qwen3_next", "nemotron_h"])
def test_speculative_tokens_match_vllm(oracle: Oracle, name: str) -> None:
    cfg = config(name)
    tp = 8 if name == "nemotron_h" else 2
    checked = total = 0
    for method, k, draft in METHODS:
        if draft and name == "mistral_all_sw":
            continue  # every layer slides: no full-attention spec for a drafter to copy
        for budget in (int(2.5 * GIB), 20 * GIB):
            for mml in (4096, 131_072):
                for device, mnbt in (("cuda", 2048), ("cpu", 4096)):
                    case = {"budget": budget, "mml": mml, "tp": tp, "kv": "auto", "device": device, "mnbt": mnbt,
                            "method": method, "k": k, "draft": draft}
                    expected = run_vllm(oracle, cfg, case)
                    assert ours(cfg, case) == expected, f"{name} {case}: vLLM {expected}"
                    checked, total = checked + (expected is not None), total + 1
    assert checked * 2 > total  # most cases fit: not a comparison of refusals


def test_multi_module_mtp_widens_the_sliding_reserve() -> None:
    cfg = config("gpt_oss_20b")
    blocks = {}
    for method, k, draft in (("mtp", 4, 1), ("mtp", 4, 3)):
        model = read_model(cfg, draft_layers=draft, num_speculative_tokens=k, speculative_method=method)
        cap = kv_capacity(model, 20 * GIB, SizingFlags(max_model_len=131_072, max_num_batched_tokens=2048))
        blocks[draft] = {g.kind: g.blocks_per_request for g in cap.groups}
    # window 128 − 1 + in-flight 2 × 2048 (+ 3 retained with 3 MTP modules) over 16-token blocks, + 1
    assert blocks[1]["sliding"] == -(-(127 + 4096) // 16) + 1
    assert blocks[3]["sliding"] == -(-(127 + 3 + 4096) // 16) + 1


def test_hybrid_drafter_needs_the_token_count() -> None:
    with pytest.raises(BadInputError, match="--num-speculative-tokens"):
        read_model(config("qwen3_next"), draft_layers=1)
    with pytest.raises(BadInputError, match="--speculative-method"):
        read_model(config("qwen3_next"), num_speculative_tokens=2)
    with pytest.raises(BadInputError, match="medusa2"):
        read_model(config("qwen3_next"), num_speculative_tokens=2, speculative_method="medusa2")
