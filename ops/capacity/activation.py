"""The profile run's transient peak and the runtime's own memory, when nothing measured them.

vLLM subtracts from the KV budget the torch peak of its profile run (v1/worker/gpu_model_runner.py
``profile_run``): a dummy forward of max_num_batched_tokens tokens, then a sampler warm-up over
max_num_seqs rows (``_dummy_sampler_run``), on the last pipeline stage. The forward's activations
are freed before the sampler runs, so the peak is the larger of the two, plus what stays
allocated through both:

- forward: one dense layer's widest live activations per batched token — the MLP's intermediate
  on this rank plus about 1.5 hidden widths of residual and attention output;
- sampler: the logits of every row in the model dtype plus the fp32 copies and top-k/top-p's
  sorted values and indices (bytes per logit beyond the model dtype: fitted), the dummy run's
  hidden states, which ``profile_run`` holds until the sampler is done (one copy of
  max_num_batched_tokens × hidden), and a small fixed remainder;
- held through both: the fused-MoE workspace, which the worker's ``WorkspaceManager`` keeps at
  its high-water mark (fused_moe/modular_kernel.py ``_allocate_buffers``; TritonExperts'
  ``workspace_shapes``, experts/triton_moe.py:226-241: M·top_k·max(I, hidden) and
  M·top_k·max(2I, hidden) at M = max_num_batched_tokens; none for the monolithic triton kernel
  that runs mxfp4 experts on Hopper); and for a multimodal model the encoder profiling's dummy
  images and their embeddings, which ``profile_run`` keeps (the batch in a local, the outputs in
  ``encoder_cache``) until the sampler is done: one encoder budget of max_num_batched_tokens
  tokens, at the vision tower's pixels per token;
- non-torch: by parallelism (CUDA context, NCCL, custom all-reduce buffers), and with TP by the
  model's width (WIDE_NON_TORCH_GIB).

The constants were read off the published vLLM 0.19 H100 logs of Llama-3.1-8B (TP1, TP2, TP4,
PP2, PP4, fp32) and Qwen2.5-7B (TP1, TP2, TP4) only (shared/fixtures/gpu-logs), whose "torch
peak memory increase" does not change with TP (the sampler sees the whole vocabulary on every
rank); ``kvops bench planner``'s ``gpu_logs`` reports every other logged model as held out.
``kvops verify --calibration-out`` on the operator's own server replaces all of them with
measured figures.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvops.core.units import GIB
from kvops.ops.capacity.constants import MODEL_DTYPE_BYTES
from kvops.ops.capacity.model import text_config
from kvops.ops.capacity.mxfp4 import mxfp4_layout
from kvops.ops.capacity.weights import VOCAB_PADDING, config_count, is_moe_layer

FIT_RUNS = "Llama-3.1-8B (TP1/2/4, PP2/4, fp32) and Qwen2.5-7B (TP1/2/4), vLLM 0.19 H100 logs"
# Sampler bytes per logit beyond the model-dtype logits (fp32 copy 4 + sorted values 4 + int64
# indices 8, partly freed): the slope between Llama-3.1-8B's and Qwen2.5-7B's torch peaks.
SAMPLER_BYTES_PER_LOGIT = 12.43
SAMPLER_FIXED_GIB = 0.06  # the rest of the warm-up (the fit's intercept)
RESIDUAL_HIDDEN_WIDTHS = 1.5
# The logs' "non-torch forward increase" of the fit runs, by TP world size (8 and more: TP4's).
NON_TORCH_GIB = {1: 0.25, 2: 2.07, 4: 2.13}
PIPELINE_NON_TORCH_GIB = 0.86  # a pipeline stage's NCCL send/recv communicators (PP2 and PP4 logs)
# With TP the non-torch increase grows with the model's width: the 8192-wide logs whose config is
# not here, so the bench does not evaluate them (Llama-3.3-70B fp8-dynamic TP2 2.10 / TP4 2.21,
# its w8a8 TP2 2.11, Kimi-Dev-72B TP2 2.09 / TP4 2.21), the largest by TP. Between the fit runs'
# width (4096) and 8192 it is interpolated; 5120-wide logs (TP2 2.07, TP4 2.17) sit on or just
# above that line. The cause is not in the logs (CUDA kernels' local memory is one candidate).
WIDE_NON_TORCH_GIB = {2: 2.11, 4: 2.21}
FIT_HIDDEN, WIDE_HIDDEN = 4096, 8192
_PIXEL_CHANNELS = 3


@dataclass(frozen=True)
class ActivationShape:
    """What the default activation and non-torch terms need from the model and the parallelism."""

    forward_elements_per_token: int  # on this rank, at the widest dense layer
    vocab_padded: int
    dtype_bytes: int
    tp: int
    pp: int
    moe: bool = False
    multimodal: bool = False
    hidden: int = 0
    moe_workspace_elements_per_token: int = 0  # the fused-MoE workspace, held from the forward on
    mm_elements_per_token: int = 0  # dummy image pixels and embeddings per encoder-budget token

    def forward_gib(self, max_num_batched_tokens: int) -> float:
        return max_num_batched_tokens * self.forward_elements_per_token * self.dtype_bytes / GIB

    def sampler_gib(self, max_num_seqs: int, max_num_batched_tokens: int) -> float:
        rows = min(max_num_seqs, max_num_batched_tokens)  # the warm-up samples one row per dummy request
        logits = rows * self.vocab_padded * (self.dtype_bytes + SAMPLER_BYTES_PER_LOGIT)
        return SAMPLER_FIXED_GIB + (logits + max_num_batched_tokens * self.hidden * self.dtype_bytes) / GIB

    def held_gib(self, max_num_batched_tokens: int) -> float:
        """Allocated through the forward and the sampler: the MoE workspace, the encoder profiling's inputs."""
        elements = self.moe_workspace_elements_per_token + self.mm_elements_per_token
        return max_num_batched_tokens * elements * self.dtype_bytes / GIB

    def peak_gib(self, max_num_seqs: int, max_num_batched_tokens: int, last_stage: bool = True) -> float:
        """The profile run's torch peak on a stage (only the last one runs the sampler)."""
        forward = self.forward_gib(max_num_batched_tokens)
        sampler = self.sampler_gib(max_num_seqs, max_num_batched_tokens) if last_stage else 0.0
        return max(forward, sampler) + self.held_gib(max_num_batched_tokens)

    def non_torch_gib(self) -> float:
        if self.tp > 1:
            key = 2 if self.tp < 4 else 4
            share = min(1.0, max(0.0, (self.hidden - FIT_HIDDEN) / (WIDE_HIDDEN - FIT_HIDDEN)))
            return NON_TORCH_GIB[key] + share * (WIDE_NON_TORCH_GIB[key] - NON_TORCH_GIB[key])
        return PIPELINE_NON_TORCH_GIB if self.pp > 1 else NON_TORCH_GIB[1]


def _moe_workspace(cfg: Mapping[str, Any], tp: int, gpu: str | None) -> int:
    """TritonExperts' two workspaces per batched token; 0 where the experts run monolithic."""
    quant = cfg.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "mxfp4" and mxfp4_layout(gpu) is not None:
        return 0  # Hopper's OAI triton kernel (oracle/mxfp4.py TRITON) is monolithic: no workspace
    hidden = config_count(cfg, "hidden_size")
    width = (config_count(cfg, "moe_intermediate_size") or config_count(cfg, "intermediate_size")) // tp
    top_k = config_count(cfg, "num_experts_per_tok") or config_count(cfg, "experts_per_token") or 1
    return top_k * (max(width, hidden) + max(2 * width, hidden))


def _mm_inputs(raw: Mapping[str, Any], text_hidden: int) -> int:
    """Per encoder-budget token: the dummy images' pixels (the tower's image at the tokens one
    image becomes: mm_tokens_per_image, else its patches after any pixel shuffle) and one
    embedding of the text model's width."""
    vision = raw.get("vision_config")
    if not isinstance(vision, dict):
        return 0
    image, patch = config_count(vision, "image_size"), config_count(vision, "patch_size", 14) or 14
    shuffle = vision.get("pixel_shuffle_ratio")
    tokens = config_count(raw, "mm_tokens_per_image") or (image // patch) ** 2
    if isinstance(shuffle, int | float) and not config_count(raw, "mm_tokens_per_image"):
        tokens = int(tokens * shuffle * shuffle)
    pixels = _PIXEL_CHANNELS * image * image // max(1, tokens)
    return pixels + text_hidden


def activation_shape(raw: Mapping[str, Any], dtype: str, tp: int, pp: int, gpu: str | None = None) -> ActivationShape:
    cfg = text_config(raw)
    hidden = config_count(cfg, "hidden_size")
    dense = config_count(cfg, "intermediate_size") // tp + int(RESIDUAL_HIDDEN_WIDTHS * hidden)
    layers = config_count(cfg, "num_hidden_layers")
    moe = any(is_moe_layer(cfg, i) for i in range(layers))
    vocab = -(-config_count(cfg, "vocab_size") // VOCAB_PADDING) * VOCAB_PADDING
    return ActivationShape(dense, vocab, int(MODEL_DTYPE_BYTES[dtype]), tp, pp, moe=moe,
                           multimodal=isinstance(raw.get("vision_config"), dict), hidden=hidden,
                           moe_workspace_elements_per_token=_moe_workspace(cfg, tp, gpu) if moe else 0,
                           mm_elements_per_token=_mm_inputs(raw, hidden))
