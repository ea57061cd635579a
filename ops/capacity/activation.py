"""The profile run's transient peak and the runtime's own memory, when nothing measured them.

vLLM subtracts from the KV budget the torch peak of a dummy forward of max_num_batched_tokens
tokens plus a dummy sampler run over max_num_seqs rows (v1/worker/gpu_model_runner.py
``profile_run``, ``_dummy_sampler_run``), and the memory outside torch (CUDA context, NCCL,
custom all-reduce buffers). The defaults here follow those shapes:

- forward: one layer's widest live activations per batched token — the MLP's intermediate on
  this rank plus about 1.5 hidden widths of residual and attention output; in an MoE layer the
  fused-MoE caches, ``top_k × (3 × expert width + hidden)`` (fused_moe intermediate_cache1-3);
- sampler (last pipeline stage only): bytes per logit of the warm-up — the bf16 logits, their
  fp32 copy, and top-k/top-p's sorted values and int64 indices;
- non-torch: by parallelism.

The three coefficients were read off published vLLM 0.19 H100 logs of Llama-3.1-8B (TP1, TP2,
TP4, PP2, PP4, fp32) and Qwen2.5-7B (TP1) only (shared/fixtures/gpu-logs); ``kvops bench
planner``'s ``gpu_logs`` reports every other logged model as held out. ``kvops verify
--calibration-out`` on the operator's own server replaces all of them with measured figures.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvops.core.units import GIB
from kvops.ops.capacity.constants import MODEL_DTYPE_BYTES
from kvops.ops.capacity.model import text_config
from kvops.ops.capacity.weights import VOCAB_PADDING, config_count, is_moe_layer

FIT_RUNS = "Llama-3.1-8B (TP1/2/4, PP2/4, fp32) and Qwen2.5-7B (TP1), vLLM 0.19 H100 logs"
SAMPLER_BYTES_PER_LOGIT = 11.5  # bf16 logits 2 + fp32 4 + sort values 4 + int64 indices 8, partly freed: fitted
RESIDUAL_HIDDEN_WIDTHS = 1.5
NON_TORCH_GIB = {1: 0.41, 2: 2.30, 4: 2.42}  # by TP world size (8 and more: the TP4 figure)
PIPELINE_NON_TORCH_GIB = 0.86  # a pipeline stage's NCCL send/recv communicators (PP2 and PP4 logs)


@dataclass(frozen=True)
class ActivationShape:
    """What the default activation and non-torch terms need from the model and the parallelism."""

    forward_elements_per_token: int  # on this rank, at the widest layer
    vocab_padded: int
    dtype_bytes: int
    tp: int
    pp: int
    moe: bool = False
    multimodal: bool = False

    def forward_gib(self, max_num_batched_tokens: int) -> float:
        return max_num_batched_tokens * self.forward_elements_per_token * self.dtype_bytes / GIB

    def sampler_gib(self, max_num_seqs: int, max_num_batched_tokens: int) -> float:
        rows = min(max_num_seqs, max_num_batched_tokens)  # the warm-up samples one row per dummy request
        return rows * self.vocab_padded * SAMPLER_BYTES_PER_LOGIT / GIB

    def non_torch_gib(self) -> float:
        if self.tp > 1:
            return NON_TORCH_GIB[2 if self.tp < 4 else 4]
        return PIPELINE_NON_TORCH_GIB if self.pp > 1 else NON_TORCH_GIB[1]


def activation_shape(raw: Mapping[str, Any], dtype: str, tp: int, pp: int) -> ActivationShape:
    cfg = text_config(raw)
    hidden = config_count(cfg, "hidden_size")
    dense = config_count(cfg, "intermediate_size") // tp + int(RESIDUAL_HIDDEN_WIDTHS * hidden)
    layers = config_count(cfg, "num_hidden_layers")
    widest = dense
    moe = any(is_moe_layer(cfg, i) for i in range(layers))
    if moe:
        width = (config_count(cfg, "moe_intermediate_size") or config_count(cfg, "intermediate_size")) // tp
        top_k = config_count(cfg, "num_experts_per_tok") or config_count(cfg, "experts_per_token") or 1
        widest = max(widest, top_k * (3 * width + hidden))
    vocab = -(-config_count(cfg, "vocab_size") // VOCAB_PADDING) * VOCAB_PADDING
    return ActivationShape(widest, vocab, int(MODEL_DTYPE_BYTES[dtype]), tp, pp, moe=moe,
                           multimodal=isinstance(raw.get("vision_config"), dict))
