"""config.json → the per-layer KV specs vLLM 0.32 builds for one TP rank.

vLLM decides each layer's cache from the HF config (after transformers' normalisation) and the
cache/parallel flags; this module reproduces those rules from the raw JSON so that a planner
without vLLM sees the same layers. Anything it does not recognise is an error naming the field:
a silent guess would print a confident, wrong capacity.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

from kvops.core import kinds
from kvops.core.errors import BadInputError
from kvops.core.kv_dtypes import SKIP_SLIDING_WINDOW, KvDtype, check_runs_on, kv_dtype
from kvops.ops.capacity import gemma4
from kvops.ops.capacity.config_fields import check_config
from kvops.ops.capacity.constants import MAX_LAYERS, MODEL_DTYPE_BYTES
from kvops.ops.capacity.gemma4 import is_gemma4
from kvops.ops.capacity.indexer import (
    has_indexer,
    indexer_bytes_per_token,
    is_sparse_mla,
    sparse_mla_row_bytes,
)
from kvops.ops.capacity.layers import layer_kinds
from kvops.ops.capacity.speculative import speculation

LayerKind = Literal["full", "sliding", "chunked", "mla", "mamba"]
_KV_HEAD_KEYS = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num",
                 "num_attention_groups")


@dataclass(frozen=True)
class LayerKV:
    """One layer's cache on one rank; attention pages are ``block_size × bytes_per_token``."""

    index: int
    kind: LayerKind
    bytes_per_token: int = 0  # attention: kv_heads × (head + head_v) × dtype bytes
    window: int | None = None  # sliding window or attention chunk, tokens
    state_bytes: int = 0  # mamba: Σ conv/ssm state bytes (one page before padding)
    checkpoint_blocks: int = 0  # Mamba2 keeps one prefill checkpoint block in align mode
    role: str = "kv"  # "indexer": a sparse-MLA layer's lightning-indexer cache (indexer.py)
    speculative_blocks: int = 0  # mamba: K state blocks per request for K speculative tokens
    extra_retained_tokens: int = 0  # sliding: tokens kept below the window for multi-module MTP
    kv_dtype: str = ""  # this layer's --kv-cache-dtype ("auto" where --kv-cache-dtype-skip-layers keeps it)
    backend: str = ""  # the attention backend that serves it (kernel block sizes, packing)


@dataclass(frozen=True)
class ModelKV:
    """Everything sizing needs from the model, per rank."""

    architecture: str
    model_dtype: str
    kv_dtype: str
    layers: tuple[LayerKV, ...]
    num_kv_heads_per_rank: int
    head_size: int
    use_mla: bool
    attn_bytes_per_token_1: int  # model-level attention bytes for one token (hybrid alignment)
    max_position_embeddings: int | None
    num_decoder_layers: int = 0  # what pipeline parallelism splits (distributed/utils.py get_pp_indices)
    draft_layers: int = 0  # drafter (MTP/EAGLE) attention layers after the target's, on the last PP stage
    sparse_mla: bool = False  # DeepSeek-V3.2 index_topk: 64-token blocks, CUDA only (indexer.py)
    num_speculative_tokens: int = 0
    per_layer_head_dims: bool = False  # Gemma-4: its CUDA block size follows the GPU's FlashAttention kernels
    skip_layers: tuple[str, ...] = ()  # vLLM's kv_cache_dtype_skip_layers: the user's plus TurboQuant's boundary
    skip_pages_1: tuple[int, int] | None = None  # (primary, skip) per-token pages as the block alignment sees them

    @property
    def is_hybrid(self) -> bool:
        return any(layer.kind == "mamba" for layer in self.layers)

    @property
    def kv_bytes_per_token(self) -> int:
        """Σ over attention layers: the textbook per-token bytes on this rank."""
        return sum(layer.bytes_per_token for layer in self.layers)


def load_config(path: Path) -> dict[str, Any]:
    """Read config.json (or a model directory holding one); malformed input exits 2."""
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise BadInputError(f"{file}: no such file; pass a config.json or a model directory")
    raw = kinds.read_mapping_of_kind(file, "--model", kinds.MODEL_CONFIG)
    check_config(raw, f"--model {file}")
    return raw


def text_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Multimodal configs nest the language model under text_config (vLLM's hf_text_config)."""
    inner = raw.get("text_config")
    if isinstance(inner, dict):
        merged = dict(inner)
        for key in ("torch_dtype", "dtype", "architectures", "quantization_config"):
            merged.setdefault(key, raw.get(key))
    else:
        merged = dict(raw)
    return {**_FAMILY_DEFAULTS.get(str(merged.get("model_type")), {}), **merged}


# Fields a published config.json leaves to its transformers config class's defaults (Gemma-3's
# text_config names only what differs from Gemma3TextConfig, transformers configuration_gemma3.py).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {"vocab_size": 262_208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "max_position_embeddings": 131_072, "tie_word_embeddings": True},
}


def _int(cfg: Mapping[str, Any], key: str, *, minimum: int = 1) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadInputError(f"config field {key!r} must be an integer, got {value!r}")
    if value < minimum:
        raise BadInputError(f"config field {key!r} must be >= {minimum}, got {value}")
    return value


def model_dtype(cfg: Mapping[str, Any], override: str | None = None) -> str:
    """vLLM's ``--dtype auto``: the checkpoint dtype, float32 checkpoints served in bfloat16."""
    name = override if override not in (None, "auto") else cfg.get("torch_dtype") or cfg.get("dtype")
    if name is None:
        return "bfloat16"  # no dtype in config (gpt-oss): vLLM serves bf16
    if not isinstance(name, str) or name not in MODEL_DTYPE_BYTES:
        where = "--dtype" if override not in (None, "auto") else "config field 'torch_dtype'"
        raise BadInputError(f"{where} {name!r} is not one of {sorted(MODEL_DTYPE_BYTES)}")
    return "bfloat16" if name in ("float32", "float") and override in (None, "auto") else name


def total_kv_heads(cfg: Mapping[str, Any]) -> int:
    for key in _KV_HEAD_KEYS:
        if cfg.get(key) is not None:
            return _int(cfg, key)
    return _int(cfg, "num_attention_heads")


def kv_heads_per_rank(total: int, tp: int) -> int:
    """KV heads are split over TP; with fewer heads than ranks each rank keeps one replica."""
    if total >= tp:
        if total % tp:
            raise BadInputError(f"--tensor-parallel-size {tp} must divide num_key_value_heads {total}")
        return total // tp
    if tp % total:
        raise BadInputError(f"--tensor-parallel-size {tp} must be a multiple of num_key_value_heads {total}")
    return 1


def head_size(cfg: Mapping[str, Any], use_mla: bool) -> int:
    """transformers_utils/model_arch_config_convertor.py get_head_size."""
    if use_mla:
        return _int(cfg, "kv_lora_rank") + _int(cfg, "qk_rope_head_dim")
    if cfg.get("head_dim"):
        return _int(cfg, "head_dim")
    if cfg.get("hidden_size_per_head"):
        return _int(cfg, "hidden_size_per_head")
    return _int(cfg, "hidden_size") // _int(cfg, "num_attention_heads")


# vllm/transformers_utils/model_arch_config_convertor.py: the keys vLLM derives max_model_len from
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                 "max_sequence_length", "max_seq_length", "seq_len")
# vllm/config/model.py _get_and_verify_max_len: rope types whose factor is not applied again
_UNSCALED_ROPE = {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}


def context_limit(cfg: Mapping[str, Any]) -> int | None:
    """The longest max_model_len vLLM 0.32 accepts for this config (without
    VLLM_ALLOW_LONG_MAX_MODEL_LEN): the smallest length key, times a RoPE factor vLLM applies.
    None when the config names no length (vLLM then takes what it is given)."""
    found = [v for k in _MAX_LEN_KEYS if isinstance(v := cfg.get(k), int | float) and not isinstance(v, bool)]
    if not found:
        return None
    limit = float(min(found))
    factor = 1.0
    for key, rope in _rope_parameters(cfg):
        kind = rope.get("rope_type", rope.get("type", "default"))
        if not isinstance(kind, str):
            raise BadInputError(f"config field {key!r}: rope_type must be a string such as 'yarn' "
                                f"or 'llama3', got {kind!r}; fix the model's config.json")
        if kind not in _UNSCALED_ROPE and isinstance(rope.get("factor"), int | float):
            factor = float(rope["factor"])
    return int(limit * factor) if limit * factor >= 1 else None


def _rope_parameters(cfg: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(config field, parameters) of rope_scaling / rope_parameters, flat or per layer type
    (transformers 5)."""
    out = []
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.get(key)
        if isinstance(value, dict):
            nested = [v for v in value.values() if isinstance(v, dict)]
            out += [(key, v) for v in (nested if nested else [value])]
    return out


def read_model(
    raw: Mapping[str, Any],
    *,
    tp: int = 1,
    kv_cache_dtype: str = "auto",
    dtype: str | None = None,
    mamba_ssm_dtype: str | None = None,
    draft_layers: int = 0,
    num_speculative_tokens: int = 0,
    speculative_method: str | None = None,
    skip_layers: tuple[str, ...] = (),
    device: str | None = None,
) -> ModelKV:
    """Per-rank layer specs exactly as vLLM 0.32 builds them for this config and these flags.

    ``draft_layers`` adds the drafter's attention layers (MTP: ``num_nextn_predict_layers``;
    EAGLE: usually 1), each with the target's full-attention (or MLA) spec: vLLM registers them
    after the target's layers and groups them with the rest (v1/core/kv_cache_utils.py:2029-2119).
    ``num_speculative_tokens``/``speculative_method`` size mamba and sliding layers (speculative.py).
    ``skip_layers`` is --kv-cache-dtype-skip-layers (layer indices, ``sliding_window``): those
    layers keep the model dtype (model_executor/layers/attention/attention.py:299-315). ``device``
    refuses a dtype that device's backends do not take (kvops.core.kv_dtypes).
    """
    spec = speculation(num_speculative_tokens, speculative_method, draft_layers)
    if tp < 1:
        raise BadInputError(f"--tensor-parallel-size must be >= 1, got {tp}")
    cfg = text_config(raw)
    heads_q = cfg.get("num_attention_heads")
    if isinstance(heads_q, int) and heads_q > 0 and heads_q % tp:  # vLLM: verify_with_parallel_config
        raise BadInputError(f"--tensor-parallel-size {tp} must divide num_attention_heads {heads_q} "
                            "(vLLM refuses to start otherwise)")
    archs = cfg.get("architectures") or [cfg.get("model_type") or "?"]
    arch = str(archs[0])
    mdtype = model_dtype(cfg, dtype)
    use_mla = cfg.get("kv_lora_rank") is not None
    sparse = is_sparse_mla(cfg)
    row = kv_dtype(kv_cache_dtype)
    if sparse and not use_mla:
        raise BadInputError("config field 'index_topk' (sparse MLA indexer) needs an MLA model: "
                            "'kv_lora_rank' is missing")
    mbytes = int(MODEL_DTYPE_BYTES[mdtype])
    hsize = head_size(cfg, use_mla)
    heads = 1 if use_mla else kv_heads_per_rank(total_kv_heads(cfg), tp)
    if sparse:
        per_token = sparse_mla_row_bytes(kv_cache_dtype, hsize, mbytes)
    elif use_mla:
        per_token = row.mla_row_bytes(hsize, mbytes)
    else:
        per_token = heads * row.head_bytes_per_token(hsize, mbytes)
    index_bytes = indexer_bytes_per_token(cfg) if sparse else 0
    kinds = layer_kinds(cfg)
    skip = _effective_skip_layers(skip_layers, row, kinds)
    if any(kind not in (None, "mamba2", "gdn") and not _skipped(i, kind, skip) for i, (kind, _) in enumerate(kinds)):
        # a dtype no attention layer uses (every one skipped) is never handed to a backend
        if row.mla_only and not use_mla:
            raise BadInputError(f"--kv-cache-dtype {kv_cache_dtype} is only for MLA models (kv_lora_rank)")
        if device is not None:
            check_runs_on(kv_cache_dtype, device, use_mla)
    if skip and use_mla:
        raise BadInputError("--kv-cache-dtype-skip-layers on an MLA model is not planned yet (vLLM sizes MLA "
                            "skip layers by the MLA backends' kernel blocks); plan it without skip layers")
    shapes = gemma4.layer_shapes(cfg) if is_gemma4(cfg) else None
    inputs = _LayerInputs(row, skip, tp, mdtype, mamba_ssm_dtype, spec.num_speculative_tokens,
                          spec.sliding_extra_retained_tokens, device, hsize, heads, per_token, index_bytes, sparse,
                          use_mla, shapes)
    layers = _layers(cfg, kinds, inputs)
    if not layers:
        raise BadInputError(f"{arch}: no layer with a KV cache found; check num_hidden_layers")
    if shapes is not None:  # model-level figures: the first layer's (hybrid alignment needs none here)
        hsize, heads = shapes[0][0], kv_heads_per_rank(shapes[0][1], tp)
        per_token = layers[0].bytes_per_token
    layers += _draft_layers(layers, draft_layers, len(kinds), index_bytes)
    auto = kv_dtype("auto")
    first = next((layer for layer in layers if layer.kind != "mamba"), None)
    # the first attention layer's backend sizes the primary for the block alignment; only the dtype's
    # own CUDA backend packs it (CPU_ATTN packs nothing: every dtype it runs is dense)
    first_packs = device != "cpu" and (first is None or first.kv_dtype == _spec_dtype(row, mdtype)
                                       or layer_backend(auto, device) == row.cuda_backend)
    primary_1 = per_token if use_mla or first_packs else heads * row.unpacked_head_bytes_per_token(hsize, mbytes)
    skip_1 = heads * auto.unpacked_head_bytes_per_token(hsize, mbytes)
    return ModelKV(
        architecture=arch, model_dtype=mdtype,
        kv_dtype=_kv_dtype_name(kv_cache_dtype, mdtype, sparse),
        layers=tuple(layers), num_kv_heads_per_rank=heads, head_size=hsize, use_mla=use_mla,
        attn_bytes_per_token_1=_hybrid_page_1(row, per_token, primary_1, skip_1 if skip else None),
        max_position_embeddings=context_limit(cfg),
        num_decoder_layers=len(kinds), draft_layers=draft_layers, sparse_mla=sparse,
        num_speculative_tokens=spec.num_speculative_tokens, per_layer_head_dims=shapes is not None,
        skip_layers=skip, skip_pages_1=(primary_1, skip_1) if skip else None,
    )


@dataclass(frozen=True)
class _LayerInputs:
    """What every layer's spec is built from (read_model's locals, passed as one value)."""

    row: KvDtype
    skip: tuple[str, ...]
    tp: int
    mdtype: str
    mamba_ssm_dtype: str | None
    num_speculative_tokens: int
    sliding_extra: int  # speculative.py: tokens a sliding layer keeps below its window
    device: str | None
    hsize: int
    heads: int
    per_token: int  # MLA row, or the model-level per-token bytes of a quantized layer
    index_bytes: int
    sparse: bool
    use_mla: bool
    shapes: list[tuple[int, int]] | None  # Gemma-4: (head_dim, KV heads) per layer


def _layers(cfg: Mapping[str, Any], kinds: list[tuple[str | None, int | None]], inp: _LayerInputs) -> list[LayerKV]:
    from kvops.ops.capacity.mamba import mamba_layer_bytes

    auto, mbytes, k = kv_dtype("auto"), int(MODEL_DTYPE_BYTES[inp.mdtype]), inp.num_speculative_tokens
    layers: list[LayerKV] = []
    for index, (kind, window) in enumerate(kinds):
        if kind is None:
            continue
        if kind in ("mamba2", "gdn"):
            state = mamba_layer_bytes(cfg, kind, inp.tp, inp.mdtype, inp.mamba_ssm_dtype, k)
            layers.append(LayerKV(index, "mamba", state_bytes=state, checkpoint_blocks=1 if kind == "mamba2" else 0,
                                  speculative_blocks=k))
        elif inp.use_mla:
            layers.append(LayerKV(index, "mla", bytes_per_token=inp.per_token,
                                  kv_dtype=_spec_dtype(inp.row, inp.mdtype)))
            if inp.sparse and has_indexer(cfg, index):
                layers.append(LayerKV(index, "mla", bytes_per_token=inp.index_bytes, role="indexer"))
        else:
            row = auto if _skipped(index, kind, inp.skip) else inp.row
            head_dim, heads = (inp.hsize, inp.heads) if inp.shapes is None else (
                inp.shapes[index][0], kv_heads_per_rank(inp.shapes[index][1], inp.tp))
            extra = inp.sliding_extra if kind == "sliding" else 0
            layers.append(LayerKV(index, cast(LayerKind, kind), bytes_per_token=heads * row.head_bytes_per_token(
                head_dim, mbytes), window=window, extra_retained_tokens=extra, kv_dtype=_spec_dtype(row, inp.mdtype),
                backend=layer_backend(row, inp.device)))
    return layers


def _spec_dtype(row: KvDtype, mdtype: str) -> str:
    """What tells two layers' specs apart in vLLM: the storage, not the spelling (auto = the model
    dtype, fp8 = fp8_e4m3)."""
    return mdtype if row.name == "auto" else row.alias_of or row.name


def layer_backend(row: KvDtype, device: str | None) -> str:
    """The attention backend vLLM gives a layer of this dtype (Hopper's order on CUDA)."""
    return "CPU_ATTN" if device == "cpu" else row.cuda_backend or ""


def _skipped(index: int, kind: str, skip: tuple[str, ...]) -> bool:
    """attention.py:299-315: a listed layer index, or any sliding layer with ``sliding_window``."""
    return str(index) in skip or (kind == "sliding" and SKIP_SLIDING_WINDOW in skip)


def _effective_skip_layers(given: tuple[str, ...], row: KvDtype, kinds: list[tuple[str | None, int | None]]
                           ) -> tuple[str, ...]:
    """The user's skip layers plus the boundary layers TurboQuant/UltraQuant keep at the model dtype on a
    dense model (engine/arg_utils.py, turboquant/config.py get_boundary_skip_layers), sorted as vLLM does."""
    hybrid = any(kind in ("mamba2", "gdn") for kind, _ in kinds)
    boundary: list[str] = []
    if row.boundary_skip_layers and not hybrid:
        n = min(row.boundary_skip_layers, len(kinds) // 2)
        boundary = [str(i) for i in sorted(set(range(n)) | set(range(len(kinds) - n, len(kinds))))]
    if not boundary:
        return tuple(given)
    return tuple(sorted(set(given) | set(boundary)))


def _hybrid_page_1(row: KvDtype, per_token: int, primary_1: int, skip_1: int | None) -> int:
    """One token's attention page as platforms/interface.py ``_align_hybrid_block_size`` sees it: the
    packed TurboQuant/UltraQuant page (lcm with the skip layers' page when there are any), else what
    the first attention layer's backend makes of the dtype."""
    if row.boundary_skip_layers:
        return math.lcm(per_token, skip_1) if skip_1 is not None else per_token
    return primary_1


def _kv_dtype_name(kv_cache_dtype: str, mdtype: str, sparse: bool) -> str:
    if kv_cache_dtype == "auto":
        return mdtype
    return "fp8_ds_mla" if sparse and kv_cache_dtype == "fp8" else kv_cache_dtype  # FLASHMLA_SPARSE


def _draft_layers(layers: list[LayerKV], count: int, first_index: int, index_bytes: int = 0) -> list[LayerKV]:
    """Copies of the target's full-attention/MLA layer for the drafter, numbered after it; sparse-MLA
    drafter (MTP) layers always build their own indexer (models/deepseek_v32/attention.py:185)."""
    if count < 0:
        raise BadInputError(f"--draft-layers must be >= 0, got {count}")
    if count > MAX_LAYERS:
        raise BadInputError(f"--draft-layers {count} is beyond any drafter (at most {MAX_LAYERS})")
    if not count:
        return []
    if any(layer.kind == "mamba" and not layer.speculative_blocks for layer in layers):
        # Mamba specs keep num_speculative_blocks per request and wider conv states (speculative.py).
        raise BadInputError("--draft-layers on a mamba/GDN hybrid needs --num-speculative-tokens and "
                            "--speculative-method: the mamba state grows with them")
    base = next((layer for layer in layers if layer.kind in ("full", "mla") and layer.role == "kv"), None)
    if base is None:
        raise BadInputError("--draft-layers needs a full-attention layer to copy; this model has none")
    out = []
    for i in range(count):
        out.append(LayerKV(first_index + i, base.kind, bytes_per_token=base.bytes_per_token, kv_dtype=base.kv_dtype,
                           backend=base.backend))
        if index_bytes:
            out.append(LayerKV(first_index + i, "mla", bytes_per_token=index_bytes, role="indexer"))
    return out
