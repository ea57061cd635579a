"""Tiny models whose K/V magnitudes are moved far outside fp8's comfortable range while the
model itself computes the same function.

Attention is invariant under k_proj × s, q_proj ÷ s (q·k unchanged) and v_proj × s, o_proj ÷ s
(the output unchanged). So a bf16-KV server gives the base model's outputs for any s, and only
an fp8 KV cache sees the difference: s ≫ 1 saturates e4m3 (max 448) at scale 1.0, s ≪ 1 rounds
K/V into e4m3's subnormals or to zero. That makes "scale 1.0 is wrong" measurable without
changing anything else. (``kvops model tiny --kv-proj-scale`` scales K/V alone, which also
changes the model: attention gets sharper or flatter.)
"""

from __future__ import annotations

from pathlib import Path

from kvops.core.errors import BadInputError
from kvops.ops.models.tiny import TinyModelSpec, build_tiny_model


def build_kv_scaled_model(out_dir: Path, kv_factor: float, spec: TinyModelSpec | None = None) -> Path:
    """A tiny model (``spec``, default shape) with K and V multiplied by ``kv_factor``."""
    if not kv_factor > 0:
        raise BadInputError(f"kv_factor must be > 0, got {kv_factor}")
    build_tiny_model(out_dir, spec or TinyModelSpec())
    if kv_factor != 1.0:
        _rescale(out_dir / "model.safetensors", kv_factor)
    return out_dir


def _rescale(path: Path, factor: float) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    multipliers = {"k_proj": factor, "v_proj": factor, "q_proj": 1 / factor, "o_proj": 1 / factor}
    for name, tensor in tensors.items():
        for proj, mult in multipliers.items():
            if name.endswith(f"self_attn.{proj}.weight"):
                tensors[name] = (tensor.to(torch.float32) * mult).to(tensor.dtype).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
