"""Which cache each decoder layer gets: full, sliding, chunked-local, Mamba2, GDN, or none.

vLLM reads the HF config after transformers has normalised older keys into ``layer_types``
(Gemma-3 ``sliding_window_pattern``, Qwen2 ``use_sliding_window``/``max_window_layers``,
Qwen3-Next ``full_attention_interval``); we apply the same normalisation to raw JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvops.core.errors import BadInputError
from kvops.ops.capacity import gemma4
from kvops.ops.capacity.constants import MAX_LAYERS
from kvops.ops.capacity.gemma4 import is_gemma4

LayerChoice = tuple[str | None, int | None]  # (kind, window or chunk tokens)

# Config keys of architectures whose cache we do not model yet: refusing beats guessing.
_UNSUPPORTED_KEYS = {
    "attn_type_list": "MiniMax linear attention",
    "layers_block_type": "Jamba/Granite-style layers_block_type",
    "kv_sharing_layer_map": "custom cross-layer KV sharing",
}
_GDN_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")
_QWEN_SW_TYPES = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def _window(cfg: Mapping[str, Any]) -> int | None:
    """``sliding_window: 0`` means none (config/model.py); Qwen gates it on use_sliding_window."""
    value = cfg.get("sliding_window")
    if value in (None, 0) or cfg.get("use_sliding_window") is False:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadInputError(f"config field 'sliding_window' must be a positive integer, got {value!r}")
    return value


def _num_layers(cfg: Mapping[str, Any]) -> int:
    value = cfg.get("num_hidden_layers")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadInputError(f"config field 'num_hidden_layers' must be a positive integer, got {value!r}")
    if value > MAX_LAYERS:
        raise BadInputError(f"config field 'num_hidden_layers' {value} is beyond any real model "
                            f"(at most {MAX_LAYERS}): check the config")
    return value


def _from_pattern(pattern: object) -> list[LayerChoice]:
    """Nemotron-H ``hybrid_override_pattern``: M = Mamba2, * = attention, - = MLP, E = MoE."""
    if not isinstance(pattern, str) or not pattern:
        raise BadInputError("config field 'hybrid_override_pattern' must be a non-empty string")
    table: dict[str, LayerChoice] = {"M": ("mamba2", None), "*": ("full", None),
                                     "-": (None, None), "E": (None, None)}
    bad = sorted(set(pattern) - set(table))
    if bad:
        raise BadInputError(f"config field 'hybrid_override_pattern' has unknown layer codes {bad}")
    return [table[c] for c in pattern]


def _from_layer_types(cfg: Mapping[str, Any], types: object, n: int) -> list[LayerChoice]:
    if not isinstance(types, list) or len(types) != n:
        raise BadInputError(f"config field 'layer_types' must be a list of {n} strings")
    window = _window({**cfg, "use_sliding_window": None})
    chunk = cfg.get("attention_chunk_size")
    out: list[LayerChoice] = []
    for kind in types:
        if kind in ("full_attention", "attention"):
            out.append(("full", None))
        elif kind == "sliding_attention":
            if window is None:
                raise BadInputError("config has 'sliding_attention' layers but no 'sliding_window'")
            out.append(("sliding", window))
        elif kind == "chunked_attention" and isinstance(chunk, int) and chunk > 0:
            out.append(("chunked", chunk))
        elif kind == "linear_attention" and cfg.get("model_type") in _GDN_MODEL_TYPES:
            out.append(("gdn", None))
        elif kind == "mamba":
            out.append(("mamba2", None))
        else:
            raise BadInputError(f"config field 'layer_types' has unsupported layer type {kind!r}")
    return out


def _derived_types(cfg: Mapping[str, Any], n: int) -> list[LayerChoice]:
    """The older keys transformers turns into layer_types."""
    model_type = cfg.get("model_type")
    interval = cfg.get("full_attention_interval")
    if model_type in _GDN_MODEL_TYPES and isinstance(interval, int) and interval > 0:
        return [("full", None) if (i + 1) % interval == 0 else ("gdn", None) for i in range(n)]
    chunk = cfg.get("attention_chunk_size")
    if isinstance(chunk, int) and chunk > 0:
        no_rope = cfg.get("no_rope_layers")
        if isinstance(no_rope, list) and len(no_rope) == n:  # Llama-4: NoPE layers stay global
            return [("chunked", chunk) if flag else ("full", None) for flag in no_rope]
        return [("chunked", chunk)] * n
    window = _window(cfg)
    if window is None:
        return [("full", None)] * n
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 1:  # Gemma-3: global iff (i + 1) % pattern == 0
        return [("full", None) if (i + 1) % pattern == 0 else ("sliding", window) for i in range(n)]
    if model_type == "gemma2":  # transformers Gemma2Config: even layers slide
        return [("sliding", window) if (i + 1) % 2 else ("full", None) for i in range(n)]
    first_sw = cfg.get("max_window_layers")
    if model_type in _QWEN_SW_TYPES and isinstance(first_sw, int):
        return [("sliding", window) if i >= first_sw else ("full", None) for i in range(n)]
    return [("sliding", window)] * n  # Mistral-7B-v0.1: the window applies to every layer


def layer_kinds(cfg: Mapping[str, Any]) -> list[LayerChoice]:
    """One (kind, window) per decoder layer; kind None = no cache (MLP/MoE or KV-shared)."""
    for key, what in _UNSUPPORTED_KEYS.items():
        if cfg.get(key) is not None:
            raise BadInputError(f"config field {key!r} ({what}) is not supported by the planner yet")
    if is_gemma4(cfg):
        kinds: list[LayerChoice] = [("sliding", gemma4.window(cfg)) if kind == "sliding_attention" else ("full", None)
                                    for kind in gemma4.layer_types(cfg)]
    else:
        _refuse_per_layer_dims(cfg)
        kinds = _standard_kinds(cfg)
    return _drop_shared(cfg, kinds)


def _refuse_per_layer_dims(cfg: Mapping[str, Any]) -> None:
    """Only vLLM's Gemma-4 model reads per-layer head dims; elsewhere they would be ignored."""
    for key in ("global_head_dim", "per_layer_config"):
        if cfg.get(key) is not None:
            raise BadInputError(
                f"config field {key!r} (per-layer head dims) is read by vLLM 0.32 only for Gemma-4 "
                f"(model_type gemma4/gemma4_text), not model_type {cfg.get('model_type')!r}; "
                "the planner cannot tell which head dims this model's vLLM class uses")


def _standard_kinds(cfg: Mapping[str, Any]) -> list[LayerChoice]:
    if "hybrid_override_pattern" in cfg:
        kinds = _from_pattern(cfg["hybrid_override_pattern"])
    else:
        n = _num_layers(cfg)
        if cfg.get("layer_types") is not None:
            kinds = _from_layer_types(cfg, cfg["layer_types"], n)
        else:
            kinds = _derived_types(cfg, n)
    return kinds


def _drop_shared(cfg: Mapping[str, Any], kinds: list[LayerChoice]) -> list[LayerChoice]:
    shared = cfg.get("num_kv_shared_layers") or 0
    if not isinstance(shared, int) or shared < 0 or shared >= len(kinds):
        raise BadInputError(f"config field 'num_kv_shared_layers' must be in [0, layers), got {shared!r}")
    if shared:  # Gemma-3n: the last N layers read an earlier layer's KV and own no cache
        kinds = kinds[: len(kinds) - shared] + [(None, None)] * shared
    return kinds
