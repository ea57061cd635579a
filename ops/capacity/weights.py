"""The weights one rank holds, counted from config.json the way vLLM 0.32 shards and loads them.

vLLM's "Model loading took X GiB" is the parameters (and persistent buffers) of one rank: the
vocabulary padded to a multiple of 64 and split over tensor-parallel ranks
(vocab_parallel_embedding.py pad_vocab_size), query heads split, KV heads split or replicated
when there are fewer than ranks, MLP and MoE expert widths split, norms, routers and MLA's
low-rank down-projections replicated (ReplicatedLinear), the embedding on the first pipeline
stage and lm_head on the last (a tied lm_head shares the embedding only when one stage holds
both), and each rotary embedding's cos/sin cache (rotary_embedding/base.py, in the model dtype).

Elements are kept apart by what a quantization method does to them (quantization.py): linear
projections, MoE experts, embeddings, lm_head, and the rest that always keeps the model dtype.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvops.core.errors import BadInputError
from kvops.ops.capacity.allocator import pp_indices
from kvops.ops.capacity.constants import MODEL_DTYPE_BYTES
from kvops.ops.capacity.model import head_size, kv_heads_per_rank, text_config, total_kv_heads
from kvops.ops.capacity.quantization import WeightFormat

VOCAB_PADDING = 64  # vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE
# Model types whose MLP is fc1 -> activation -> fc2 (two matrices with biases), not gate/up/down.
_PLAIN_MLP = ("phi", "gpt2", "gpt_bigcode", "starcoder2", "falcon", "gpt_neox", "opt", "bloom", "mpt", "gptj")
# Per-head q/k RMSNorms (Qwen3, Gemma-3, OLMo-2 norm the whole projection instead).
_QK_NORM = ("qwen3", "qwen3_moe", "gemma3", "gemma3_text", "qwen3_next", "llama4_text")
_FOUR_NORMS = ("gemma2", "gemma3", "gemma3_text")  # pre/post attention and feed-forward norms
_TIED_BY_DEFAULT = ("gemma", "gemma2", "gemma3", "gemma3_text", "gpt2", "opt", "bloom", "gpt_bigcode")
_QKV_BIAS = ("qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl")  # qkv biased, o_proj not


@dataclass(frozen=True)
class RankParams:
    """Elements one rank holds, by how quantization treats them, and the linear output rows."""

    linear: int = 0
    linear_rows: int = 0  # output features of the quantizable linears (per-channel scales)
    experts: int = 0
    expert_rows: int = 0
    embedding: int = 0
    lm_head: int = 0
    other: int = 0  # norms, biases, routers, vision tower, rotary caches: always the model dtype
    notes: tuple[str, ...] = field(default=())
    expert_bias: int = 0  # biased experts (gpt-oss): the model dtype, unless a kernel layout recasts them
    expert_shape: tuple[int, int] = (0, 0)  # (hidden, per-rank width) of the MoE layers' experts
    tensors: tuple[tuple[str, int], ...] = field(default=())
    """(kind, elements) of each large tensor vLLM allocates (fused qkv, gate_up, an MoE layer's
    w13 and w2, embedding, lm_head): what the CUDA caching allocator rounds (alloc_rounding)."""

    @property
    def total(self) -> int:
        return self.linear + self.experts + self.expert_bias + self.embedding + self.lm_head + self.other

    def __add__(self, o: RankParams) -> RankParams:
        return RankParams(self.linear + o.linear, self.linear_rows + o.linear_rows, self.experts + o.experts,
                          self.expert_rows + o.expert_rows, self.embedding + o.embedding,
                          self.lm_head + o.lm_head, self.other + o.other, self.notes + o.notes,
                          self.expert_bias + o.expert_bias, max(self.expert_shape, o.expert_shape),
                          self.tensors + o.tensors)

    def bytes(self, dtype_bytes: int, fmt: WeightFormat | None) -> int:
        """Bytes on the device: quantized tensors at the format's size, the rest in the model dtype."""
        if fmt is None:
            return dtype_bytes * self.total
        kept = self.embedding + self.other
        hidden, width = self.expert_shape
        if fmt.expert_layout is not None and self.experts:  # experts (and their biases) as the kernel lays them out
            quantized: float = self.experts // (3 * hidden * width) * fmt.expert_layout.expert_bytes(
                hidden, width, biased=self.expert_bias > 0)
        else:
            quantized = self.experts * fmt.per_element + self.expert_rows * fmt.per_row
            kept += self.expert_bias
        if quantizes(fmt, "linear"):
            quantized += self.linear * fmt.per_element + self.linear_rows * fmt.per_row
        else:
            kept += self.linear
        if quantizes(fmt, "lm_head"):
            quantized += self.lm_head * fmt.per_element
        else:
            kept += self.lm_head
        return dtype_bytes * kept + math.ceil(quantized)

    def allocator_rounding(self, dtype_bytes: int, fmt: WeightFormat | None) -> int:
        """What the CUDA caching allocator counts beyond the large tensors' own bytes (cuda_rounding)."""
        total = 0
        for kind, elements in self.tensors:
            if kind == "experts" and fmt is not None and fmt.expert_layout is not None:
                continue  # laid out (padded) by the kernel's own rules (mxfp4.py)
            nbytes = math.ceil(elements * fmt.per_element) if fmt is not None and quantizes(fmt, kind) \
                else elements * dtype_bytes
            total += cuda_rounding(nbytes)
        return total


def quantizes(fmt: WeightFormat, kind: str) -> bool:
    """Whether a weight format stores this kind of tensor (RankParams.tensors' kinds) quantized:
    experts always, the linears unless it quantizes experts only, the LM head when it says so;
    embeddings never."""
    return kind == "experts" or (kind == "linear" and not fmt.experts_only) or (kind == "lm_head" and fmt.lm_head)


_MIB = 1 << 20
_ROUND_LARGE = 2 * _MIB  # c10/cuda/CUDACachingAllocator.cpp kRoundLarge
_MIN_LARGE_ALLOC = 10 * _MIB  # kMinLargeAlloc


def cuda_rounding(nbytes: int) -> int:
    """Bytes PyTorch's CUDA caching allocator counts as allocated beyond one tensor's ``nbytes``
    (c10/cuda/CUDACachingAllocator.cpp, default config, as vLLM runs it): a tensor of 10 MiB or
    more gets a segment rounded up to 2 MiB, and the block keeps the whole segment unless what is
    left is over 1 MiB (should_split: ``remaining > kSmallSize``). Smaller tensors are carved from
    shared segments and rounded to 512 bytes. vLLM's "Model loading took" is
    torch.cuda.max_memory_allocated, which counts those rounded blocks: 70 MiB of Qwen2.5-7B's
    tensors are 0.5 or 1 MiB short of a 2 MiB multiple; Llama-3.1-8B's are all exact."""
    if nbytes < _MIN_LARGE_ALLOC:
        return -nbytes % 512
    remaining = -nbytes % _ROUND_LARGE
    return remaining if remaining <= _MIB else -nbytes % 512


def _linear(inputs: int, outputs: int) -> RankParams:
    return RankParams(linear=inputs * outputs, linear_rows=outputs, tensors=(("linear", inputs * outputs),))


def config_count(cfg: Mapping[str, Any], key: str, default: int = 0) -> int:
    """A size or count config.json gives: absent is ``default``; not a whole number >= 0 is refused."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadInputError(f"config field {key!r} must be a whole number >= 0, got {value!r}")
    return value


def _split(size: int, tp: int, key: str) -> int:
    if size % tp:
        raise BadInputError(f"--tensor-parallel-size {tp} must divide config field {key!r} ({size})")
    return size // tp


def _attention(cfg: Mapping[str, Any], tp: int) -> RankParams:
    hidden, model_type = config_count(cfg, "hidden_size"), str(cfg.get("model_type") or "")
    if cfg.get("kv_lora_rank") is not None:
        return _mla(cfg, tp, hidden)
    heads = _split(config_count(cfg, "num_attention_heads"), tp, "num_attention_heads")
    hd = head_size(cfg, use_mla=False)
    q, kv = heads * hd, kv_heads_per_rank(total_kv_heads(cfg), tp) * hd
    params = _linear(hidden, q + 2 * kv) + _linear(q, hidden)
    bias = cfg.get("attention_bias") is True or model_type == "phi"
    other = (q + 2 * kv + hidden if bias else 0) + (q + 2 * kv if model_type in _QKV_BIAS else 0)
    other += 2 * hd if model_type in _QK_NORM else 0
    other += heads if model_type == "gpt_oss" else 0  # attention sinks, one per head
    return params + RankParams(other=other)


def _mla(cfg: Mapping[str, Any], tp: int, hidden: int) -> RankParams:
    """DeepSeek-V2/V3 attention (models/deepseek_v2.py): low-rank q and kv, a replicated down-projection."""
    heads = _split(config_count(cfg, "num_attention_heads"), tp, "num_attention_heads")
    nope, rope, v_dim = config_count(cfg, "qk_nope_head_dim"), config_count(cfg, "qk_rope_head_dim"), config_count(cfg, "v_head_dim")
    kv_rank, q_rank = config_count(cfg, "kv_lora_rank"), config_count(cfg, "q_lora_rank")
    params = _linear(hidden, kv_rank + rope) + RankParams(other=kv_rank)  # kv_a_proj_with_mqa + kv_a_layernorm
    if q_rank:
        params += _linear(hidden, q_rank) + RankParams(other=q_rank) + _linear(q_rank, heads * (nope + rope))
    else:
        params += _linear(hidden, heads * (nope + rope))
    return params + _linear(kv_rank, heads * (nope + v_dim)) + _linear(heads * v_dim, hidden)


def _dense_mlp(cfg: Mapping[str, Any], tp: int, inter: int) -> RankParams:
    hidden, width = config_count(cfg, "hidden_size"), _split(inter, tp, "intermediate_size")
    if str(cfg.get("model_type") or "") in _PLAIN_MLP:
        return _linear(hidden, width) + _linear(width, hidden) + RankParams(other=width + hidden)
    return _linear(hidden, 2 * width) + _linear(width, hidden)


def _experts(cfg: Mapping[str, Any], tp: int) -> RankParams:
    """A fused MoE layer (layers/fused_moe): w13 and w2 of every expert, widths split over TP,
    the router replicated, and any shared experts as a dense MLP."""
    hidden = config_count(cfg, "hidden_size")
    count = _num_experts(cfg)
    width = _split(config_count(cfg, "moe_intermediate_size") or config_count(cfg, "intermediate_size"), tp, "moe_intermediate_size")
    params = RankParams(experts=count * 3 * hidden * width, expert_rows=count * (2 * width + hidden),
                        tensors=(("experts", count * 2 * width * hidden), ("experts", count * width * hidden)),
                        other=hidden * count + (count if cfg.get("model_type") in ("gpt_oss", "deepseek_v3") else 0),
                        expert_shape=(hidden, width))
    if cfg.get("model_type") == "gpt_oss":  # biased experts and router
        params += RankParams(expert_bias=count * (2 * width + hidden))
    shared = config_count(cfg, "n_shared_experts") * config_count(cfg, "moe_intermediate_size")
    shared = shared or config_count(cfg, "shared_expert_intermediate_size")
    if cfg.get("model_type") == "llama4_text":  # one shared expert of the routed experts' width (models/llama4.py)
        shared = config_count(cfg, "intermediate_size")
    if shared:
        params += _dense_mlp(cfg, tp, shared)
        params += RankParams(other=hidden if cfg.get("shared_expert_intermediate_size") else 0)  # its gate
    return params


def _num_experts(cfg: Mapping[str, Any]) -> int:
    for key in ("num_local_experts", "n_routed_experts", "num_experts"):
        if config_count(cfg, key):
            return config_count(cfg, key)
    return 0


def is_moe_layer(cfg: Mapping[str, Any], index: int) -> bool:
    """Which decoder layers route to experts (each family's own rule in vLLM's model file)."""
    if not _num_experts(cfg):
        return False
    if cfg.get("first_k_dense_replace") is not None:  # DeepSeek
        return index >= config_count(cfg, "first_k_dense_replace") and index % max(1, config_count(cfg, "moe_layer_freq", 1)) == 0
    only = cfg.get("mlp_only_layers") or []
    if isinstance(only, list) and index in only:
        return False
    step = config_count(cfg, "decoder_sparse_step", 0) or config_count(cfg, "interleave_moe_layer_step", 1) or 1
    return (index + 1) % step == 0


def _layer(cfg: Mapping[str, Any], tp: int, index: int) -> RankParams:
    hidden = config_count(cfg, "hidden_size")
    norms = (4 if cfg.get("model_type") in _FOUR_NORMS else 2) * hidden
    norms *= 2 if cfg.get("model_type") in _PLAIN_MLP else 1  # LayerNorm: weight and bias
    mlp = _experts(cfg, tp) if is_moe_layer(cfg, index) else _dense_mlp(cfg, tp, config_count(cfg, "intermediate_size"))
    return _attention(cfg, tp) + mlp + RankParams(other=norms)


def _padded_vocab(cfg: Mapping[str, Any], tp: int) -> int:
    vocab = config_count(cfg, "vocab_size")
    if vocab < 1:
        raise BadInputError("config field 'vocab_size' must be a whole number >= 1")
    return -(-vocab // VOCAB_PADDING) * VOCAB_PADDING // tp


def _rotary_cache(cfg: Mapping[str, Any]) -> int:
    """cos/sin cache elements: positions × rotary dim (get_rope caches one per distinct config)."""
    if cfg.get("kv_lora_rank") is not None:
        dim = config_count(cfg, "qk_rope_head_dim")
    else:
        dim = int(head_size(cfg, use_mla=False) * float(cfg.get("partial_rotary_factor") or 1.0))
    scaling = cfg.get("rope_scaling")
    rope: dict[str, Any] = scaling if isinstance(scaling, dict) else {}
    positions = unscaled = config_count(cfg, "max_position_embeddings")
    kind, factor = str(rope.get("rope_type", rope.get("type", ""))), rope.get("factor")
    original = rope.get("original_max_position_embeddings")
    if kind in ("yarn", "deepseek_yarn") and isinstance(original, int) and isinstance(factor, int | float):
        positions = int(original * factor)
    elif kind in ("linear", "dynamic") and isinstance(factor, int | float):  # cache covers max × factor
        positions = int(positions * factor)
    local = unscaled if str(cfg.get("model_type")) in ("gemma3", "gemma3_text") else 0  # its sliding layers' rope
    return (positions + local) * dim


def _vision_tower(raw: Mapping[str, Any], tp: int) -> RankParams:
    """A ViT encoder and its projector (multimodal configs' vision_config): an estimate from its
    sizes — MHA attention, a two-matrix MLP, LayerNorms — split over TP like the text layers."""
    vision = raw.get("vision_config")
    if not isinstance(vision, dict):
        return RankParams()
    h, inter, layers = config_count(vision, "hidden_size"), config_count(vision, "intermediate_size"), config_count(vision, "num_hidden_layers")
    per_layer = 4 * h * h + 2 * h * inter + 9 * h + inter
    patch = config_count(vision, "patch_size", 14)
    embed = config_count(vision, "num_channels", 3) * patch * patch * h + (config_count(vision, "image_size") // max(1, patch)) ** 2 * h
    text_hidden = config_count(text_config(raw), "hidden_size")
    return RankParams(other=(layers * per_layer + embed + h * text_hidden + text_hidden * text_hidden) // tp,
                      notes=("vision tower estimated from vision_config",))


def _tied(cfg: Mapping[str, Any], raw: Mapping[str, Any]) -> bool:
    """tie_word_embeddings as transformers resolves it: absent means the family's config default
    (True in PretrainedConfig and the Gemma configs; False in most decoder configs that set it)."""
    for source in (cfg, raw):
        if isinstance(source.get("tie_word_embeddings"), bool):
            return bool(source["tie_word_embeddings"])
    return str(cfg.get("model_type") or "") in _TIED_BY_DEFAULT


@dataclass(frozen=True)
class StageWeights:
    """The weights of the first tensor-parallel rank of each pipeline stage."""

    per_stage_bytes: tuple[int, ...]
    total_params: int

    @property
    def max_bytes(self) -> int:
        return max(self.per_stage_bytes)


def rank_params(raw: Mapping[str, Any], tp: int = 1, pp: int = 1,
                partition: tuple[int, ...] | None = None) -> list[RankParams]:
    """Elements held by each pipeline stage's TP rank."""
    cfg = text_config(raw)
    layers = config_count(cfg, "num_hidden_layers")
    vocab, hidden = _padded_vocab(cfg, tp), config_count(cfg, "hidden_size")
    tied = _tied(cfg, raw)
    cache = RankParams(other=_rotary_cache(cfg))
    stages = []
    for rank in range(pp):
        first, last = pp_indices(layers, rank, pp, partition)
        params = cache
        for index in range(first, last):
            params += _layer(cfg, tp, index)
        if rank == 0:
            params += RankParams(embedding=vocab * hidden, tensors=(("embedding", vocab * hidden),)) + _vision_tower(raw, tp)
        if rank == pp - 1:
            final_norm = hidden * (2 if cfg.get("model_type") in _PLAIN_MLP else 1)  # LayerNorm: weight and bias
            head = 0 if tied and pp == 1 else vocab * hidden
            params += RankParams(other=final_norm, lm_head=head, tensors=(("lm_head", head),) if head else ())
        stages.append(params)
    return stages


def stage_weights(raw: Mapping[str, Any], dtype: str, fmt: WeightFormat | None, tp: int = 1, pp: int = 1,
                  partition: tuple[int, ...] | None = None, cuda: bool = False) -> StageWeights:
    """Each stage's bytes; on a CUDA device with the caching allocator's rounding (cuda_rounding),
    which vLLM's CPU backend (plain host memory) does not have."""
    dtype_bytes = int(MODEL_DTYPE_BYTES[dtype])
    stages = rank_params(raw, tp, pp, partition)
    return StageWeights(tuple(s.bytes(dtype_bytes, fmt) + (s.allocator_rounding(dtype_bytes, fmt) if cuda else 0)
                              for s in stages), rank_params(raw)[0].total)


def beyond_checkpoint(raw: Mapping[str, Any], dtype: str, fmt: WeightFormat | None, tp: int = 1, pp: int = 1,
                      partition: tuple[int, ...] | None = None, cuda: bool = False) -> tuple[int, int]:
    """What one rank's "Model loading took" holds beyond its share of the checkpoint's tensors:
    (the rotary cos/sin caches vLLM builds, in the model dtype; on a CUDA device the caching
    allocator's rounding (cuda_rounding) of the tensors vLLM builds, fused qkv and gate_up
    sharded, where the checkpoint's are unfused). The largest stage's rounding: a --model-dir
    plan splits the headers evenly."""
    dtype_bytes = int(MODEL_DTYPE_BYTES[dtype])
    rounding = max(s.allocator_rounding(dtype_bytes, fmt) for s in rank_params(raw, tp, pp, partition)) if cuda else 0
    return _rotary_cache(text_config(raw)) * dtype_bytes, rounding


def prefill_flops_per_token(raw: Mapping[str, Any]) -> float:
    """Matmul FLOPs one prompt token costs: 2 × the weights it passes through (the linears and the
    experts its router picks; a prefill computes the LM head for its last token only), the measure
    a prefill rate moves between models by (kvops.core.offload.costs). Attention's own
    4 × context × q width per layer is left out: at 2k tokens ~17% more for a 1,024-wide model,
    ~3% for Llama-3-8B."""
    cfg = text_config(raw)
    whole = rank_params(raw)[0]
    experts = _num_experts(cfg)
    active = whole.experts * config_count(cfg, "num_experts_per_tok", 1) / experts if experts else 0
    return 2.0 * (whole.linear + active)
