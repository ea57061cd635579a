"""Per-layer state bytes of Mamba2 and Gated-DeltaNet layers, one TP rank.

Shapes follow vLLM's MambaStateShapeCalculator (model_executor/layers/mamba/mamba_utils.py):
the conv state keeps ``kernel − 1`` columns of the conv input, the SSM state one matrix per head.
Dtypes follow MambaStateDtypeCalculator: conv = model dtype, SSM = ``mamba_ssm_cache_dtype``
(``auto`` = model dtype; configs may pin it, e.g. Qwen3.5 ``mamba_ssm_dtype: float32``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvops.core.errors import BadInputError
from kvops.ops.capacity.constants import MODEL_DTYPE_BYTES


def _get(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadInputError(f"config field {key!r} must be a positive integer for this hybrid model, got {value!r}")
    return value


def _divide(value: int, tp: int, what: str) -> int:
    if value % tp:
        raise BadInputError(f"--tensor-parallel-size {tp} must divide {what} ({value})")
    return value // tp


def _ssm_bytes(cfg: Mapping[str, Any], model_dtype: str, override: str | None) -> int:
    name = override if override not in (None, "auto") else cfg.get("mamba_ssm_dtype")
    if name in (None, "auto"):
        name = model_dtype
    if name not in MODEL_DTYPE_BYTES:
        raise BadInputError(f"mamba SSM dtype {name!r} is not one of {sorted(MODEL_DTYPE_BYTES)}")
    return int(MODEL_DTYPE_BYTES[str(name)])


def mamba_layer_bytes(
    cfg: Mapping[str, Any], kind: str, tp: int, model_dtype: str, ssm_dtype: str | None, num_spec: int = 0
) -> int:
    """Unpadded page of one mamba layer: Σ prod(shape) × dtype bytes over (conv, ssm); the conv state
    keeps ``num_spec`` more columns with speculative decoding (``conv_kernel − 1 + num_spec``)."""
    conv_bytes = int(MODEL_DTYPE_BYTES[model_dtype])
    ssm_bytes = _ssm_bytes(cfg, model_dtype, ssm_dtype)
    if kind == "gdn":
        k_heads, v_heads = _get(cfg, "linear_num_key_heads"), _get(cfg, "linear_num_value_heads")
        k_dim, v_dim = _get(cfg, "linear_key_head_dim"), _get(cfg, "linear_value_head_dim")
        kernel = _get(cfg, "linear_conv_kernel_dim")
        conv_dim = _divide(k_dim * k_heads * 2 + v_dim * v_heads, tp, "the GDN conv dim")
        conv = conv_dim * (kernel - 1 + num_spec)
        ssm = _divide(v_heads, tp, "linear_num_value_heads") * v_dim * k_dim
        return conv * conv_bytes + ssm * ssm_bytes
    heads, head_dim = _get(cfg, "mamba_num_heads"), _get(cfg, "mamba_head_dim")
    groups, state = _get(cfg, "n_groups"), _get(cfg, "ssm_state_size")
    kernel = _get(cfg, "conv_kernel")
    if groups % tp:  # groups are replicated so every head shard has its group
        groups += tp - groups
    conv_dim = _divide(heads * head_dim + 2 * groups * state, tp, "the Mamba2 conv dim")
    conv = conv_dim * (kernel - 1 + num_spec)
    ssm = _divide(heads, tp, "mamba_num_heads") * head_dim * state
    return conv * conv_bytes + ssm * ssm_bytes
