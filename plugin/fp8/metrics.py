"""``kvops_fp8_*`` on vLLM's /metrics: is fp8 KV active, which scales won, and their values.

Published once from the front end (the stat-logger plugin, plugin/stats.py). The plan comes
from the same pure functions the workers use (kvops.core.fp8.scales), so what is shown is what the
workers applied; a scales file is re-read here, it was validated before the engine started.
"""

from __future__ import annotations

from typing import Any

from kvops.core.fp8.settings import KvScalesSettings
from kvops.plugin.fp8.validate import plan_fp8
from kvops.plugin.metrics import gauge

SOURCES = ("file", "checkpoint", "default")


def publish_fp8(vllm_config: Any, kv_scales: KvScalesSettings | None) -> None:
    """kvops_fp8_active, kvops_fp8_scale_source{source,dtype}, kvops_fp8_{k,v}_scale{layer}."""
    plan = plan_fp8(vllm_config, kv_scales, on_cpu=False)  # the ISA was checked at start-up
    active = gauge("kvops_fp8_active", "1 when the KV cache is stored in fp8, else 0")
    active.set(1 if plan is not None else 0)
    if plan is None:
        return
    source = gauge(
        "kvops_fp8_scale_source",
        "Which fp8 KV scales are in effect: file (kvops calibrate), checkpoint, default (1.0)",
        ("source", "dtype"),
    )
    for name in SOURCES:
        source.labels(source=name, dtype=plan.dtype).set(1 if name == plan.source else 0)
    k_scale = gauge("kvops_fp8_k_scale", "fp8 K scale per attention layer", ("layer",))
    v_scale = gauge("kvops_fp8_v_scale", "fp8 V scale per attention layer", ("layer",))
    if plan.source == "file" and plan.scales is not None:
        for layer, scales in plan.scales.layers.items():
            k_scale.labels(layer=layer).set(scales.k_scale)
            v_scale.labels(layer=layer).set(scales.v_scale)
    elif plan.source == "default":
        k_scale.labels(layer="all").set(1.0)
        v_scale.labels(layer="all").set(1.0)
