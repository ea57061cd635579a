"""The bytes of mxfp4 MoE experts as vLLM lays them out on a Hopper GPU, not as the checkpoint packs them.

On SM90 vLLM runs gpt-oss's mxfp4 experts with OpenAI's triton_kernels: TRITON is the first
backend in fused_moe/oracle/mxfp4.py ``_get_priority_backends_for_gpt_oss`` (0.32: line 399) an
H100 supports, and the 0.19 H100 logs print "Using 'TRITON' Mxfp4 MoE backend". Loading then:

- rounds the per-rank intermediate size up to 64 (oracle/mxfp4.py:895,
  ``mxfp4_round_up_hidden_size_and_intermediate_size``'s CUDA default);
- swizzles each weight with triton_kernels' ``HopperMXValueLayout``, whose ``swizzle_data`` pads
  both matrix dimensions of the (K/2 bytes, N) storage to multiples of 64 (triton PR #8677;
  mxfp4_utils.py:103 ``_swizzle_mxfp4`` transposes the weight so K, the mx axis, comes first);
- swizzles each scale with ``HopperMXScaleLayout``: N rows padded to 2·num_warps·2·8 = 256
  (num_warps 8), K/32 scale groups to 2 — to 4 in 0.32 (mxfp4_utils.py:117-122);
- casts the expert biases to fp32 (oracle/mxfp4.py:1361);
- 0.32 frees the checkpoint's scale tensors once swizzled (oracle/mxfp4.py:1383-1388,
  ``del layer.w13_weight_scale``); 0.19 deleted only the weights and kept them.

Other devices keep the checkpoint's packing here (Blackwell's TRTLLM and Ampere's Marlin pad to
other multiples; no log of them to check against).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvops.ops.capacity.constants import GPU_SM

MXFP4_BLOCK = 32  # elements per e8m0 scale (OCP MX)
_INTERMEDIATE_ALIGN = 64
_VALUE_ALIGN = 64
_SCALE_ROW_ALIGN = 2 * 8 * 2 * 8  # HopperMXScaleLayout SWIZZLE_ALIGN_M at num_warps 8
TARGET_VLLM = (0, 32)  # the release the planner sizes
# The last release read that keeps the checkpoint's scales and pads scale groups to 2; 0.32 does
# neither. Releases in between are taken as 0.32 (not checked one by one).
_LAST_KEEPING_SCALES = (0, 19)


def _up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class HopperMxfp4Layout:
    """The TRITON backend's layout of one expert's w13 (gate+up) and w2 (down) on SM90."""

    scale_group_align: int  # K/32 padded to this (0.32: 4, 0.19: 2)
    keeps_checkpoint_scales: bool  # 0.19: the unswizzled scales stay allocated
    source: str

    def expert_bytes(self, hidden: int, width: int, biased: bool) -> int:
        """One expert's bytes at ``hidden`` and the per-rank intermediate ``width``."""
        width = _up(width, _INTERMEDIATE_ALIGN)
        total = 0
        for k, n in ((hidden, 2 * width), (width, hidden)):  # w13: hidden -> 2·width; w2: width -> hidden
            total += _up(k // 2, _VALUE_ALIGN) * _up(n, _VALUE_ALIGN)
            total += _up(n, _SCALE_ROW_ALIGN) * _up(k // MXFP4_BLOCK, self.scale_group_align)
            if self.keeps_checkpoint_scales:
                total += n * (k // MXFP4_BLOCK)
        return total + (4 * (2 * width + hidden) if biased else 0)


def mxfp4_layout(gpu: str | None, vllm_version: tuple[int, int] = TARGET_VLLM) -> HopperMxfp4Layout | None:
    """The layout vLLM gives mxfp4 experts on this catalog GPU; None: the checkpoint's packing."""
    if gpu is None or GPU_SM.get(gpu) != 90:
        return None
    old = vllm_version <= _LAST_KEEPING_SCALES
    return HopperMxfp4Layout(
        scale_group_align=2 if old else 4, keeps_checkpoint_scales=old,
        source=f"mxfp4 experts in vLLM {vllm_version[0]}.{vllm_version[1]}'s Hopper triton layout")
