"""What ``--kv-cache-dtype-skip-layers`` costs: the same KV memory planned with and without the
layers vLLM keeps at the model dtype.

A skipped layer stores bf16 (or the model's dtype) next to quantized ones, and vLLM grows the
quantized layers' block until one page covers a skipped layer's page, padding sliding layers to it
(platforms/interface.py ``_align_heterogeneous_kv_block_size``). So the cost is not just the skipped
layers' extra bytes: the token count below is vLLM's own, padding included (kvops.ops.capacity.allocator).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvops.core.errors import BadInputError
from kvops.ops.capacity.allocator import SizingFlags, kv_capacity
from kvops.ops.capacity.model import ModelKV, read_model


@dataclass(frozen=True)
class SkipLayerCost:
    """One rank's KV with the skip layers and without them (TurboQuant keeps its own boundary
    layers at the model dtype in both)."""

    kv_cache_dtype: str
    skip_layers: tuple[str, ...]  # as vLLM applies them: the given ones plus TurboQuant's boundary
    kv_bytes_per_token_without: int  # Σ layers, before padding
    kv_bytes_per_token_with: int
    tokens_without: int | None  # vLLM's "KV cache size" for the memory given; None: vLLM would not start
    tokens_with: int | None

    @property
    def tokens_ratio(self) -> float | None:
        """tokens with the skips / without them (below 1: what the skips cost)."""
        if not self.tokens_with or not self.tokens_without:
            return None
        return self.tokens_with / self.tokens_without


def skip_layer_cost(raw: Mapping[str, Any], kv_cache_dtype: str, skip_layers: tuple[str, ...],
                    available_bytes: int, flags: SizingFlags, tp: int = 1) -> SkipLayerCost:
    """Plan ``kv_cache_dtype`` on ``available_bytes`` of one rank's KV memory twice: with
    ``skip_layers`` (indices / ``sliding_window``, kvops.core.kv_dtypes.parse_skip_layers) and without.
    A dtype the device cannot run exits 2 as the planner does."""
    without = read_model(raw, tp=tp, kv_cache_dtype=kv_cache_dtype, device=flags.device)
    with_skips = read_model(raw, tp=tp, kv_cache_dtype=kv_cache_dtype, skip_layers=skip_layers, device=flags.device)
    return SkipLayerCost(
        kv_cache_dtype=kv_cache_dtype, skip_layers=with_skips.skip_layers,
        kv_bytes_per_token_without=without.kv_bytes_per_token, kv_bytes_per_token_with=with_skips.kv_bytes_per_token,
        tokens_without=_tokens(without, available_bytes, flags), tokens_with=_tokens(with_skips, available_bytes, flags))


def _tokens(model: ModelKV, available_bytes: int, flags: SizingFlags) -> int | None:
    try:
        return kv_capacity(model, available_bytes, flags).kv_cache_size_tokens
    except BadInputError:  # too little memory for one request, or a split vLLM cannot start with
        return None
