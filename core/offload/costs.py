"""What an offload hit and an offload miss cost, per transfer mode: measured, in one place.

``kvops plan --offload-mode`` weighs the prefill time offload hits save against what every miss
pays for the connector; both come from ``kvops bench offload --json`` (reference model, 32 KiB of
KV per token, 2,048-token prompts, on the 2-core CPU box) and are the only measured numbers the
decision uses. An operator who measured their own hardware passes that JSON with
``--offload-costs FILE`` instead (:func:`read_bench_costs`).

The ratios are what the bench reports: ``l1_ttft_ratio``/``disk_ttft_ratio`` are a whole-prompt
hit's TTFT over the *cold TTFT through the offload server* (so a hit token costs
ratio × (1 + miss overhead) of a token recomputed without a connector), and
``miss_overhead_ratio`` is cold TTFT with the connector over without, minus 1.

A hit ratio is the machine's, not the transfer's: the same load weighs more beside a faster
prefill (issue 43: 0.046 on one CPU, 0.18 on a faster one, at the same share of memcpy). So where
the figures that carry over are known (:class:`TransferFigures`: the load's share of memcpy, the
fixed time a hit pays besides it, and the measuring machine's memcpy and prefill rate),
:func:`scaled_costs` recomputes the hit ratios for the planned model: load = hit bytes /
(copy share × memcpy) + the fixed time, recompute = hit tokens / the prefill rate moved to the
model by FLOPs per token. The miss ratio stays as measured (in lmcache_driven it is the lookup,
below what the bench resolves).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from kvops.core import kinds
from kvops.core.errors import BadInputError
from kvops.core.kinds import read_mapping_of_kind
from kvops.core.offload.settings import TransferMode
from kvops.core.units import GIB, MIB


class TransferFigures(BaseModel):
    """What a load costs in figures that carry to another machine (``kvops bench offload``'s
    ``load_copy_fraction_of_memcpy`` and ``hit_overhead_s``), and the two of the machine that
    measured them (``memcpy_gb_per_s``, ``cold_prefill_tokens_per_s`` of a model of
    ``prefill_flops_per_token``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    l1_copy_fraction: float
    disk_copy_fraction: float
    l1_hit_overhead_s: float
    disk_hit_overhead_s: float
    memcpy_gb_per_s: float
    prefill_tokens_per_s: float
    prefill_flops_per_token: float
    floor_s: float | None = None
    """vLLM's own prefix-cache hit computing one token on the measuring machine (the bench's
    ``prefix_hit_ttft_s``): the share of the fixed time that is the step computing the last token,
    which reads every weight and the hit's KV once; None: not measured (an older bench file)."""
    floor_bytes: float | None = None
    """What that step read there: the bench model's weights and its prompt's KV."""


class OffloadCosts(BaseModel):
    """One transfer mode's measured costs, relative to recomputing the prompt."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)  # NaN/inf: never a setting

    transfer_mode: TransferMode
    l1_ttft_ratio: float
    disk_ttft_ratio: float
    miss_overhead_ratio: float
    source: str
    figures: TransferFigures | None = None
    """Set: the hit ratios can be recomputed for another model (:func:`scaled_costs`)."""
    derivation: str | None = None
    """How the hit ratios were had: recomputed from ``figures`` (the arithmetic), or why not."""


MEASURED: dict[str, OffloadCosts] = {
    "engine_driven": OffloadCosts(
        transfer_mode="engine_driven", l1_ttft_ratio=0.036, disk_ttft_ratio=0.046, miss_overhead_ratio=0.042,
        source="kvops bench offload --json, engine_driven with L1 shared through /dev/shm and kvops' copy in the "
               "worker (the default on a CPU since issue 43: auto), 2,048-token prompts, hits after one pass over "
               "the KV cache: the largest of three quiet runs' hit ratios, the largest of five runs' miss medians "
               "(README \"The floor under a hit\")",
        figures=TransferFigures(
            l1_copy_fraction=0.408, disk_copy_fraction=0.361, l1_hit_overhead_s=0.0519, disk_hit_overhead_s=0.0681,
            memcpy_gb_per_s=13.01, prefill_tokens_per_s=1157.6, prefill_flops_per_token=205_520_896.0,
            floor_s=0.0309, floor_bytes=276_867_288.0)),
    "lmcache_driven": OffloadCosts(
        transfer_mode="lmcache_driven", l1_ttft_ratio=0.058, disk_ttft_ratio=0.062, miss_overhead_ratio=0.039,
        source="kvops bench offload --json, zero-copy (lmcache_driven, auto's choice before issue 43), 2,048-token "
               "prompts, through the kvops connector, hits after one pass over the KV cache: the largest of three "
               "quiet runs' hit ratios, the largest of six runs' miss medians (issue 16, README \"The floor under "
               "a hit\")",
        figures=TransferFigures(
            l1_copy_fraction=0.120, disk_copy_fraction=0.154, l1_hit_overhead_s=0.0551, disk_hit_overhead_s=0.0478,
            memcpy_gb_per_s=13.01, prefill_tokens_per_s=1157.6, prefill_flops_per_token=205_520_896.0,
            floor_s=0.0309, floor_bytes=276_867_288.0)),
}
"""The built-in costs. engine_driven: three quiet runs (``KVOPS_BENCH_OFFLOAD_TUNING=0``) on a 2-core
AVX-512 box without AMX (README "The floor under a hit") gave L1 0.032, 0.034 and 0.036, disk 0.045,
0.039 and 0.046, misses +0.033, +0.028 and -0.049; the plan counts the largest hit ratios and the
largest miss median of those and the two runs before them (+0.032, +0.042). Its figures are the
third run's: loads at 41% (L1) and 36% (disk) of that box's 13.01 GB/s memcpy, a cold 2,048-token
prefill at 1,158 tokens/s of the reference model, 52 ms (L1) and 68 ms (disk) of a hit's TTFT
besides the load (the lookup, the queue, the step computing the last token), of which vLLM's own
one-token prefix-cache hit took 31 ms (the step reading the reference model's 209,758,424 bytes of
weights and its 2,048 tokens of KV, 276,867,288 bytes in all). The two runs of the session before,
on a box whose prefill was slower (768 tokens/s), gave L1 0.019 and 0.021 at 55% / 62% of memcpy:
the same transfer over a slower recompute. Before kvops' copy and the shared L1 it measured L1
0.19-0.27 (issue 16: each L1 object pickled through ZMQ). lmcache_driven: LMCache's own connector
measured less there (no measurable miss cost, research/offload_bench.md §4); these are ours, which
the product runs, measured beside engine_driven in the same three runs: L1 0.051, 0.052 and 0.058,
disk 0.062, 0.057 and 0.051, misses -0.006, -0.023 and -0.038 (issue 16's three: +0.039, -0.063,
-0.009, a spread that is the difference between two servers: the connector's own share, its
lookup, is ~0.3%; the plan counts the largest). Its figures are the third run's, beside
engine_driven's: loads at 12.0% (L1) and 15.4% (disk) of memcpy, 55 / 48 ms besides the load."""

FIGURE_KEYS = ("load_copy_fraction_of_memcpy", "hit_overhead_s", "memcpy_gb_per_s", "cold_prefill_tokens_per_s",
               "prefill_flops_per_token")
"""The bench keys :class:`TransferFigures` reads (the first two per tier: l1, disk)."""

BENCH_KEYS = ("l1_ttft_ratio", "disk_ttft_ratio", "miss_overhead_ratio")


def read_bench_costs(path: Path, where: str = "--offload-costs") -> OffloadCosts:
    """The costs in a ``kvops bench offload --json`` document; a missing or non-numeric ratio
    or an unknown transfer mode exits 2 naming the file and the key."""
    doc = read_mapping_of_kind(path, where, kinds.BENCH)
    mode = doc.get("transfer_mode")
    if mode not in MEASURED:
        raise BadInputError(f"{where} {path}: transfer_mode {mode!r} is not engine_driven or lmcache_driven; "
                            "pass the JSON `kvops bench offload --json` printed")
    ratios: dict[str, float] = {}
    for key in BENCH_KEYS:
        value = doc.get(key)
        # a miss measured faster with the connector than without is the bench's noise (two
        # servers differ by a few percent): > -1, counted as no cost; a hit ratio is >= 0
        miss = key == "miss_overhead_ratio"
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not (value > -1 if miss else value >= 0)):
            allowed = "a number > -1" if miss else "a number >= 0"
            raise BadInputError(f"{where} {path}: {key} is {value!r}, not {allowed}; pass the JSON "
                                "`kvops bench offload --json` printed")
        ratios[key] = float(value)
    prompt = doc.get("prompt_tokens")
    shape = f", {prompt}-token prompts" if isinstance(prompt, int) else ""
    noise = ""
    if ratios["miss_overhead_ratio"] < 0:
        noise = f"; its miss_overhead_ratio {ratios['miss_overhead_ratio']:+.3f} counted as 0"
        ratios["miss_overhead_ratio"] = 0.0
    figures, missing = _bench_figures(doc, path, where)
    derivation = None if figures else (f"the measured ratios: {path} has no {missing} (an older kvops bench "
                                       "offload); a newer one reports the figures that scale with the machine")
    return OffloadCosts(transfer_mode=mode, source=f"{path} (kvops bench offload --json, {mode}{shape}{noise})",
                        figures=figures, derivation=derivation, **ratios)


def _bench_figures(doc: dict[str, Any], path: Path, where: str) -> tuple[TransferFigures | None, str]:
    """The file's TransferFigures, or None and the first key it lacks (a file of an older kvops,
    or a run whose connector counted no load); a key present with a bad value exits 2."""
    values: dict[str, float] = {}
    for key, field_name, tier in (
            ("load_copy_fraction_of_memcpy", "l1_copy_fraction", "l1"),
            ("load_copy_fraction_of_memcpy", "disk_copy_fraction", "disk"),
            ("hit_overhead_s", "l1_hit_overhead_s", "l1"), ("hit_overhead_s", "disk_hit_overhead_s", "disk"),
            ("memcpy_gb_per_s", "memcpy_gb_per_s", None), ("cold_prefill_tokens_per_s", "prefill_tokens_per_s", None),
            ("prefill_flops_per_token", "prefill_flops_per_token", None)):
        value = doc.get(key)
        name = key
        if tier is not None:
            value = value.get(tier) if isinstance(value, dict) else None
            name = f"{key}.{tier}"
        if value is None:
            return None, name
        values[field_name] = _number(value, name, path, where, zero_ok=key == "hit_overhead_s")
    return TransferFigures(**values, **_bench_floor(doc, path, where)), ""


def _bench_floor(doc: dict[str, Any], path: Path, where: str) -> dict[str, float]:
    """``floor_s`` and ``floor_bytes`` from a bench file that measured vLLM's own one-token hit
    (``prefix_hit_ttft_s``, with ``weight_bytes``, ``prompt_tokens`` and ``kv_bytes_per_token``);
    none from an older one; a key present with a bad value exits 2."""
    keys = ("prefix_hit_ttft_s", "weight_bytes", "prompt_tokens", "kv_bytes_per_token")
    if any(doc.get(key) is None for key in keys):
        return {}
    floor_s, weights, tokens, per_token = (_number(doc[key], key, path, where) for key in keys)
    return {"floor_s": floor_s, "floor_bytes": weights + tokens * per_token}


def _number(value: Any, name: str, path: Path, where: str, zero_ok: bool = False) -> float:
    """A bench file's figure: a finite number > 0 (>= 0 with ``zero_ok``), else exit 2 naming it."""
    if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            or not (value >= 0 if zero_ok else value > 0)):
        raise BadInputError(f"{where} {path}: {name} is {value!r}, not a number {'>=' if zero_ok else '>'} 0; "
                            "pass the JSON `kvops bench offload --json` printed")
    return float(value)


def scaled_costs(costs: OffloadCosts, kv_bytes_per_token: int, flops_per_token: float,
                 hit_tokens: float, weight_bytes: float | None = None) -> OffloadCosts:
    """``costs`` with its hit ratios recomputed for a model of ``kv_bytes_per_token`` and
    ``flops_per_token`` whose hits load ``hit_tokens`` tokens, on the machine that measured the
    figures: load = bytes / (copy share × memcpy) + the fixed time, recompute = tokens / (its
    prefill rate × its FLOPs per token / this model's). Without figures: unchanged. The ratio is
    against a prefill without the connector, where a measured one is against the offload server's
    cold TTFT: the planner's × (1 + miss overhead) then counts the miss cost on it once more, a
    conservative few percent.

    The fixed time holds the step that computes the last token, vLLM's own one-token hit
    (``floor_s``), which reads the weights and the hit's KV once. With ``weight_bytes`` (one rank's)
    and a measured floor, that share grows with the bytes this model's step reads over the bench
    model's (never below the measured: its front-end share does not shrink); else it stays as
    measured, which a model much larger than the bench's would understate."""
    fig = costs.figures
    if fig is None or flops_per_token <= 0 or hit_tokens <= 0:
        return costs
    rate = fig.prefill_tokens_per_s * fig.prefill_flops_per_token / flops_per_token
    recompute_s = hit_tokens / rate
    moved = hit_tokens * kv_bytes_per_token
    bandwidth = fig.memcpy_gb_per_s * 1e9
    step_s, step = _step_growth(fig, weight_bytes, moved)

    def load_s(fraction: float, overhead_s: float) -> float:
        return moved / (fraction * bandwidth) + overhead_s + step_s

    l1, disk = load_s(fig.l1_copy_fraction, fig.l1_hit_overhead_s), load_s(fig.disk_copy_fraction, fig.disk_hit_overhead_s)
    derivation = (
        f"recomputed for this model on the measuring machine: a hit of {hit_tokens:,.0f} tokens loads "
        f"{moved / MIB:,.1f} MiB at {fig.l1_copy_fraction:.1%} (L1) / {fig.disk_copy_fraction:.1%} (disk) of "
        f"{fig.memcpy_gb_per_s:.1f} GB/s memcpy, plus {fig.l1_hit_overhead_s * 1e3:.0f} / "
        f"{fig.disk_hit_overhead_s * 1e3:.0f} ms fixed per hit{step}: {l1 * 1e3:,.1f} / {disk * 1e3:,.1f} ms; "
        f"recomputing it takes {recompute_s * 1e3:,.1f} ms at {rate:,.1f} tokens/s ({fig.prefill_tokens_per_s:,.0f} "
        f"tokens/s measured at {fig.prefill_flops_per_token:.3g} FLOPs per token, this model {flops_per_token:.3g})")
    return costs.model_copy(update={"l1_ttft_ratio": l1 / recompute_s, "disk_ttft_ratio": disk / recompute_s,
                                    "derivation": derivation})


def _step_growth(fig: TransferFigures, weight_bytes: float | None, hit_kv_bytes: float) -> tuple[float, str]:
    """(seconds the last token's step adds over the bench model's, the derivation's words)."""
    if fig.floor_s is None or fig.floor_bytes is None:
        return 0.0, " (the step computing the last token as measured: the figures have no one-token hit)"
    if not weight_bytes:
        return 0.0, " (the step computing the last token as measured: this model's weights are not known)"
    reads = weight_bytes + hit_kv_bytes
    scale = max(1.0, reads / fig.floor_bytes)
    added = fig.floor_s * (scale - 1.0)
    return added, (f", of which vLLM's own one-token hit {fig.floor_s * 1e3:.0f} ms for the "
                   f"{fig.floor_bytes / GIB:.2f} GiB its step read; this model's step reads {reads / GIB:.2f} GiB "
                   f"(weights and the hit's KV): {fig.floor_s * scale * 1e3:,.0f} ms, so in all")
