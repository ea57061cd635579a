"""The textbook view: bytes = Σ_layers bytes_per_token × Σ tokens, per layer group.

This is what people compute by hand (2 · layers · kv_heads · head_dim · bytes per token); it
ignores blocks and the allocator, so it answers "how much KV do these requests hold", not
"how many fit" (that is ``allocator.kv_capacity``). Sliding layers hold at most the window,
chunked layers at most one chunk, and mamba layers a fixed state per request.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvops.core.errors import BadInputError
from kvops.ops.capacity.constants import GB, GIB
from kvops.ops.capacity.model import ModelKV


def _held_tokens(kind: str, window: int | None, tokens: int) -> int:
    if kind in ("sliding", "chunked") and window is not None:
        return min(tokens, window)
    return tokens


def request_bytes(model: ModelKV, tokens: int) -> int:
    """KV bytes one request of ``tokens`` tokens holds on this rank (no block rounding)."""
    total = 0
    for layer in model.layers:
        if layer.kind == "mamba":
            total += layer.state_bytes
        else:
            total += layer.bytes_per_token * _held_tokens(layer.kind, layer.window, tokens)
    return total


def kv_formula(model: ModelKV, lengths: Sequence[int], batch: int = 0, seq_len: int = 0) -> dict[str, object]:
    """Per-group bytes/token, then Σ over the given request lengths and over B × L."""
    if any(n < 0 for n in lengths) or batch < 0 or seq_len < 0:
        raise BadInputError("request lengths, --batch and --seq-len must be >= 0")
    groups: dict[str, dict[str, object]] = {}
    for layer in model.layers:
        key = layer.kind if layer.window is None else f"{layer.kind}(window={layer.window})"
        if layer.role != "kv":
            key = f"{key}-{layer.role}"  # the sparse-MLA indexer: its own bytes per token
        entry = groups.setdefault(key, {"layers": 0, "bytes_per_token_per_layer": layer.bytes_per_token,
                                        "state_bytes_per_layer": layer.state_bytes})
        entry["layers"] = int(str(entry["layers"])) + 1
    out: dict[str, object] = {
        "kv_dtype": model.kv_dtype,
        "groups": groups,
        "kv_bytes_per_token": model.kv_bytes_per_token,
    }
    if lengths:
        total = sum(request_bytes(model, n) for n in lengths)
        out["requests"] = _sizes({"tokens": sum(lengths), "count": len(lengths)}, total)
    if batch and seq_len:
        out["batch"] = _sizes({"batch": batch, "seq_len": seq_len}, batch * request_bytes(model, seq_len))
    return out


def _sizes(head: dict[str, int], total: int) -> dict[str, object]:
    return {**head, "bytes": total, "gib": total / GIB, "gb": total / GB}
