"""Gemma-4: per-layer head dims and KV heads (global vs sliding layers).

vLLM 0.32 builds each Gemma-4 layer from ``config.per_layer_config[i]`` (model_executor/models/
gemma4.py Gemma4DecoderLayer): transformers' Gemma4TextConfig gives full-attention layers
``head_dim = global_head_dim`` (default 512) and, when ``attention_k_eq_v``, ``num_key_value_heads
= num_global_key_value_heads``; sliding layers keep ``head_dim``/``num_key_value_heads``
(transformers/models/gemma4/configuration_gemma4.py __post_init__). A saved config may instead
carry ``per_layer_config`` itself ({layer: {head_dim, num_key_value_heads}}). The same post-init
defaults ``layer_types`` to 5 sliding : 1 full, forces the last layer to full attention, and
halves the window for ``use_bidirectional_attention: "all"``. Each layer's KV heads are split
over TP on their own (Gemma4Attention: ``max(1, kv_heads // tp)``).

Block size: vLLM picks it from the FlashAttention version on the GPU (model_executor/models/
config.py Gemma4Config, v1/attention/backends/flash_attn.py): 16 on Hopper with bf16 KV, 64 on
Hopper with fp8 KV (FA4 head-512 tile), 128 on Blackwell (FA4 head-256 kernel). The planner's
CUDA default is the Hopper bf16 one; pass ``--block-size`` as the server logs it otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from kvops.core.errors import BadInputError
from kvops.ops.capacity.constants import MAX_LAYERS

GEMMA4_MODEL_TYPES: Final = ("gemma4", "gemma4_text")
# Gemma4TextConfig defaults for the fields sizing reads (configuration_gemma4.py).
_DEFAULTS: Final = {"head_dim": 256, "num_key_value_heads": 4, "sliding_window": 512,
                    "global_head_dim": 512, "num_hidden_layers": 30}
_PER_LAYER_KEYS: Final = ("head_dim", "num_key_value_heads")


def is_gemma4(cfg: Mapping[str, Any]) -> bool:
    return cfg.get("model_type") in GEMMA4_MODEL_TYPES


def _field(cfg: Mapping[str, Any], key: str, where: str = "") -> int:
    value = cfg.get(key, _DEFAULTS.get(key))
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadInputError(f"config field {where + key!r} must be a positive integer (Gemma-4), got {value!r}")
    return value


def layer_types(cfg: Mapping[str, Any]) -> list[str]:
    n = _field(cfg, "num_hidden_layers")
    if n > MAX_LAYERS:
        raise BadInputError(f"config field 'num_hidden_layers' {n} is beyond any real model "
                            f"(at most {MAX_LAYERS}): check the config")
    types = cfg.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        raise BadInputError(f"config field 'layer_types' must be a list of {n} strings (Gemma-4)")
    bad = sorted({t for t in types if t not in ("sliding_attention", "full_attention")})
    if bad:
        raise BadInputError(f"config field 'layer_types' has unsupported Gemma-4 layer types {bad}")
    return [*types[:-1], "full_attention"]  # transformers forces the last layer global


def window(cfg: Mapping[str, Any]) -> int:
    value = _field(cfg, "sliding_window")
    return value // 2 + 1 if cfg.get("use_bidirectional_attention") == "all" else value


def _per_layer_overrides(cfg: Mapping[str, Any], types: list[str]) -> dict[int, dict[str, int]]:
    given = cfg.get("per_layer_config")
    if given is None:
        override = {"head_dim": _field(cfg, "global_head_dim")}
        if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads") is not None:
            override["num_key_value_heads"] = _field(cfg, "num_global_key_value_heads")
        return {i: override for i, kind in enumerate(types) if kind == "full_attention"}
    if not isinstance(given, dict):
        raise BadInputError("config field 'per_layer_config' must map layer index to {head_dim, num_key_value_heads}")
    out: dict[int, dict[str, int]] = {}
    for key, fields in given.items():
        if not str(key).isdigit() or not isinstance(fields, dict) or set(fields) - set(_PER_LAYER_KEYS):
            raise BadInputError(f"config field 'per_layer_config' entry {key!r}: use a layer index mapping to "
                                f"{' and/or '.join(_PER_LAYER_KEYS)} (the fields the planner reads per layer)")
        out[int(key)] = {k: _field(fields, k, f"per_layer_config[{key}].") for k in fields}
    return out


def layer_shapes(cfg: Mapping[str, Any]) -> list[tuple[int, int]]:
    """(head_dim, total KV heads) of every decoder layer, as vLLM's Gemma-4 layers get them."""
    types = layer_types(cfg)
    overrides = _per_layer_overrides(cfg, types)
    base = {"head_dim": _field(cfg, "head_dim"), "num_key_value_heads": _field(cfg, "num_key_value_heads")}
    shapes = []
    for i in range(len(types)):
        fields = {**base, **overrides.get(i, {})}
        shapes.append((fields["head_dim"], fields["num_key_value_heads"]))
    return shapes
