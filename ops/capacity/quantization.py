"""What a checkpoint's weight quantization costs in memory, per element, as vLLM 0.32 loads it.

The method comes from config.json's ``quantization_config`` (what vLLM reads,
config/model.py ``_verify_quantization``) or from ``vllm serve --quantization`` for the methods
that quantize a bf16 checkpoint while loading it (fp8, bitsandbytes, experts_int8). Each method
says which weights it quantizes (every linear layer, or only MoE experts), how many bits a weight
keeps, and what its scales and zero points add per weight: the scale tensors' shapes in vLLM's
linear methods (model_executor/layers/quantization/*). Embeddings, norms and routers stay in the
model dtype; ``lm_head`` too unless the method names it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvops.core.errors import BadInputError
from kvops.ops.capacity.mxfp4 import TARGET_VLLM, HopperMxfp4Layout, mxfp4_layout

# vLLM's --quantization names that load a bf16/fp16 checkpoint and quantize it on the fly
# (model_executor/layers/quantization/fp8.py Fp8Config with is_checkpoint_fp8_serialized=False,
# bitsandbytes.py in-flight 4-bit, experts_int8.py).
ONLINE_METHODS = ("fp8", "bitsandbytes", "experts_int8")
# Aliases vLLM maps onto a checkpoint's own method (gptq -> gptq_marlin on a GPU that runs Marlin).
_SAME_FORMAT = {"gptq_marlin": "gptq", "awq_marlin": "awq", "gptq_bitblas": "gptq", "awq_triton": "awq",
                "marlin": "gptq", "fp8_per_block": "fp8"}
_FP32, _BF16 = 4, 2


@dataclass(frozen=True)
class WeightFormat:
    """Bytes per weight element of the tensors a method quantizes.

    ``per_element``: the packed weight plus its scales and zero points spread over the elements
    they cover; ``per_row``: bytes per output feature (per-channel scales), counted separately
    because they do not shrink with the input width.
    """

    method: str
    per_element: float
    per_row: float = 0.0
    experts_only: bool = False  # mxfp4 / experts_int8: attention and dense MLPs keep the model dtype
    lm_head: bool = False  # the method quantizes lm_head too
    source: str = ""
    expert_layout: HopperMxfp4Layout | None = None  # experts as the device's kernel lays them out


def _num(value: object, field: str, *, minimum: float = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadInputError(f"config field 'quantization_config.{field}' must be an integer >= {minimum:g}, "
                            f"got {value!r}")
    return value


def _grouped(bits: int, group: int, zero_points: bool, scale_bytes: int = _BF16) -> float:
    """A packed ``bits``-bit weight, one scale per ``group`` inputs (and a packed zero point)."""
    return bits / 8 + scale_bytes / group + (bits / 8 / group if zero_points else 0.0)


def _channel_or_group(bits: int, strategy: str, group: object, symmetric: bool, field: str) -> tuple[float, float]:
    """(per element, per row) for compressed-tensors' strategies (compressed_tensors/schemes/)."""
    if strategy == "group":
        return _grouped(bits, _num(group, f"{field}.group_size"), not symmetric), 0.0
    if strategy == "channel":
        return bits / 8, float(_FP32)  # ChannelQuantScaleParameter: float32 (out, 1)
    if strategy in ("tensor", "block", "tensor_group"):
        scale = _FP32 / (128 * 128) if strategy == "block" else 0.0
        scale = 1 / 16 if strategy == "tensor_group" else scale  # nvfp4: an fp8 scale per 16 weights
        return bits / 8 + scale, 0.0
    raise BadInputError(f"config field 'quantization_config.{field}.strategy' {strategy!r} is not one of "
                        "tensor, channel, group, block, tensor_group")


def _compressed_tensors(cfg: Mapping[str, Any]) -> WeightFormat:
    groups = cfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise BadInputError("config field 'quantization_config.config_groups' must be a non-empty mapping "
                            "(a compressed-tensors checkpoint)")
    name, group = next(iter(groups.items()))
    weights = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(weights, dict):
        raise BadInputError(f"config field 'quantization_config.config_groups.{name}.weights' must be a mapping")
    field = f"config_groups.{name}.weights"
    bits = _num(weights.get("num_bits"), f"{field}.num_bits")
    strategy = str(weights.get("strategy") or "tensor")
    per_element, per_row = _channel_or_group(bits, strategy, weights.get("group_size"),
                                             weights.get("symmetric", True) is not False, field)
    ignored = cfg.get("ignore") or []
    lm_head = isinstance(ignored, list) and not any("lm_head" in str(x) for x in ignored)
    return WeightFormat("compressed-tensors", per_element, per_row, lm_head=lm_head,
                        source=f"compressed-tensors {bits}-bit {strategy}")


def _gptq_awq(cfg: Mapping[str, Any], method: str) -> WeightFormat:
    bits = _num(cfg.get("bits", cfg.get("w_bit")), "bits")
    group = cfg.get("group_size", cfg.get("q_group_size", 128))
    if group == -1:  # one group per column: per-channel scales
        return WeightFormat(method, bits / 8, float(_BF16) + bits / 8, source=f"{method} {bits}-bit per channel")
    per_element = _grouped(bits, _num(group, "group_size"), zero_points=True)
    return WeightFormat(method, per_element, source=f"{method} {bits}-bit, group {group}")


def _bitsandbytes(cfg: Mapping[str, Any]) -> WeightFormat:
    if cfg.get("load_in_8bit"):
        return WeightFormat("bitsandbytes", 1.0, float(_FP32), source="bitsandbytes int8")
    # nf4/fp4: 4 bits + an absmax per 64 weights (fp32, or 8-bit with double quantization)
    absmax = 1 / 64 + _FP32 / (64 * 256) if cfg.get("bnb_4bit_use_double_quant") else _FP32 / 64
    return WeightFormat("bitsandbytes", 0.5 + absmax, source="bitsandbytes 4-bit")


def _fp8(cfg: Mapping[str, Any]) -> WeightFormat:
    block = cfg.get("weight_block_size")
    if isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
        return WeightFormat("fp8", 1 + _FP32 / (block[0] * block[1]), source=f"fp8, {block[0]}x{block[1]} blocks")
    return WeightFormat("fp8", 1.0, source="fp8 per-tensor")


def weight_format(quantization_config: object, quantization: str | None, gpu: str | None = None,
                  vllm_version: tuple[int, int] = TARGET_VLLM) -> WeightFormat | None:
    """The checkpoint's format, or the --quantization method applied while loading; None: unquantized.

    ``gpu`` (a catalog name) and ``vllm_version`` choose the kernel layout where it is not the
    checkpoint's packing (mxfp4 experts on Hopper, capacity/mxfp4.py)."""
    if quantization_config is None:
        if quantization is None:
            return None
        return _online(quantization)
    if not isinstance(quantization_config, dict):
        raise BadInputError(f"config field 'quantization_config' must be a mapping, got {quantization_config!r}")
    method = str(quantization_config.get("quant_method") or "")
    if quantization is not None and _SAME_FORMAT.get(quantization, quantization) != _SAME_FORMAT.get(method, method):
        raise BadInputError(f"--quantization {quantization} does not match the checkpoint's "
                            f"quantization_config.quant_method {method!r}; drop --quantization (vLLM reads the "
                            "checkpoint's) or pass the checkpoint's method")
    fmt = _checkpoint(quantization_config, method)
    layout = mxfp4_layout(gpu, vllm_version) if fmt.method == "mxfp4" else None
    return replace(fmt, expert_layout=layout, source=layout.source) if layout else fmt


def _checkpoint(cfg: Mapping[str, Any], method: str) -> WeightFormat:
    base = _SAME_FORMAT.get(method, method)
    if base == "fp8":
        return _fp8(cfg)
    if base == "compressed-tensors":
        return _compressed_tensors(cfg)
    if base in ("gptq", "awq"):
        return _gptq_awq(cfg, method)
    if base == "bitsandbytes":
        return _bitsandbytes(cfg)
    if base == "mxfp4":  # 4-bit e2m1 + an e8m0 scale per 32 (quantization/mxfp4.py), MoE experts only
        return WeightFormat("mxfp4", 0.5 + 1 / 32, experts_only=True, source="mxfp4 experts")
    if base in ("modelopt", "modelopt_fp4"):
        algo = str(cfg.get("quant_algo") or "")
        if "FP4" in algo.upper() or base == "modelopt_fp4":
            return WeightFormat(base, 0.5 + 1 / 16, source="modelopt nvfp4")
        return WeightFormat(base, 1.0, source="modelopt fp8")
    raise BadInputError(f"config field 'quantization_config.quant_method' {method!r} is not one kvops sizes "
                        "(fp8, compressed-tensors, gptq, awq, bitsandbytes, mxfp4, modelopt); pass --model-dir "
                        "to read the checkpoint's own bytes")


def _online(quantization: str) -> WeightFormat:
    if quantization == "fp8":  # Fp8LinearMethod on a bf16 checkpoint: fp8 weight + per-tensor scale
        return WeightFormat("fp8", 1.0, source="fp8, quantized while loading (--quantization fp8)")
    if quantization == "bitsandbytes":
        return WeightFormat("bitsandbytes", 0.5 + _FP32 / 64, source="bitsandbytes 4-bit while loading")
    if quantization == "experts_int8":
        return WeightFormat("experts_int8", 1.0, float(_FP32), experts_only=True, source="experts int8 while loading")
    raise BadInputError(f"--quantization {quantization}: this config.json has no quantization_config, and only "
                        f"{', '.join(ONLINE_METHODS)} quantize an unquantized checkpoint while loading; point "
                        "--config at the quantized checkpoint's config.json")
