"""``kvops plan --kv-scales``: a calibrated scales file's skip-layer advice, carried to the plan.

``kvops calibrate`` measures what fp8 KV costs per layer and writes the layers to keep at the
model dtype (``accuracy.skip_layers``, kvops.ops.fp8.sensitivity). The plan sizes the cache with
those layers skipped, as vLLM's allocator sizes one whose skipped layers keep bf16 pages
(kvops.ops.capacity.skip_layers), says what they cost in KV tokens, and writes the scales file
into kvops.yaml so the plugin loads it; the serve line carries ``--kv-cache-dtype-skip-layers``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from kvops.core.errors import BadInputError
from kvops.core.fp8.scales import (
    ScalesFile,
    fingerprint_of_config,
    load_scales_file,
    scales_mismatch,
)
from kvops.core.kv_dtypes import calibratable_names, kv_dtype
from kvops.core.plan import Plan
from kvops.core.settings import parse_settings
from kvops.ops.capacity.allocator import SizingFlags
from kvops.ops.capacity.skip_layers import skip_layer_cost


def read_scales(path: Path, kv_cache_dtype: str, raw: dict[str, Any]) -> ScalesFile:
    """The scales file, refused for a KV dtype its scales do not apply to or another model (the
    plugin refuses both at start-up: the plan says so first)."""
    if not kv_dtype(kv_cache_dtype).calibratable:
        raise BadInputError(f"--kv-scales applies to --kv-cache-dtype {', '.join(calibratable_names())}, not "
                            f"{kv_cache_dtype}: add --kv-cache-dtype fp8 or drop --kv-scales")
    scales = load_scales_file(path)
    mismatch = scales_mismatch(scales, fingerprint_of_config(raw))
    if mismatch:
        raise BadInputError(f"--kv-scales {path} was calibrated for another model ({mismatch}): calibrate this one "
                            "with `kvops calibrate`")
    return scales


def advised_skip_layers(scales: ScalesFile, given: str | None) -> str | None:
    """The skip layers the plan sizes: the ones given on the command line win over the file's advice."""
    if given is not None or scales.accuracy is None or not scales.accuracy.skip_layers:
        return given
    return ",".join(str(layer) for layer in scales.accuracy.skip_layers)


def with_scales(plan: Plan, raw: dict[str, Any], scales: ScalesFile, path: Path, given: str | None) -> Plan:
    """kvops.yaml loads the scales; a note says what the file advised and what its skips cost."""
    notes = list(plan.notes)
    accuracy = scales.accuracy
    if accuracy is None:
        notes.append(f"--kv-scales {path}: no accuracy section (written before kvops measured it): run "
                     "`kvops fp8 check` on your prompts before serving fp8 KV")
    elif given is not None and accuracy.skip_layers:
        notes.append(f"--kv-scales {path} advises --kv-cache-dtype-skip-layers "
                     f"{' '.join(map(str, accuracy.skip_layers))}; the plan sizes the ones given instead")
    elif accuracy.skip_layers:
        notes.append(_cost_note(plan, raw, scales, path))
    else:
        notes.append(f"--kv-scales {path}: calibrated fp8 within its threshold without skip layers "
                     f"(perplexity ratio {accuracy.calibrated_perplexity_ratio:.4f} on {accuracy.tokens} tokens)")
    yaml_doc = {**plan.kvops_yaml, "kv_scales": {"path": str(path.resolve())}}
    parse_settings(yaml_doc, "kvops plan")  # the plugin's own validator, as for the rest of kvops.yaml
    return plan.model_copy(update={"notes": tuple(notes), "kvops_yaml": yaml_doc})


def _cost_note(plan: Plan, raw: dict[str, Any], scales: ScalesFile, path: Path) -> str:
    accuracy = scales.accuracy
    assert accuracy is not None
    flags = SizingFlags(max_model_len=plan.max_model_len, device=plan.device,
                        max_num_batched_tokens=plan.max_num_batched_tokens,
                        pipeline_parallel_size=plan.pipeline_parallel_size,
                        pp_layer_partition=plan.pp_layer_partition)
    layers = tuple(str(layer) for layer in accuracy.skip_layers)
    cost = skip_layer_cost(raw, plan.kv_cache_dtype, layers, plan.capacity.available_kv_bytes, flags,
                           plan.tensor_parallel_size)
    tokens = (f"{cost.tokens_with:,} KV tokens instead of {cost.tokens_without:,}"
              if cost.tokens_with and cost.tokens_without else "vLLM would not start with them")
    skip = f" with them {accuracy.skip_perplexity_ratio:.4f}" if accuracy.skip_perplexity_ratio else ""
    return (f"skip layers {' '.join(layers)} from --kv-scales {path} (kvops calibrate: calibrated fp8 perplexity "
            f"ratio {accuracy.calibrated_perplexity_ratio:.4f},{skip}, threshold {accuracy.threshold}): they keep "
            f"model-dtype pages: {tokens}")


def request_with_advice(req: Any, scales: ScalesFile) -> Any:
    """The PlanRequest with the file's advised skip layers when none were given."""
    return replace(req, kv_cache_dtype_skip_layers=advised_skip_layers(scales, req.kv_cache_dtype_skip_layers))
