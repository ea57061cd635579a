"""DeepSeek-V3.2-style sparse MLA: the lightning indexer's own per-layer cache.

A config with ``index_topk`` (vLLM tests ``hasattr(config, "index_topk")``) builds, next to each
MLA layer, a ``DeepseekV32IndexerCache``: an MLA-type spec of one uint8 vector per token, the
fp8 key plus one fp32 scale per 128 elements, ``index_head_dim + index_head_dim // 128 × 4``
bytes (model_executor/models/deepseek_v2.py:638-736, models/deepseek_v32/attention.py:50-120).
Every indexer and MLA layer is a FullAttentionSpec subclass, so all of them land in one KV cache
group whose block holds Σ of their pages (v1/core/kv_cache_utils.py get_kv_cache_groups).

Which layers own an indexer: IndexCache (``index_topk_freq``, ``index_skip_topk_offset``,
``index_topk_pattern``) lets a layer reuse an earlier layer's top-k and skip its own indexer;
drafter (MTP) layers always build one (models/deepseek_v32/attention.py:167-190).

The sparse MLA backends decide block size and the KV row (platforms/cuda.py backend priorities,
Hopper): the indexer backend takes only 64-token kernel blocks and the sparse MLA backends
MultipleOf(64), so the block is 64; ``fp8`` is served by FLASHMLA_SPARSE as ``fp8_ds_mla``
(656-byte rows, mla_attention.py ``_canonicalize_sparse_mla_kv_cache_dtype``); ``fp8_e4m3`` only
by FLASHINFER_MLA_SPARSE_SM90 as plain fp8 rows (1 byte × head size). Blackwell prefers FlashInfer
for fp8 and keeps plain rows — not modelled: plan Blackwell fp8 with ``--kv-cache-dtype fp8_e4m3``.
The CPU platform refuses sparse attention (platforms/cpu.py get_attn_backend_cls).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from kvops.core.errors import BadInputError
from kvops.core.kv_dtypes import KV_DTYPES, kv_dtype

INDEXER_QUANT_BLOCK: Final = 128  # elements per fp32 scale (Indexer.quant_block_size)
SPARSE_MLA_BLOCK_SIZE: Final = 64  # DeepseekV32IndexerBackend.get_supported_kernel_block_sizes


def is_sparse_mla(cfg: Mapping[str, Any]) -> bool:
    return "index_topk" in cfg


def indexer_bytes_per_token(cfg: Mapping[str, Any]) -> int:
    """uint8 row: the fp8 key and its fp32 scales, on every TP rank (not sharded)."""
    dim = cfg.get("index_head_dim")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise BadInputError(f"config field 'index_head_dim' must be a positive integer for a sparse-MLA "
                            f"(index_topk) model, got {dim!r}")
    return dim + dim // INDEXER_QUANT_BLOCK * 4


def _int_field(cfg: Mapping[str, Any], key: str, default: int) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadInputError(f"config field {key!r} must be a non-negative integer, got {value!r}")
    return value


def has_indexer(cfg: Mapping[str, Any], layer_id: int) -> bool:
    """IndexCache skip rule of DeepseekV32Attention for a backbone layer."""
    pattern = cfg.get("index_topk_pattern")
    if pattern is None:
        freq = _int_field(cfg, "index_topk_freq", 1)
        if freq < 1:
            raise BadInputError(f"config field 'index_topk_freq' must be >= 1, got {freq}")
        offset = _int_field(cfg, "index_skip_topk_offset", 2)
        return max(layer_id - offset + 1, 0) % freq == 0
    if not isinstance(pattern, str):
        raise BadInputError(f"config field 'index_topk_pattern' must be a string of F/S per layer, got {pattern!r}")
    return not (0 <= layer_id < len(pattern) and pattern[layer_id] == "S")


def sparse_mla_row_bytes(kv_cache_dtype: str, head_size: int, model_dtype_bytes: int) -> int:
    """Bytes of one token's latent row in a sparse MLA layer (Hopper backend choice): FLASHMLA_SPARSE
    serves ``fp8`` as ``fp8_ds_mla`` (kvops.core.kv_dtypes has each row's bytes)."""
    row = kv_dtype(kv_cache_dtype)
    if not row.sparse_mla:
        names = ", ".join(r.name for r in KV_DTYPES if r.sparse_mla)
        raise BadInputError(f"--kv-cache-dtype {kv_cache_dtype!r}: vLLM's sparse MLA backends (index_topk) take {names}")
    if row.name == "fp8":
        row = kv_dtype("fp8_ds_mla")
    return row.mla_row_bytes(head_size, model_dtype_bytes)
