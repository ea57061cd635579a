"""Gemma-4 per-layer head dims (global_head_dim) against vLLM 0.32's allocator.

The oracle reads the config through transformers' own ``Gemma4TextConfig`` (its post-init builds
``per_layer_config``, defaults ``layer_types``, forces the last layer global, halves the window for
bidirectional attention), then builds each layer's spec the way vLLM's Gemma4DecoderLayer /
Gemma4Attention do (model_executor/models/gemma4.py: ``per_layer_config[i].head_dim`` and
``.num_key_value_heads``, ``max(1, kv_heads // tp)``, SlidingWindowSpec on sliding layers, no
cache for the last ``num_kv_shared_layers`` layers) and runs ``get_kv_cache_configs`` /
``get_kv_cache_capacity``. Our side only reads the raw JSON.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_capacity_oracle import GIB, Oracle

from kvops.core.errors import BadInputError
from kvops.ops.capacity.allocator import SizingFlags, kv_capacity
from kvops.ops.capacity.model import read_model

Result = tuple[int, int, float] | None

BASE = {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "torch_dtype": "bfloat16",
        "hidden_size": 5376, "num_attention_heads": 32, "max_position_embeddings": 262144}
CONFIGS: dict[str, dict[str, Any]] = {
    # 31B-like: 60 layers 5:1, sliding 16 KV heads × 256, global 4 KV heads × 512 (K = V)
    "dense_k_eq_v": {**BASE, "num_hidden_layers": 60, "num_key_value_heads": 16, "head_dim": 256,
                     "global_head_dim": 512, "num_global_key_value_heads": 4, "attention_k_eq_v": True,
                     "sliding_window": 1024},
    # E4B-like: default layer_types, global heads = sliding heads (no k_eq_v), last 18 layers KV-shared
    "kv_shared": {**BASE, "num_hidden_layers": 42, "num_key_value_heads": 2, "head_dim": 256,
                  "global_head_dim": 512, "sliding_window": 512, "num_kv_shared_layers": 18},
    # explicit layer_types whose last entry transformers turns global; bidirectional window 1024 → 513
    "bidir_all": {**BASE, "num_hidden_layers": 8, "num_key_value_heads": 8, "head_dim": 128,
                  "global_head_dim": 256, "sliding_window": 1024, "use_bidirectional_attention": "all",
                  "layer_types": ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 4},
}


def saved_form(cfg: dict[str, Any]) -> dict[str, Any]:
    """What a config.json saved by transformers 5.19 holds: per_layer_config, no global_head_dim."""
    from transformers import Gemma4TextConfig

    saved = Gemma4TextConfig(**{k: v for k, v in cfg.items() if k != "model_type"}).to_dict()
    assert "per_layer_config" in saved
    assert "global_head_dim" not in saved
    return {**saved, "architectures": cfg["architectures"], "torch_dtype": "bfloat16"}


class Gemma4Oracle:
    def __init__(self, base: Oracle) -> None:
        from transformers import Gemma4TextConfig

        self.base, self.Config = base, Gemma4TextConfig

    def specs(self, cfg: dict[str, Any], vc: Any, case: dict[str, Any]) -> dict[str, Any]:
        hf = self.Config(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
        dtype = self.base.torch.float8_e4m3fn if case["kv"].startswith("fp8") else self.base.torch.bfloat16
        first_shared = hf.num_hidden_layers - (hf.num_kv_shared_layers or 0)
        bs, out = vc.cache_config.block_size, {}
        for i, kind in enumerate(hf.layer_types):
            if i >= first_shared:
                continue  # kv_sharing_target_layer_name set: vLLM skips the layer's spec
            layer = hf.per_layer_config[i]
            kwargs = {"block_size": bs, "num_kv_heads": max(1, layer.num_key_value_heads // case["tp"]),
                      "head_size": layer.head_dim, "dtype": dtype}
            name = f"model.layers.{i}.self_attn.attn"
            if kind == "sliding_attention":
                out[name] = self.base.SW(**kwargs, sliding_window=hf.sliding_window)
            else:
                out[name] = self.base.Full(**kwargs)
        return out

    def run(self, cfg: dict[str, Any], case: dict[str, Any]) -> Result:
        vc = self.base.vllm_config({**cfg, "head_dim": cfg.get("head_dim", 256)}, case)
        try:
            [config] = self.base.utils.get_kv_cache_configs(vc, [self.specs(cfg, vc, case)], [case["budget"]])
        except ValueError:
            return None
        tokens, conc = self.base.utils.get_kv_cache_capacity(vc, config)
        return config.num_blocks, tokens, conc


@pytest.fixture(scope="module")
def gemma4_oracle() -> Gemma4Oracle:
    return Gemma4Oracle(Oracle())


def ours(cfg: dict[str, Any], case: dict[str, Any]) -> Result:
    model = read_model(cfg, tp=case["tp"], kv_cache_dtype=case["kv"])
    flags = SizingFlags(max_model_len=case["mml"], device=case["device"], block_size=case.get("block_size"),
                        max_num_batched_tokens=case["mnbt"])
    try:
        cap = kv_capacity(model, case["budget"], flags)
    except BadInputError:
        return None
    return cap.num_blocks, cap.kv_cache_size_tokens, cap.max_concurrency


@pytest.mark.parametrize("form", ["raw", "saved"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gemma4_per_layer_head_dims_match_vllm(gemma4_oracle: Gemma4Oracle, name: str, form: str) -> None:
    cfg = CONFIGS[name] if form == "raw" else saved_form(CONFIGS[name])
    checked = 0
    for budget in (int(2.5 * GIB), 20 * GIB, 70 * GIB + 12345):
        for mml in (2048, 32_768, 262_144):
            for tp in (1, 2, 8):
                for kv in ("auto", "fp8"):
                    for device, mnbt, block_size in (("cuda", 2048, None), ("cuda", 8192, 64),
                                                     ("cuda", 2048, 128), ("cpu", 4096, None)):
                        case = {"budget": budget, "mml": mml, "tp": tp, "kv": kv, "device": device,
                                "mnbt": mnbt, "block_size": block_size}
                        expected = gemma4_oracle.run(cfg, case)
                        assert ours(cfg, case) == expected, f"{name}/{form} {case}: vLLM {expected}"
                        checked += expected is not None
    assert checked > 100


def test_gemma4_layers_get_their_own_head_dims() -> None:
    model = read_model(CONFIGS["dense_k_eq_v"], tp=2)
    by_kind = {(layer.kind, layer.bytes_per_token) for layer in model.layers}
    # sliding: 16/2 heads × 2 × 256 × 2 B; global: 4/2 heads × 2 × 512 × 2 B
    assert by_kind == {("sliding", 8 * 2 * 256 * 2), ("full", 2 * 2 * 512 * 2)}
    default_block = kv_capacity(model, 20 * GIB, SizingFlags(max_model_len=8192))
    assert "--block-size" in default_block.as_dict()["notes"][0]
    assert not kv_capacity(model, 20 * GIB, SizingFlags(max_model_len=8192, block_size=128)).notes
    shared = read_model(CONFIGS["kv_shared"])
    assert max(layer.index for layer in shared.layers) == 42 - 18 - 1


def test_per_layer_head_dims_outside_gemma4_are_refused() -> None:
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 4,
             "num_attention_heads": 8, "num_key_value_heads": 8, "hidden_size": 1024, "global_head_dim": 256}
    with pytest.raises(BadInputError, match="'global_head_dim'.*only for Gemma-4"):
        read_model(llama)
    with pytest.raises(BadInputError, match="per_layer_config"):
        read_model({**CONFIGS["bidir_all"], "per_layer_config": {"3": {"sliding_window": 5}}})


@pytest.mark.parametrize("pp", [2, 3])
def test_gemma4_pipeline_parallel_matches_vllm(gemma4_oracle: Gemma4Oracle, pp: int) -> None:
    """Each stage gets vLLM's get_pp_indices share of the decoder layers (KV-shared ones own no spec)."""
    from vllm.distributed.utils import get_pp_indices

    for name in ("dense_k_eq_v", "kv_shared"):
        cfg = CONFIGS[name]
        for budget, mml in ((int(2.5 * GIB), 4096), (20 * GIB, 32_768)):
            case = {"budget": budget, "mml": mml, "tp": 1, "kv": "auto", "device": "cuda", "mnbt": 2048}
            vc = gemma4_oracle.base.vllm_config(cfg, case)
            vc.parallel_config.pipeline_parallel_size = pp
            specs = gemma4_oracle.specs(cfg, vc, case)
            workers = []
            for rank in range(pp):
                first, last = get_pp_indices(cfg["num_hidden_layers"], rank, pp)
                workers.append({k: v for k, v in specs.items() if first <= int(k.split(".")[2]) < last})
            flags = SizingFlags(max_model_len=mml, pipeline_parallel_size=pp)
            try:
                [config, *_] = gemma4_oracle.base.utils.get_kv_cache_configs(vc, workers, [budget] * pp)
            except ValueError:  # kv_shared at PP3: the last stage owns only KV-shared layers
                assert not workers[-1]
                with pytest.raises(BadInputError, match="no layer with its own KV cache"):
                    kv_capacity(read_model(cfg), budget, flags)
                continue
            tokens, conc = gemma4_oracle.base.utils.get_kv_cache_capacity(vc, config)
            cap = kv_capacity(read_model(cfg), budget, flags)
            assert (cap.num_blocks, cap.kv_cache_size_tokens, cap.max_concurrency) == (config.num_blocks, tokens, conc)
