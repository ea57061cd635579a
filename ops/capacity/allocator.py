"""vLLM 0.32's KV allocator arithmetic, reproduced without vLLM.

The steps and their sources (``vllm/`` relative): block size from the platform and, for
attention+mamba hybrids, raised until one attention page holds a mamba state
(platforms/interface.py ``_align_hybrid_block_size``); layers grouped so every group has the same
number of layer slots (v1/core/kv_cache_utils.py ``get_kv_cache_groups``); ``bytes_per_block`` =
the widest group; ``num_blocks = available // bytes_per_block``; a request at max_model_len takes
Σ over groups of that group's blocks, and the logged "KV cache size" is
``int(num_blocks / blocks_per_request × max_model_len)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kvops.core.errors import BadInputError
from kvops.core.plan import Capacity, KvGroup
from kvops.ops.capacity.constants import (
    CPU_MLA_BLOCK_SIZE,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_NUM_BATCHED_TOKENS_FALLBACK,
    GIB,
    KERNEL_BLOCK_ALIGNMENT,
    MLA_HYBRID_BLOCK_ALIGNMENT,
)
from kvops.ops.capacity.indexer import SPARSE_MLA_BLOCK_SIZE
from kvops.ops.capacity.model import LayerKV, ModelKV


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


@dataclass(frozen=True)
class SizingFlags:
    """The vLLM flags that change sizing; defaults are vLLM 0.32's for the device."""

    max_model_len: int
    device: str = "cuda"
    block_size: int | None = None
    max_num_batched_tokens: int | None = None
    async_scheduling: bool | None = None  # None: on for cuda, off for cpu (platforms/cpu.py)
    pipeline_parallel_size: int = 1
    mamba_cache_mode: str = "align"  # "align" when prefix caching is on (the default)
    pp_layer_partition: tuple[int, ...] | None = None  # VLLM_PP_LAYER_PARTITION: decoder layers per stage

    @property
    def max_in_flight_tokens(self) -> int:
        """config/vllm.py: concurrent batches × max_num_batched_tokens (V1 model runner)."""
        is_async = self.device == "cuda" if self.async_scheduling is None else self.async_scheduling
        pp = self.pipeline_parallel_size
        batches = 2 if is_async and pp <= 1 else pp
        mnbt = self.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS_FALLBACK
        return batches * mnbt


@dataclass(frozen=True)
class Spec:
    """One layer's spec after block-size resolution (the fields vLLM's equality looks at)."""

    kind: str
    block_size: int
    page_bytes: int
    bytes_per_token: int = 0
    window: int | None = None
    checkpoint_blocks: int = 0
    speculative_blocks: int = 0
    extra_retained_tokens: int = 0
    dtype: str = ""  # vLLM's specs differ by dtype: a skip layer never shares a quantized layer's spec
    padded: bool = False  # a sliding page padded to skip_page_size_padded

    def blocks_per_request(self, flags: SizingFlags) -> int:
        """cdiv(max_memory_usage_bytes, page_size_bytes) for this spec (kv_cache_interface.py)."""
        mml, bs = flags.max_model_len, self.block_size
        if self.kind == "sliding":
            assert self.window is not None
            held = self.window - 1 + self.extra_retained_tokens + flags.max_in_flight_tokens
            return cdiv(min(held, mml), bs) + 1
        if self.kind == "chunked":
            assert self.window is not None
            return cdiv(min(self.window + flags.max_in_flight_tokens, mml), bs)
        if self.kind == "mamba":
            if flags.mamba_cache_mode == "align":
                return 2 + self.speculative_blocks + self.checkpoint_blocks
            return 1 + self.speculative_blocks
        return cdiv(mml, bs)


@dataclass(frozen=True)
class Group:
    kind: str
    layers: tuple[int, ...]
    slots: int  # layer slots incl. padding = the group size
    spec: Spec
    blocks_per_request: int
    bytes_per_block: int  # Σ of its layers' pages
    layer_pages: tuple[int, ...] = ()  # page of each layer in ``layers`` (for PP projection)

    def stage_bytes_per_block(self, first: int, last: int) -> int:
        """Σ pages of this group's layers on the PP stage owning layers [first, last)."""
        return sum(page for layer, page in zip(self.layers, self.layer_pages, strict=True) if first <= layer < last)


@dataclass(frozen=True)
class KVCapacity:
    """What vLLM would compute for one rank with ``available_bytes`` of KV memory."""

    available_bytes: int
    block_size: int
    bytes_per_block: int
    num_blocks: int
    blocks_per_request: int
    max_concurrency: float
    kv_cache_size_tokens: int
    max_model_len: int
    groups: tuple[Group, ...]
    max_in_flight_tokens: int
    mamba_page_padded_bytes: int | None = None
    notes: tuple[str, ...] = field(default=())

    def summary(self) -> Capacity:
        """The typed result ``kvops kv-capacity --json`` prints and a plan carries."""
        return Capacity(
            num_blocks=self.num_blocks, block_size=self.block_size, bytes_per_block=self.bytes_per_block,
            kv_cache_size_tokens=self.kv_cache_size_tokens, max_concurrency=self.max_concurrency,
            max_model_len=self.max_model_len, available_kv_bytes=self.available_bytes,
            usable_blocks=self.num_blocks - 1, blocks_per_request=self.blocks_per_request,
            max_in_flight_tokens=self.max_in_flight_tokens, mamba_page_padded_bytes=self.mamba_page_padded_bytes,
            groups=tuple(KvGroup(kind=g.kind, layers=g.layers, slots=g.slots, block_size=g.spec.block_size,
                                 page_bytes=g.spec.page_bytes, blocks_per_request=g.blocks_per_request)
                         for g in self.groups),
            notes=self.notes,
            log_line=(f"KV cache size: {self.kv_cache_size_tokens:,} tokens, Maximum concurrency "
                      f"for {self.max_model_len:,} tokens per request: {self.max_concurrency:.2f}x"),
        )

    def as_dict(self) -> dict[str, Any]:
        return self.summary().model_dump(mode="json")


@dataclass(frozen=True)
class BlockLayout:
    """Block size and the page paddings the platform sets before the specs are built."""

    block_size: int
    mamba_page_padded: int | None = None
    skip_page_padded: int | None = None  # cache_config.skip_page_size_padded: sliding layers pad to it


def resolve_block_size(model: ModelKV, flags: SizingFlags) -> tuple[int, int | None]:
    """(attention block size, padded mamba page or None) as the platform resolves them."""
    layout = resolve_layout(model, flags)
    return layout.block_size, layout.mamba_page_padded


def resolve_layout(model: ModelKV, flags: SizingFlags) -> BlockLayout:
    """platforms/interface.py update_block_size_for_backend: the platform's block size, then the
    hybrid (mamba) alignment, then the heterogeneous-dtype alignment of --kv-cache-dtype-skip-layers."""
    if flags.device not in DEFAULT_BLOCK_SIZE:
        raise BadInputError(f"--device {flags.device!r}: use one of {', '.join(DEFAULT_BLOCK_SIZE)}")
    if model.sparse_mla:
        bs = _sparse_mla_block_size(flags)
    elif flags.device == "cpu" and model.use_mla:
        bs = CPU_MLA_BLOCK_SIZE  # platforms/cpu.py forces 16 for the CPU MLA backend
    else:
        bs = DEFAULT_BLOCK_SIZE[flags.device] if flags.block_size is None else flags.block_size
    if bs < 1:  # vLLM's CacheConfig: block_size gt=0 (0 used to mean the default here)
        raise BadInputError(f"--block-size must be >= 1, got {bs}")
    bs, mamba_padded = _align_hybrid(model, flags, bs)
    if model.skip_pages_1 is None:
        return BlockLayout(bs, mamba_padded)
    return _align_skip_layers(model.skip_pages_1, KERNEL_BLOCK_ALIGNMENT[flags.device], bs, mamba_padded)


def _align_hybrid(model: ModelKV, flags: SizingFlags, bs: int) -> tuple[int, int | None]:
    """_align_hybrid_block_size: raise the attention block until its page holds a mamba state."""
    mamba_pages = [layer.state_bytes for layer in model.layers if layer.kind == "mamba"]
    if not mamba_pages or not any(layer.kind != "mamba" for layer in model.layers):
        return bs, None
    mamba_page, per_token = max(mamba_pages), model.attn_bytes_per_token_1
    kernel = KERNEL_BLOCK_ALIGNMENT[flags.device]
    align = max(kernel, bs)
    if model.use_mla:
        align = max(align, MLA_HYBRID_BLOCK_ALIGNMENT)
    attn_bs = kernel * cdiv(align * cdiv(mamba_page, align * per_token), kernel)
    bs = max(bs, attn_bs)
    attn_page = bs * per_token
    return bs, (attn_page if attn_page != mamba_page else None)


def _align_skip_layers(pages_1: tuple[int, int], kernel: int, bs: int, mamba_padded: int | None) -> BlockLayout:
    """_align_heterogeneous_kv_block_size: the quantized primary's block grows until its page covers a
    skip layer's page at the smallest kernel block; that shared page is what sliding skip layers (and a
    padded mamba page) pad to. Equal per-token pages change nothing."""
    primary, skip = pages_1
    if skip <= primary:  # vLLM asserts skip >= primary; equal: unify scales blocks by an integer ratio
        return BlockLayout(bs, mamba_padded)
    align = max(kernel, bs)
    required = max(skip * kernel, mamba_padded or 0)
    bs = max(bs, align * cdiv(required, align * primary))
    shared = bs * primary
    return BlockLayout(bs, shared if mamba_padded is not None else None, shared)


# Kernel block sizes a sliding layer's backend supports (v1/attention/backends/*.py
# get_supported_kernel_block_sizes): ("multiple", n) = MultipleOf(n), ("list", …) = those sizes.
_KERNEL_BLOCKS: dict[str, tuple[str, tuple[int, ...]]] = {
    "FLASH_ATTN": ("multiple", (16,)), "TRITON_ATTN": ("multiple", (16,)), "CPU_ATTN": ("multiple", (32,)),
    "FLASHINFER": ("list", (16, 32, 64)), "TURBOQUANT": ("list", (16, 32, 64, 128)),
}


def sliding_block_size(backend: str, per_token: int, budget: int, fallback: int) -> int:
    """attention.py _largest_kernel_block_within: the largest kernel block whose page fits the budget."""
    kind, sizes = _KERNEL_BLOCKS.get(backend, ("multiple", (16,)))
    most = budget // per_token
    candidates = list(sizes) if kind == "list" else [max(n, most // n * n) for n in sizes]
    if not candidates:
        return fallback
    fitting = [b for b in candidates if b * per_token <= budget]
    return max(fitting) if fitting else min(candidates)


def _sparse_mla_block_size(flags: SizingFlags) -> int:
    """The indexer backend takes 64-token kernel blocks only (indexer.py); CPU has no sparse MLA."""
    if flags.device == "cpu":
        raise BadInputError("sparse MLA (config 'index_topk', DeepSeek-V3.2) does not run on vLLM's CPU "
                            "platform (platforms/cpu.py); plan it with --device cuda")
    bs = flags.block_size or SPARSE_MLA_BLOCK_SIZE
    if bs % SPARSE_MLA_BLOCK_SIZE:
        raise BadInputError(f"--block-size {bs}: sparse MLA (index_topk) needs a multiple of "
                            f"{SPARSE_MLA_BLOCK_SIZE} (the indexer's kernel block)")
    return bs


def _layer_spec(layer: LayerKV, layout: BlockLayout) -> Spec:
    bs = layout.block_size
    if layer.kind == "mamba":
        return Spec("mamba", bs, layout.mamba_page_padded or layer.state_bytes,
                    checkpoint_blocks=layer.checkpoint_blocks, speculative_blocks=layer.speculative_blocks)
    if layer.kind == "sliding" and layer.backend:  # attention.py get_kv_cache_spec: SW picks its own block
        budget = layout.skip_page_padded or layer.bytes_per_token * bs
        sw_bs = sliding_block_size(layer.backend, layer.bytes_per_token, budget, bs)
        return Spec("sliding", sw_bs, layout.skip_page_padded or sw_bs * layer.bytes_per_token, layer.bytes_per_token,
                    layer.window, extra_retained_tokens=layer.extra_retained_tokens, dtype=layer.kv_dtype,
                    padded=layout.skip_page_padded is not None)
    return Spec(layer.kind, bs, bs * layer.bytes_per_token, layer.bytes_per_token, layer.window,
                extra_retained_tokens=layer.extra_retained_tokens, dtype=layer.kv_dtype)


def _unify_pages(specs: list[Spec]) -> list[Spec]:
    """unify_kv_cache_spec_page_size: bigger blocks by integer ratio, else pad (not MLA)."""
    top = max(s.page_bytes for s in specs)
    out = []
    for s in specs:
        if s.page_bytes == top:
            out.append(s)
        elif s.kind == "mamba":
            out.append(replace(s, page_bytes=top))
        elif top % s.page_bytes == 0 and s.padded:
            # vLLM grows the block and keeps the padded page: AttentionSpec.page_size_bytes asserts
            raise BadInputError(
                "vLLM 0.32 cannot start with these skip layers (--kv-cache-dtype-skip-layers, and TurboQuant's first and "
                "last 2 layers): the sliding layers' pages are padded "
                f"to {s.page_bytes:,} B but a full-attention skip layer's page is {top:,} B "
                "(v1/core/kv_cache_utils.py unify_kv_cache_spec_page_size fails an assertion); skip no full-attention "
                "layer on this model (only sliding_window), or choose a dtype that keeps none (not turboquant_*)")
        elif top % s.page_bytes == 0:
            ratio = top // s.page_bytes
            out.append(replace(s, block_size=s.block_size * ratio, page_bytes=top))
        elif s.kind != "mla":
            out.append(replace(s, page_bytes=top))
        else:
            raise BadInputError("MLA layer pages cannot be unified with the other layers' pages")
    return out


def build_groups(model: ModelKV, specs: list[Spec], flags: SizingFlags) -> list[Group]:
    """get_kv_cache_groups for the layer-outermost layout every standard backend uses."""
    indices = [layer.index for layer in model.layers]
    if len(set(specs)) == 1:
        s = specs[0]
        return [Group(s.kind, tuple(indices), len(specs), s, s.blocks_per_request(flags),
                      len(specs) * s.page_bytes, tuple(x.page_bytes for x in specs))]
    kinds = {(s.kind, s.window, s.block_size, s.checkpoint_blocks) for s in specs}
    if len(kinds) == 1 and specs[0].kind != "mamba":  # UniformTypeKVCacheSpecs: one group
        s = max(specs, key=lambda x: x.page_bytes)
        merged = replace(s, page_bytes=sum(x.page_bytes for x in specs))
        return [Group(s.kind, tuple(indices), len(specs), merged, s.blocks_per_request(flags),
                      merged.page_bytes, tuple(x.page_bytes for x in specs))]
    specs = _unify_pages(specs)
    buckets: dict[Spec, list[int]] = {}
    for index, spec in zip(indices, specs, strict=True):
        buckets.setdefault(spec, []).append(index)
    sizes = [len(v) for v in buckets.values()]
    group_size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
    groups = []
    for spec, members in buckets.items():
        num_groups = cdiv(len(members), group_size)
        for i in range(num_groups):
            layers = tuple(members[i::num_groups])
            groups.append(Group(spec.kind, layers, group_size, spec, spec.blocks_per_request(flags),
                                len(layers) * spec.page_bytes, (spec.page_bytes,) * len(layers)))
    return groups


def check_context(model: ModelKV, max_model_len: int) -> None:
    """vLLM refuses a max_model_len above the model's context (config/model.py
    _get_and_verify_max_len) unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1; so do we."""
    import os

    limit = model.max_position_embeddings
    if limit is None or max_model_len <= limit or os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") == "1":
        return
    raise BadInputError(f"--max-model-len {max_model_len:,} is above the model's context of {limit:,} tokens "
                        "(max_position_embeddings and RoPE scaling): vLLM refuses to start; lower it, or set "
                        "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 as vLLM asks")


def kv_capacity(model: ModelKV, available_bytes: int, flags: SizingFlags) -> KVCapacity:
    """num_blocks, max_concurrency and the logged token count for one rank."""
    if flags.max_model_len < 1:
        raise BadInputError(f"--max-model-len must be >= 1, got {flags.max_model_len}")
    if flags.max_num_batched_tokens is not None and flags.max_num_batched_tokens < 1:
        raise BadInputError("--max-num-batched-tokens must be >= 1")
    layout = resolve_layout(model, flags)
    bs, mamba_padded = layout.block_size, layout.mamba_page_padded
    specs = [_layer_spec(layer, layout) for layer in model.layers]
    groups = build_groups(model, specs, flags)
    per_request = sum(g.blocks_per_request for g in groups)
    # get_kv_cache_configs (kv_cache_utils.py:2531+): groups come from the whole model, each PP
    # stage sizes its own share of every group, and all workers take the smallest num_blocks.
    stages = pp_stages(model, flags.pipeline_parallel_size, flags.pp_layer_partition)
    stage_bytes = [max(g.stage_bytes_per_block(first, last) for g in groups) for first, last in stages]
    for rank, ((first, last), stage_bpb) in enumerate(zip(stages, stage_bytes, strict=True)):
        if stage_bpb == 0:  # vLLM's allocator fails on a worker without KV layers (ValueError / ZeroDivisionError)
            raise BadInputError(f"pipeline stage {rank} (decoder layers {first}-{last - 1}) has no layer with its own "
                                "KV cache (KV-shared or MLP-only layers); vLLM 0.32 cannot start with that split: "
                                "change --pipeline-parallel-size or --pp-layer-partition")
    for stage_bpb in stage_bytes:
        check_enough_memory(available_bytes, stage_bpb, groups, flags)
    bytes_per_block = max(stage_bytes)
    num_blocks = available_bytes // bytes_per_block
    concurrency = num_blocks / per_request
    return KVCapacity(
        available_bytes=available_bytes, block_size=bs, bytes_per_block=bytes_per_block,
        num_blocks=num_blocks, blocks_per_request=per_request, max_concurrency=concurrency,
        kv_cache_size_tokens=int(concurrency * flags.max_model_len),
        max_model_len=flags.max_model_len, groups=tuple(groups),
        max_in_flight_tokens=flags.max_in_flight_tokens, mamba_page_padded_bytes=mamba_padded,
        notes=device_notes(model, flags),
    )


def device_notes(model: ModelKV, flags: SizingFlags) -> tuple[str, ...]:
    """Where the numbers rest on a GPU-generation choice vLLM makes at start-up (gemma4.py, indexer.py)."""
    notes = []
    if model.per_layer_head_dims and flags.device == "cuda" and flags.block_size is None:
        notes.append("Gemma-4 on CUDA: vLLM sizes blocks by the GPU's FlashAttention kernels (16 assumed, as on "
                     "Hopper with bf16 KV; Blackwell's FA4 head-256 kernel takes 128): pass --block-size as the "
                     "server logs it")
    if model.sparse_mla and model.kv_dtype == "fp8_ds_mla":
        notes.append("sparse MLA fp8 KV sized as fp8_ds_mla (656-byte rows, Hopper's FLASHMLA_SPARSE); "
                     "Blackwell's FlashInfer sparse MLA keeps plain fp8 rows: plan it with --kv-cache-dtype fp8_e4m3")
    return tuple(notes)


def pp_indices(num_layers: int, rank: int, pp: int, partition: tuple[int, ...] | None = None) -> tuple[int, int]:
    """distributed/utils.py get_pp_indices: VLLM_PP_LAYER_PARTITION when set, else an even split with
    the remainder on the stages before the last (the middle ones when it is small)."""
    if partition is not None:
        partitions = list(partition)
    else:
        partitions = [num_layers // pp] * pp
        for i in range(2, num_layers % pp + 2):
            partitions[-i] += 1
    start = sum(partitions[:rank])
    return start, start + partitions[rank]


def parse_pp_layer_partition(text: str | None) -> tuple[int, ...] | None:
    """The env var's format, "a,b,c"; its sum and length are checked against the model in pp_stages."""
    if text is None or not text.strip():
        return None
    try:
        parts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise BadInputError(f"VLLM_PP_LAYER_PARTITION {text!r}: use comma-separated layer counts, e.g. 15,16,15,15") from None
    if any(part < 1 for part in parts):
        # vLLM accepts 0, then its allocator divides by zero on the stage without KV layers.
        raise BadInputError(f"VLLM_PP_LAYER_PARTITION {text!r}: every stage needs at least one layer")
    return parts


def pp_stages(model: ModelKV, pp: int, partition: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    if pp < 1:
        raise BadInputError(f"--pipeline-parallel-size must be >= 1, got {pp}")
    layers = model.num_decoder_layers or (max(layer.index for layer in model.layers) + 1)
    if pp > layers:
        raise BadInputError(f"--pipeline-parallel-size {pp} exceeds the model's {layers} decoder layers")
    if partition is not None and (len(partition) != pp or sum(partition) != layers):
        raise BadInputError(f"VLLM_PP_LAYER_PARTITION {','.join(map(str, partition))}: needs {pp} stage counts "
                            f"(--pipeline-parallel-size) summing to the model's {layers} decoder layers")
    stages = [pp_indices(layers, rank, pp, partition) for rank in range(pp)]
    first, last = stages[-1]
    return [*stages[:-1], (first, last + model.draft_layers)]  # the drafter runs on the last stage


def check_enough_memory(available: int, bytes_per_block: int, groups: list[Group], flags: SizingFlags) -> None:
    """_check_enough_kv_cache_memory against available − one null block, with vLLM's estimate."""
    usable = available - bytes_per_block
    if usable <= 0:
        raise BadInputError(
            f"KV memory {available} B holds no block beyond the null block ({bytes_per_block} B "
            "per block); raise --kv-cache-memory-bytes / gpu_memory_utilization")
    needed = bytes_per_block * sum(g.blocks_per_request for g in groups)
    if needed <= usable:
        return
    lo, hi, best = 1, flags.max_model_len, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        probe = replace(flags, max_model_len=mid)
        if bytes_per_block * sum(g.spec.blocks_per_request(probe) for g in groups) <= usable:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    raise BadInputError(
        f"--max-model-len {flags.max_model_len} needs {needed / GIB:.2f} GiB of KV for one request "
        f"but {usable / GIB:.2f} GiB is available; the largest max_model_len that fits is {best}")
