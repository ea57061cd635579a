"""Recording mode: observe the K and V each attention layer writes to its cache.

``kvops calibrate`` starts a server with ``{"kv_scales": {"record": DIR}}``. Every worker wraps
each attention layer's cache write and keeps, per layer, the exact absmax of K and V, a token
count and a bounded random sample of values (for the quantization error). A daemon thread
writes ``stats-<pid>.json`` and ``samples-<pid>.pt`` under DIR about once a second, atomically,
so the calibrating process can read them while the server runs and after it is stopped.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from kvops.plugin.loops import ResilientLoop

SAMPLE_PER_LAYER = 32768
"""Values kept per layer and per K/V for the error estimate: enough for a stable RMS."""
TAKE_PER_CALL = 4096
FLUSH_INTERVAL_S = 0.5


class KvRecorder:
    """Per-process accumulator; one instance per worker (see ``recorder_for``)."""

    def __init__(self, out_dir: Path) -> None:
        import torch

        self.out_dir = out_dir
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._stats: dict[str, dict[str, float]] = {}
        self._samples: dict[str, dict[str, Any]] = {}
        self._gen = torch.Generator().manual_seed(os.getpid())
        self._dirty = False
        # A flush that fails (disk full) is counted and retried; it never ends the thread.
        ResilientLoop("kvops-kv-recorder", {"fp8_recorder": self.flush}, FLUSH_INTERVAL_S).start()

    def observe(self, layer_name: str, key: Any, value: Any) -> None:
        """Fold one cache write (rows = tokens) into the layer's statistics."""
        k = key.detach().float().reshape(-1).cpu()
        v = value.detach().float().reshape(-1).cpu()
        if k.numel() == 0:
            return
        tokens = int(key.shape[0])
        with self._lock:
            stat = self._stats.setdefault(layer_name, {"k_absmax": 0.0, "v_absmax": 0.0, "tokens": 0})
            stat["k_absmax"] = max(stat["k_absmax"], float(k.abs().max()))
            stat["v_absmax"] = max(stat["v_absmax"], float(v.abs().max()))
            stat["tokens"] += tokens
            sample = self._samples.setdefault(layer_name, {})
            sample["k"] = self._fold(sample.get("k"), k)
            sample["v"] = self._fold(sample.get("v"), v)
            self._dirty = True

    def _fold(self, kept: Any, new: Any) -> Any:
        import torch

        pick = torch.randint(0, new.numel(), (min(TAKE_PER_CALL, new.numel()),), generator=self._gen)
        merged = new[pick] if kept is None else torch.cat([kept, new[pick]])
        if merged.numel() > SAMPLE_PER_LAYER:
            keep = torch.randperm(merged.numel(), generator=self._gen)[:SAMPLE_PER_LAYER]
            merged = merged[keep]
        return merged

    def flush(self) -> None:
        import torch

        with self._lock:
            if not self._dirty:
                return
            stats = {name: dict(stat) for name, stat in self._stats.items()}
            samples = {name: dict(s) for name, s in self._samples.items()}
            self._dirty = False
        pid = os.getpid()
        tmp = self.out_dir / f".samples-{pid}.pt.tmp"
        torch.save(samples, tmp)
        os.replace(tmp, self.out_dir / f"samples-{pid}.pt")
        tmp = self.out_dir / f".stats-{pid}.json.tmp"
        tmp.write_text(json.dumps({"pid": pid, "layers": stats}))
        os.replace(tmp, self.out_dir / f"stats-{pid}.json")


_RECORDER: KvRecorder | None = None


def recorder_for(out_dir: str) -> KvRecorder:
    """The process's recorder (created on first use)."""
    global _RECORDER
    if _RECORDER is None or _RECORDER.out_dir != Path(out_dir):
        _RECORDER = KvRecorder(Path(out_dir))
    return _RECORDER


def wrap_cache_write(layer: Any, recorder: KvRecorder) -> None:
    """Observe every K/V this layer writes to its cache, then write it as before.

    vLLM calls ``layer.impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)``
    (vllm/model_executor/layers/attention/attention.py ``unified_kv_cache_update``) for backends
    whose forward does not include the update (CPU_ATTN among them); rows whose slot is
    negative are padding the kernel skips, so we skip them too. Backends that write the cache
    inside forward (``forward_includes_kv_cache_update``) get their forward wrapped instead.
    """
    impl = layer.impl
    if getattr(impl, "_kvops_recording", False):
        return
    name = str(layer.layer_name)
    if not getattr(layer.attn_backend, "forward_includes_kv_cache_update", False):
        original = impl.do_kv_cache_update

        def do_kv_cache_update(lyr: Any, key: Any, value: Any, kv_cache: Any, slots: Any) -> Any:
            valid = slots >= 0
            rows = int(slots.shape[0])
            recorder.observe(name, key[:rows][valid], value[:rows][valid])
            return original(lyr, key, value, kv_cache, slots)

        impl.do_kv_cache_update = do_kv_cache_update
    else:
        original_forward = impl.forward

        def forward(lyr: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
            attn_metadata = args[1] if len(args) > 1 else kwargs.get("attn_metadata")
            if key is not None and attn_metadata is not None:
                rows = int(getattr(attn_metadata, "num_actual_tokens", key.shape[0]))
                recorder.observe(name, key[:rows], value[:rows])
            return original_forward(lyr, query, key, value, *args, **kwargs)

        impl.forward = forward
    impl._kvops_recording = True
