"""FP8 KV facts and the calibrated-scales file: pure functions shared by the plugin,
``kvops calibrate``, ``kvops doctor`` and the fp8 bench.

vLLM stores an fp8 KV element as ``fp8(x / scale)`` and reads it back as ``fp8 * scale``
(vllm/model_executor/layers/quantization/kv_cache.py). A bf16 checkpoint gets scale 1.0:
K/V above the format's max saturate, K/V far below its smallest subnormal round to zero.
A calibrated per-layer scale maps the observed absmax onto the format's max.

No vLLM, no torch here: the CLI and doctor must stay instant.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvops.core import kinds
from kvops.core.errors import BadInputError
from kvops.core.files import read_mapping
from kvops.core.kinds import read_json_of_kind
from kvops.core.kv_dtypes import (
    Fp8Format as Fp8Format,  # re-exported: the scales file names its format
)
from kvops.core.kv_dtypes import fp8_format

FORMAT_MAX: dict[str, float] = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
"""Largest finite value of each fp8 format (OCP e4m3fn / e5m2)."""
FORMAT_MIN_NORMAL: dict[str, float] = {"fp8_e4m3": 2.0**-6, "fp8_e5m2": 2.0**-14}
"""Smallest normal value of each format: below it (value / scale) keeps fewer mantissa bits."""

DEFAULT_MARGIN = 1.25
"""scale = absmax × margin / format max. The margin leaves 25% headroom for K/V larger than
anything the calibration prompts produced (a saturated value is clipped, an unseen one is
not representable); it costs a third of a bit of e4m3's relative precision, and nothing
near zero, since fp8 precision is relative except in the subnormal range."""

SCALES_FORMAT_VERSION = 1

# config.json keys that do not change what the KV holds (tooling versions, local paths).
_VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype"})


def normalize_fp8_dtype(kv_cache_dtype: str) -> Fp8Format | None:
    """The fp8 format a --kv-cache-dtype stores with per-tensor scales, or None for any other
    dtype (kvops.core.kv_dtypes: vLLM's ``fp8`` means e4m3; per-token-head fp8 has its own scales)."""
    return fp8_format(kv_cache_dtype)


def read_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU feature flags the kernel reports (empty when unreadable)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def fp8_kv_support(
    arch: str, cpu_flags: frozenset[str] | set[str], head_dim: int, use_mla: bool
) -> tuple[bool, str]:
    """Can vLLM's CPU backend hold this model's KV in fp8? (ok, reason when not).

    The rules are those of vllm/v1/attention/backends/cpu_attn.py ``_get_attn_isa`` (AVX-512 or
    AMX; head_size % 32 == 0) and mla/cpu_mla.py (CPU MLA supports only ``auto``), which vLLM
    checks only in the worker, after the model has loaded.
    """
    if use_mla:
        return False, (
            "MLA models cannot use fp8 KV on CPU (vLLM's CPU_MLA backend supports only "
            "--kv-cache-dtype auto): drop --kv-cache-dtype or serve on a GPU"
        )
    x86 = arch in ("x86_64", "amd64", "AMD64")
    if not x86 or not ({"avx512f", "amx_tile"} & set(cpu_flags)):
        return False, (
            f"fp8 KV on CPU needs x86 with AVX-512 or AMX; this CPU ({arch}) has neither: "
            "drop --kv-cache-dtype fp8 or run on an AVX-512/AMX machine"
        )
    if head_dim % 32 != 0:
        return False, (
            f"fp8 KV on CPU needs head_dim % 32 == 0; this model's head_dim is {head_dim}: "
            "drop --kv-cache-dtype fp8 for this model"
        )
    return True, ""


def scale_from_absmax(absmax: float, fmt: str, margin: float = DEFAULT_MARGIN) -> float:
    """The per-tensor scale that puts ``absmax × margin`` at the format's max.

    An all-zero layer (absmax 0) gets 1.0: any positive scale represents it exactly.
    """
    if absmax <= 0 or not math.isfinite(absmax):
        return 1.0
    return absmax * margin / FORMAT_MAX[fmt]


DEFAULT_SEARCH_STEPS = 16
"""Candidate scales per octave in ``candidate_scales``: lattices 2^(1/16) apart (4.4%)."""

ScaleMethod = Literal["absmax", "output-search", "output-search-k", "output-search-v", "scale1-fallback"]
"""How a scales file's scales were chosen: ``absmax`` (scale_from_absmax), ``output-search``
(kvops.ops.fp8.scale_search: per layer, the candidate that least changes the layer's attention
output, for K and V), ``output-search-k`` / ``output-search-v`` (the search's scales for K only,
or V only, and 1.0 for the other: what gave the whole model the least KL on the calibration
text), ``scale1-fallback`` (1.0 everywhere did better than any of those)."""

SEARCHED_TENSORS: dict[str, tuple[bool, bool]] = {
    "output-search": (True, True), "output-search-k": (True, False),
    "output-search-v": (False, True), "scale1-fallback": (False, False),
}
"""For each search method: whether its K and its V scales are the searched ones (else 1.0)."""


def _float32(value: float) -> float:
    """The float32 nearest ``value``: vLLM holds a layer's scale in a float32 tensor, so a
    scale written as float32 is served exactly as it was scored."""
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


def candidate_scales(absmax: float, fmt: str, margin: float = DEFAULT_MARGIN,
                     steps: int = DEFAULT_SEARCH_STEPS) -> list[float]:
    """The scales a search tries for a tensor whose largest value is ``absmax``: one octave from
    the absmax scale, ``steps`` apart, and 1.0.

    An fp8 value's relative error is the same anywhere in the normal range, so two scales an
    octave apart put the normal values on the same lattice; one octave up from
    scale_from_absmax offers every lattice there is, none saturating within the margin, with
    the fewest values in the subnormals. 1.0 is what vLLM runs without scales: a search that
    includes it cannot score worse than it."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    base = scale_from_absmax(absmax, fmt, margin)
    found = {_float32(base * 2.0 ** (j / steps)) for j in range(steps)} | {1.0}
    return sorted(found)


class ModelFingerprint(BaseModel):
    """What a scales file must agree with to be applied to a model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    architecture: str
    num_layers: Annotated[int, Field(ge=1, le=4096)]  # beyond any real decoder: a typo
    num_kv_heads: Annotated[int, Field(ge=1)]
    head_dim: Annotated[int, Field(ge=1)]
    config_sha256: str


def fingerprint_of_config(config: dict[str, object]) -> ModelFingerprint:
    """Fingerprint of a HF config.json mapping (text config for multimodal ones)."""
    text = config.get("text_config")
    cfg = text if isinstance(text, dict) else config
    archs = config.get("architectures") or ["unknown"]
    heads = int(str(cfg.get("num_attention_heads", 1)))
    hidden = int(str(cfg.get("hidden_size", 0)))
    head_dim = cfg.get("head_dim") or (hidden // heads if heads else 0)
    kv_heads = cfg.get("num_key_value_heads") or heads
    stable = {k: v for k, v in sorted(config.items()) if k not in _VOLATILE_CONFIG_KEYS}
    digest = hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()
    return ModelFingerprint(
        architecture=str(archs[0]) if isinstance(archs, list) else str(archs),
        num_layers=int(str(cfg.get("num_hidden_layers", 0))),
        num_kv_heads=int(str(kv_heads)),
        head_dim=int(str(head_dim)),
        config_sha256=digest,
    )


def read_model_config(model_dir: Path) -> dict[str, object]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise BadInputError(f"{model_dir}: no config.json: --model must be a local model directory")
    return read_mapping(path)


class LayerScales(BaseModel):
    """One attention layer's scales and what calibration saw."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    k_scale: float
    v_scale: float
    k_absmax: float | None = None
    v_absmax: float | None = None
    k_error: float | None = None
    """Relative RMS error of K quantized with k_scale, over the sampled values. fp8's relative
    error per value does not depend on the scale unless values saturate or fall into the
    subnormals, so this and k_error_scale1 are alike (~0.026 for e4m3) on most models: read
    the saturated/subnormal shares and kl_alone for what the scale changes."""
    v_error: float | None = None
    k_error_scale1: float | None = None
    """The same error with scale 1.0 (kept for files written before the shares below)."""
    v_error_scale1: float | None = None
    k_saturated: float | None = None
    """Share of sampled K values beyond the format's max at k_scale (clipped)."""
    k_subnormal: float | None = None
    """Share of sampled K values below the format's smallest normal at k_scale (fewer bits, or 0)."""
    k_saturated_scale1: float | None = None
    k_subnormal_scale1: float | None = None
    v_saturated: float | None = None
    v_subnormal: float | None = None
    v_saturated_scale1: float | None = None
    v_subnormal_scale1: float | None = None
    kl_alone: float | None = None
    """Mean next-token KL divergence from bf16 KV with only this layer's KV in fp8 (calibrated
    scales), on the calibration prompts: what this layer's fp8 costs."""
    perplexity_ratio_alone: float | None = None
    k_output_error: float | None = None
    """Relative RMS change of this layer's attention output (after o_proj) with only K in fp8
    at k_scale, on the calibration prompts: what the scale search minimizes."""
    k_output_error_scale1: float | None = None
    v_output_error: float | None = None
    v_output_error_scale1: float | None = None

    @field_validator("k_scale", "v_scale")
    @classmethod
    def _positive_finite(cls, value: float) -> float:
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"must be a positive finite number, got {value}")
        return value


class AccuracySummary(BaseModel):
    """The model-level result of fp8 KV on the calibration prompts (offline emulation,
    kvops.ops.fp8.offline) and the layers advised to stay bf16."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str = "offline transformers forward, vLLM's fp8 round trip on the cached K/V"
    sequences: Annotated[int, Field(ge=0)]
    tokens: Annotated[int, Field(ge=0)]
    threshold: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    bf16_perplexity: float
    scale1_perplexity_ratio: float
    scale1_mean_kl: float
    calibrated_perplexity_ratio: float
    calibrated_mean_kl: float
    skip_layers: list[Annotated[int, Field(ge=0)]] = []
    """Layer indices for vLLM's --kv-cache-dtype-skip-layers (empty: none needed or none helps)."""
    skip_perplexity_ratio: float | None = None
    skip_mean_kl: float | None = None
    safe: bool
    """Calibrated fp8, with skip_layers in bf16, is within the threshold (perplexity ratio and
    exp(mean KL) both)."""


class ScalesFile(BaseModel):
    """The JSON ``kvops calibrate`` writes and the plugin's ``kv_scales`` reads."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: Annotated[int, Field(ge=1)] = SCALES_FORMAT_VERSION
    dtype: Fp8Format
    margin: Annotated[float, Field(gt=0, allow_inf_nan=False)] = DEFAULT_MARGIN
    scale_method: ScaleMethod = "absmax"
    """How the scales were chosen (ScaleMethod); files written before the search say absmax."""
    search_steps: Annotated[int, Field(ge=1)] | None = None
    """Candidates per octave the search tried (output-search only)."""
    model: ModelFingerprint
    vllm_version: str = ""
    tokens_seen: Annotated[int, Field(ge=0)] = 0
    layers: dict[str, LayerScales]
    """vLLM attention layer name (e.g. ``model.layers.0.self_attn.attn``) -> scales."""
    accuracy: AccuracySummary | None = None
    """None in files written before kvops measured accuracy, or with --sensitivity-tokens 0."""


def load_scales_file(path: Path) -> ScalesFile:
    """Read and validate a scales file; every problem is one line naming the file and field."""
    if not path.is_file():
        raise BadInputError(f"kv_scales file {str(path)!r} not found: run `kvops calibrate` or fix the path")
    raw = read_json_of_kind(path, f"kv_scales file {path}", kinds.SCALES)  # a plan or config: named
    try:
        scales = ScalesFile.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise BadInputError(
            f"kv_scales file {path}: {where}: {err['msg']} (recalibrate with `kvops calibrate`)"
        ) from None
    if not scales.layers:
        raise BadInputError(f"kv_scales file {path}: no layers (recalibrate with `kvops calibrate`)")
    return scales


def scales_mismatch(scales: ScalesFile, model: ModelFingerprint) -> str | None:
    """Why these scales do not belong to this model, or None when they do."""
    want = scales.model
    for field in ("architecture", "num_layers", "num_kv_heads", "head_dim", "config_sha256"):
        have, expected = getattr(model, field), getattr(want, field)
        if have != expected:
            return f"{field} is {expected} in the scales file but {have} for the served model"
    if len(scales.layers) != model.num_layers:
        return f"the scales file has {len(scales.layers)} layers, the model {model.num_layers}"
    return None


_CHECKPOINT_SCALE_SUFFIXES = (
    ".k_scale", ".v_scale", ".kv_scale", "k_proj.output_scale", "v_proj.output_scale",
)


def checkpoint_kv_scale_names(model_dir: Path) -> list[str]:
    """Names of k/v scale tensors the checkpoint carries (read from safetensors headers only).

    vLLM loads ``*.k_scale`` / ``*.v_scale`` (and legacy ``*.kv_scale``) into the attention
    layers of fp8 checkpoints (vllm/model_executor/model_loader/weight_utils.py
    ``maybe_remap_kv_scale_name``); compressed-tensors checkpoints name them
    ``k_proj.output_scale`` / ``v_proj.output_scale`` (``CompressedTensorsConfig.get_cache_scale``).
    """
    names: list[str] = []
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        names += [n for n in header if n.endswith(_CHECKPOINT_SCALE_SUFFIXES)]
    return names


ScaleSource = Literal["checkpoint", "file", "default"]


def choose_scale_source(
    checkpoint_has_scales: bool, scales_file_given: bool, override_checkpoint: bool
) -> ScaleSource:
    """Checkpoint scales win over a scales file unless the operator asks to override."""
    if scales_file_given and (override_checkpoint or not checkpoint_has_scales):
        return "file"
    if checkpoint_has_scales:
        return "checkpoint"
    return "default"
