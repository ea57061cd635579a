"""Worker side: after an attention layer's weights are processed, put the calibrated scales in
(or start recording its K/V).

Called from the wrapper of ``Attention.process_weights_after_loading`` (plugin/_compat.py),
which vLLM runs in every worker after the quant methods have set checkpoint scales
(vllm/model_executor/model_loader/utils.py ``process_weights_after_loading``), inside
``set_current_vllm_config`` (vllm/v1/worker/gpu_worker.py ``load_model``; CPUWorker inherits it).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from kvops.core.fp8.scales import (
    ScalesFile,
    checkpoint_kv_scale_names,
    choose_scale_source,
    load_scales_file,
    normalize_fp8_dtype,
)
from kvops.core.fp8.settings import KvScalesSettings


@lru_cache(maxsize=4)
def scales_file(path: str) -> ScalesFile:
    return load_scales_file(Path(path))


@lru_cache(maxsize=4)
def checkpoint_has_scales(model: str) -> bool:
    model_dir = Path(model)
    return model_dir.is_dir() and bool(checkpoint_kv_scale_names(model_dir))


def after_attention_weights(layer: Any, vllm_config: Any, kv_scales: KvScalesSettings) -> None:
    """Apply the scales file to this layer, or wrap its cache write in recording mode."""
    if kv_scales.record is not None:
        from kvops.plugin.fp8.record import recorder_for, wrap_cache_write

        wrap_cache_write(layer, recorder_for(kv_scales.record))
        return
    if normalize_fp8_dtype(str(layer.kv_cache_dtype)) is None or kv_scales.path is None:
        return  # a --kv-cache-dtype-skip-layers layer keeps bf16: scales do not apply
    source = choose_scale_source(
        checkpoint_has_scales(str(vllm_config.model_config.model)), True,
        kv_scales.override_checkpoint,
    )
    if source != "file":
        return
    name = str(layer.layer_name)
    entry = scales_file(kv_scales.path).layers.get(name)
    if entry is None:
        raise RuntimeError(
            f"kvops: kv_scales file {kv_scales.path} has no layer {name!r}: recalibrate this model"
        )
    set_layer_scales(layer, entry.k_scale, entry.v_scale)


def set_layer_scales(layer: Any, k_scale: float, v_scale: float) -> None:
    """Every copy of the scales vLLM reads: the tensors (GPU kernels), the floats (the CPU
    kernels, vllm/v1/attention/backends/cpu_attn.py ``k_scale=layer._k_scale_float``) and the
    host tensors (AITER); mirrors vllm/model_executor/layers/quantization/kv_cache.py."""
    layer._k_scale.fill_(k_scale)
    layer._v_scale.fill_(v_scale)
    layer._k_scale_float = k_scale
    layer._v_scale_float = v_scale
    layer._k_scale_cpu.fill_(k_scale)
    layer._v_scale_cpu.fill_(v_scale)
    if getattr(layer, "query_quant", None) is not None:
        # Backends that quantize the query use q_scale = k_scale when none is given (kv_cache.py).
        layer._q_scale.fill_(k_scale)
        layer._q_scale_float = k_scale


def reset_for_tests() -> None:
    scales_file.cache_clear()
    checkpoint_has_scales.cache_clear()
