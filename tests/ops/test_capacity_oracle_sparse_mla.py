"""DeepSeek-V3.2 sparse MLA (index_topk) against vLLM 0.32's own allocator.

vLLM cannot build a sparse-MLA model on CPU (platforms/cpu.py refuses sparse attention), so the
oracle builds each layer's spec the way the model code does on a Hopper GPU: the indexer cache
through vLLM's own ``DeepseekV32IndexerCache.get_kv_cache_spec``, the MLA latent spec with the
arguments ``MLAAttention.get_kv_cache_spec`` passes (mla_attention.py:1350-1379, incl. the
656-byte ``fp8_ds_mla`` row), each customised by its backend with vLLM's
``customize_attention_spec``; the KV dtype is canonicalised by vLLM's
``_canonicalize_sparse_mla_kv_cache_dtype`` and the block size is chosen by vLLM's
``Platform._preferred_block_size_for_backends``. The backend per dtype follows the Hopper
priority list of platforms/cuda.py (bf16: FLASH_ATTN_MLA_SPARSE, fp8: FLASHMLA_SPARSE, fp8_e4m3:
FLASHINFER_MLA_SPARSE_SM90). FLASH_ATTN_MLA_SPARSE imports CUDA extensions and cannot be
imported here; FLASHINFER_MLA_SPARSE_SM90 stands in for it: both declare MultipleOf(64) kernel
blocks and ``align_blocks_to_rows`` (flashattn_mla_sparse.py:45-50, flashinfer_mla_sparse_sm90.py:156-161).
Which layers own an indexer is stated per config below, read from DeepseekV32Attention.__init__.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_capacity_oracle import GIB, Oracle

from kvops.core.errors import BadInputError
from kvops.ops.capacity.allocator import SizingFlags, kv_capacity
from kvops.ops.capacity.indexer import has_indexer
from kvops.ops.capacity.model import read_model

Result = tuple[int, int, float] | None

# DeepSeek-V3.2-Exp shape (config.json on the hub): 61 layers, latent 512 + rope 64, indexer
# 64 heads × 128 dims, top-2048.
V32 = {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "torch_dtype": "bfloat16",
       "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
       "hidden_size": 7168, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
       "v_head_dim": 128, "q_lora_rank": 1536, "index_topk": 2048, "index_head_dim": 128,
       "index_n_heads": 64, "max_position_embeddings": 163840}
# IndexCache variants. freq 4, offset 2: a layer keeps its indexer iff max(i - 1, 0) % 4 == 0.
FREQ = {**V32, "num_hidden_layers": 12, "index_topk_freq": 4}
PATTERN = {**V32, "num_hidden_layers": 8, "index_topk_pattern": "FFSFSSF"}  # layer 7: past the end → keeps
CONFIGS: dict[str, tuple[dict[str, Any], set[int]]] = {
    "v32": (V32, set(range(61))),
    "indexcache_freq4": (FREQ, {0, 1, 5, 9}),
    "indexcache_pattern": (PATTERN, {0, 1, 3, 6, 7}),
}


class SparseOracle:
    def __init__(self, base: Oracle) -> None:
        import torch
        from vllm.config.vllm import set_current_vllm_config
        from vllm.model_executor.layers.attention.mla_attention import (
            _canonicalize_sparse_mla_kv_cache_dtype,
        )
        from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
        from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
        from vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90 import (
            FlashInferMLASparseSM90Backend,
        )
        from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
        from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
        from vllm.v1.kv_cache_interface import get_kv_quant_mode
        from vllm.v1.worker.utils import customize_attention_spec

        self.base, self.torch, self.set_config = base, torch, set_current_vllm_config
        self.canonical, self.to_dtype, self.quant_mode = (
            _canonicalize_sparse_mla_kv_cache_dtype, kv_cache_dtype_str_to_dtype, get_kv_quant_mode)
        self.IndexerCache, self.customize = DeepseekV32IndexerCache, customize_attention_spec
        self.indexer_backend = DeepseekV32IndexerBackend
        self.mla_backend = {"auto": FlashInferMLASparseSM90Backend, "bfloat16": FlashInferMLASparseSM90Backend,
                            "fp8": FlashMLASparseBackend, "fp8_ds_mla": FlashMLASparseBackend,
                            "fp8_e4m3": FlashInferMLASparseSM90Backend}

    def layer_specs(self, cfg: dict[str, Any], vc: Any, case: dict[str, Any], indexed: set[int],
                    layers: range) -> dict[str, Any]:
        backend = self.mla_backend[case["kv"]]
        kv = self.canonical(backend, case["kv"])
        vc.cache_config.cache_dtype = kv
        if case.get("block_size") is None:
            vc.cache_config.block_size = self.base.platform._preferred_block_size_for_backends(
                [backend, self.indexer_backend], 16, vc)
        bs = vc.cache_config.block_size
        index_dim = cfg["index_head_dim"] + cfg["index_head_dim"] // 128 * 4  # Indexer.__init__
        out: dict[str, Any] = {}
        for i in layers:
            out[f"model.layers.{i}.self_attn.attn"] = self.customize(backend, self.base.MLA(
                block_size=bs, num_kv_heads=1, max_tp_shards=1, head_size=vc.head,
                dtype=self.to_dtype(kv, vc.model_config), cache_dtype_str=kv,
                kv_quant_mode=self.quant_mode(kv),
                state_content_bytes={"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}.get(kv),
                is_index_group_leader=i in indexed))
            if i in indexed:
                cache = self.IndexerCache(head_dim=index_dim, dtype=self.torch.uint8,
                                          prefix=f"model.layers.{i}.self_attn.indexer.k_cache",
                                          cache_config=vc.cache_config)
                out[cache.prefix] = self.customize(self.indexer_backend, cache.get_kv_cache_spec(vc))
        return out

    def run(self, cfg: dict[str, Any], case: dict[str, Any], indexed: set[int]) -> Result:
        """PP stages own get_pp_indices' layers (+ the MTP layers on the last); one worker each."""
        from vllm.distributed.utils import get_pp_indices

        vc = self.base.vllm_config(cfg, case)
        pp, n, draft = case.get("pp", 1), cfg["num_hidden_layers"], case.get("draft", 0)
        vc.parallel_config.pipeline_parallel_size = pp
        workers = []
        with self.set_config(vc):
            for rank in range(pp):
                first, last = get_pp_indices(n, rank, pp)
                if rank == pp - 1:
                    last += draft
                mtp = set(range(n, n + draft))  # drafter (MTP) layers always build an indexer
                workers.append(self.layer_specs(cfg, vc, case, indexed | mtp, range(first, last)))
        try:
            configs = self.base.utils.get_kv_cache_configs(vc, workers, [case["budget"]] * pp)
        except ValueError:
            return None
        tokens, conc = self.base.utils.get_kv_cache_capacity(vc, configs[0])
        return configs[0].num_blocks, tokens, conc


@pytest.fixture(scope="module")
def sparse_oracle() -> SparseOracle:
    return SparseOracle(Oracle())


def ours(cfg: dict[str, Any], case: dict[str, Any]) -> Result:
    model = read_model(cfg, tp=case["tp"], kv_cache_dtype=case["kv"], draft_layers=case.get("draft", 0))
    flags = SizingFlags(max_model_len=case["mml"], block_size=case.get("block_size"),
                        max_num_batched_tokens=case["mnbt"], pipeline_parallel_size=case.get("pp", 1))
    try:
        cap = kv_capacity(model, case["budget"], flags)
    except BadInputError:
        return None
    return cap.num_blocks, cap.kv_cache_size_tokens, cap.max_concurrency


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_indexer_layers_follow_vllm_indexcache_rule(name: str) -> None:
    cfg, indexed = CONFIGS[name]
    assert {i for i in range(cfg["num_hidden_layers"]) if has_indexer(cfg, i)} == indexed
    model = read_model(cfg)
    assert {layer.index for layer in model.layers if layer.role == "indexer"} == indexed


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sparse_mla_matches_vllm(sparse_oracle: SparseOracle, name: str) -> None:
    cfg, indexed = CONFIGS[name]
    checked = 0
    for budget in (int(2.5 * GIB), 20 * GIB, 70 * GIB + 12345):
        for mml in (4096, 32_000, 163_840):
            for tp in (1, 8):
                for kv in ("auto", "fp8", "fp8_ds_mla", "fp8_e4m3"):
                    for block_size in (None, 128):
                        case = {"budget": budget, "mml": mml, "tp": tp, "kv": kv, "device": "cuda",
                                "mnbt": 2048, "block_size": block_size}
                        expected = sparse_oracle.run(cfg, case, indexed)
                        assert ours(cfg, case) == expected, f"{name} {case}: vLLM {expected}"
                        checked += expected is not None
    assert checked > 100  # most cases fit: the comparison is not all refusals


@pytest.mark.parametrize(("pp", "draft"), [(1, 1), (2, 0), (3, 1), (2, 3)])
def test_sparse_mla_pp_and_mtp_match_vllm(sparse_oracle: SparseOracle, pp: int, draft: int) -> None:
    for name in ("v32", "indexcache_freq4"):
        cfg, indexed = CONFIGS[name]
        for budget, mml in ((int(2.5 * GIB), 4096), (20 * GIB, 32_000)):
            case = {"budget": budget, "mml": mml, "tp": 1, "kv": "fp8", "device": "cuda", "mnbt": 2048,
                    "pp": pp, "draft": draft}
            expected = sparse_oracle.run(cfg, case, indexed)
            assert expected is not None
            assert ours(cfg, case) == expected, f"{name} {case}: vLLM {expected}"


def test_sparse_mla_block_is_64_and_cpu_is_refused() -> None:
    model = read_model(V32, kv_cache_dtype="fp8")
    cap = kv_capacity(model, 20 * GIB, SizingFlags(max_model_len=8192))
    # 61 layers × 64 tokens × (656-byte fp8_ds_mla row + 132-byte indexer row)
    assert (cap.block_size, cap.bytes_per_block) == (64, 61 * 64 * (656 + 132))
    assert model.kv_dtype == "fp8_ds_mla"
    assert "Blackwell" in cap.as_dict()["notes"][0]  # the GPU-generation assumption is said
    with pytest.raises(BadInputError, match="CPU platform"):
        kv_capacity(model, 20 * GIB, SizingFlags(max_model_len=8192, device="cpu"))
    with pytest.raises(BadInputError, match="multiple of 64"):
        kv_capacity(model, 20 * GIB, SizingFlags(max_model_len=8192, block_size=16))
    with pytest.raises(BadInputError, match="index_head_dim"):
        read_model({**V32, "index_head_dim": None})
    with pytest.raises(BadInputError, match="fp8_e5m2"):
        read_model(V32, kv_cache_dtype="fp8_e5m2")
