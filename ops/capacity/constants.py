"""The one table of constants the planner, the bench and the docs read (STYLE rule 14).

Values are vLLM 0.32.0's; file references are relative to the installed ``vllm/`` package.
"""

from __future__ import annotations

from typing import Final

# re-exported for the planner modules: GIB is defined once, in core
from kvops.core.units import GIB as GIB

VLLM_VERSION: Final = "0.32.0"
GB: Final = 1_000_000_000

# KV cache dtypes: kvops.core.kv_dtypes (one row per vLLM CacheDType).
MODEL_DTYPE_BYTES: Final[dict[str, int]] = {
    "bfloat16": 2, "float16": 2, "float32": 4, "half": 2, "float": 4,
}

# Block sizes the platform picks when the user passes none (platforms/interface.py
# _preferred_block_size_for_backends; CUDA FlashAttention / FlashAttn-MLA accept MultipleOf(16),
# so 16 stays; platforms/cpu.py: 128, CPU MLA reference backend: 16).
DEFAULT_BLOCK_SIZE: Final[dict[str, int]] = {"cuda": 16, "cpu": 128}
CPU_MLA_BLOCK_SIZE: Final = 16
# Smallest kernel block the first attention backend supports: used to align hybrid
# attention/mamba block sizes (platforms/interface.py _align_hybrid_block_size).
KERNEL_BLOCK_ALIGNMENT: Final[dict[str, int]] = {"cuda": 16, "cpu": 32}
MLA_HYBRID_BLOCK_ALIGNMENT: Final = 128

# config/cache.py, config/scheduler.py, engine/arg_utils.py get_batch_defaults (OpenAI server).
DEFAULT_GPU_MEMORY_UTILIZATION: Final = 0.92
DEFAULT_MAX_NUM_BATCHED_TOKENS_FALLBACK: Final = 2048
DEFAULT_MAX_NUM_SEQS_FALLBACK: Final = 128
SERVER_BATCH_DEFAULTS: Final[tuple[tuple[float, bool, int, int], ...]] = (
    # (min device GiB, exclude A100, max_num_seqs, max_num_batched_tokens)
    (160.0, False, 1024, 16384),
    (70.0, True, 1024, 8192),
    (0.0, False, 256, 2048),
)
CPU_SERVER_BATCH_DEFAULTS: Final = (128, 2048)  # × world size
# Cuda graph capture sizes: [1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16),
# max = min(2 × max_num_seqs, 512) (config/vllm.py).
CUDA_GRAPH_MAX_CAPTURE: Final = 512


# Device totals as CUDA reports them (torch.cuda.mem_get_info), in GiB — not marketing GB.
# Sources: ../shared/research/planner.md §3.5; H200: read on an H200 of the device tool
# (driver 580.159.04, CUDA 13.0, 2026-12-04): 150,109,880,320 bytes. The 139.81 GiB from
# planner.md was 9.5 MiB above it: at utilization 0.92, four 2 MiB blocks (Llama-3-8B) too many.
GPU_CATALOG_GIB: Final[dict[str, float]] = {
    "H100": 79.19,
    "H100-80GB": 79.19,
    "H200": 150_109_880_320 / GIB,
    "B200": 178.36,
    "A100-80GB": 79.15,
    "A100": 79.15,
    "A100-40GB": 39.39,
    "L40S": 44.39,
    "RTX3090": 23.58,
    "RTX4090": 23.54,
    "GB10": 121.69,
}
# Compute capability (major·10 + minor) of each catalog GPU: which kernel backends vLLM picks
# for it (the mxfp4 MoE layout on SM90, capacity/mxfp4.py).
GPU_SM: Final[dict[str, int]] = {
    "H100": 90, "H100-80GB": 90, "H200": 90, "B200": 100, "A100-80GB": 80, "A100": 80, "A100-40GB": 80,
    "L40S": 89, "RTX3090": 86, "RTX4090": 89, "GB10": 121,
}

# Non-KV memory defaults for vLLM 0.32 on CUDA, GiB per GPU (planner.md §3.6, measured at
# v0.19; overridable on the command line and by a calibration file from `kvops verify`).
ACTIVATION_PEAK_GIB_PER_8K_TOKENS: Final = 2.0  # torch peak of the profile run at mnbt=8192
NON_TORCH_GIB: Final[dict[bool, float]] = {False: 0.25, True: 2.1}  # keyed by tp > 1
CUDA_GRAPH_GIB_PER_CAPTURE_SIZE: Final = 0.02  # ~1.04 GiB over ~51 sizes at max_num_seqs 256

MAX_LAYERS = 4096
"""Beyond any real decoder (the deepest published ones have a few hundred layers): a config past it
is a typo, and sizing it would loop for minutes."""
