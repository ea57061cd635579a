"""What speculative decoding adds to each request's KV, per vLLM 0.32.

Three effects, all from ``num_speculative_tokens`` (K) and the method:

* Mamba/GDN layers keep K extra state blocks per request (``MambaSpec.num_speculative_blocks``,
  model_executor/layers/mamba/abstract.py get_kv_cache_spec), and their conv state K extra
  columns (``conv_kernel − 1 + K``, mamba_utils.py MambaStateShapeCalculator, every hybrid's
  ``get_mamba_state_shape_from_config``) — for every method.
* Sliding-window layers retain ``num_prefill_lookahead_tokens − 1`` extra tokens below the window
  (v1/core/kv_cache_utils.py get_kv_cache_configs → ``SlidingWindowSpec.extra_retained_tokens``):
  the lookahead is K for multi-module MTP (method mtp with min(MTP layers, K) > 1), 1 for the
  other EAGLE-family drafters, 0 otherwise (config/vllm.py num_prefill_lookahead_tokens).
* Drafter attention layers (``--draft-layers``) — modelled in model.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kvops.core.errors import BadInputError

EAGLE_FAMILY: Final = ("eagle", "eagle3", "mtp", "dflash", "dspark")  # SpeculativeConfig.use_eagle
METHODS: Final = (*EAGLE_FAMILY, "ngram", "ngram_gpu", "suffix", "draft_model", "medusa", "mlp_speculator")


@dataclass(frozen=True)
class Speculation:
    num_speculative_tokens: int = 0
    method: str | None = None
    mtp_layers: int = 0  # the drafter's num_nextn_predict_layers (our --draft-layers for MTP)

    @property
    def prefill_lookahead_tokens(self) -> int:
        if self.method not in EAGLE_FAMILY:
            return 0
        if self.method == "mtp" and min(self.mtp_layers, self.num_speculative_tokens) > 1:
            return self.num_speculative_tokens
        return 1

    @property
    def sliding_extra_retained_tokens(self) -> int:
        return max(0, self.prefill_lookahead_tokens - 1)


def speculation(num_speculative_tokens: int, method: str | None, draft_layers: int) -> Speculation:
    """Validate the flags; MTP model-type aliases (deepseek_mtp, qwen3_next_mtp …) mean mtp."""
    if num_speculative_tokens < 0:
        raise BadInputError(f"--num-speculative-tokens must be >= 0, got {num_speculative_tokens}")
    if method is not None and method.endswith("_mtp"):
        method = "mtp"
    if method is not None and method not in METHODS:
        raise BadInputError(f"--speculative-method {method!r}: use one of {', '.join(METHODS)}")
    if num_speculative_tokens and method is None:
        raise BadInputError("--num-speculative-tokens needs --speculative-method (as in --speculative-config)")
    if method is not None and not num_speculative_tokens:
        raise BadInputError(f"--speculative-method {method} needs --num-speculative-tokens >= 1")
    return Speculation(num_speculative_tokens, method, draft_layers if method == "mtp" else 0)
