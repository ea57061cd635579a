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
from kvops.core.units import MIB


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
        transfer_mode="engine_driven", l1_ttft_ratio=0.021, disk_ttft_ratio=0.027, miss_overhead_ratio=0.042,
        source="kvops bench offload --json, engine_driven with L1 shared through /dev/shm and kvops' copy in the "
               "worker (the default on a CPU since issue 43: auto), 2,048-token prompts, hits after one pass over "
               "the KV cache: the larger of two quiet runs' ratios (README \"kvops' copy in the worker\")",
        figures=TransferFigures(
            l1_copy_fraction=0.550, disk_copy_fraction=0.616, l1_hit_overhead_s=0.048, disk_hit_overhead_s=0.057,
            memcpy_gb_per_s=11.24, prefill_tokens_per_s=768.3, prefill_flops_per_token=205_520_896.0)),
    "lmcache_driven": OffloadCosts(
        transfer_mode="lmcache_driven", l1_ttft_ratio=0.046, disk_ttft_ratio=0.056, miss_overhead_ratio=0.039,
        source="kvops bench offload --json, zero-copy (lmcache_driven, auto's choice before issue 43), 2,048-token "
               "prompts, through the kvops connector, hits after one pass over the KV cache: the larger of two "
               "quiet runs' hit ratios, the largest of three runs' miss medians (issue 16)",
        figures=TransferFigures(
            l1_copy_fraction=0.138, disk_copy_fraction=0.138, l1_hit_overhead_s=0.035, disk_hit_overhead_s=0.050,
            memcpy_gb_per_s=14.5, prefill_tokens_per_s=1280.0, prefill_flops_per_token=205_520_896.0)),
}
"""The built-in costs. engine_driven: two quiet full runs (``KVOPS_BENCH_OFFLOAD_TRANSFER_MODE=
engine_driven``) on a 2-core AVX-512 box without AMX (README "kvops' copy in the worker") gave L1
0.019 and 0.021, disk 0.027 and 0.024, misses +0.032 and +0.042 (spread 0.04-0.06: the plan counts
the larger); its figures are the second run's: loads at 55% (L1) and 62% (disk) of that box's
11.24 GB/s memcpy, a cold 2,048-token prefill at 768 tokens/s of the reference model, and 48 ms (L1)
and 57 ms (disk) of a hit's TTFT besides the load (the lookup, the queue, the step computing the
last token). Before kvops' copy and the shared L1 it measured L1 0.19-0.27 (issue 16: each L1
object pickled through ZMQ). lmcache_driven: LMCache's own connector measured less there (no
measurable miss cost, research/offload_bench.md §4); these are ours, which the product runs. Two
quiet full runs on a 2-core AVX-512 box (README) gave L1 0.046 and 0.042, disk 0.055 and 0.056;
the miss medians of three were +0.039, -0.063 and -0.009, a spread that is the difference between
two servers (the connector's own share, its lookup, is ~0.3%), so the plan counts the largest. Its
figures are the README's steady-state run on that box (quiet, /dev/shm without huge pages): loads
at 13.8% of memcpy (2.0 GB/s of 14.5; one share for both tiers, the run counted them together), a
cold 2,048-token prefill in 1.60 s (1,280 tokens/s of the reference model, 205,520,896 FLOPs per
token), and the hits' TTFT (0.046 and 0.056 of the 1.50 s cold TTFT through the offload server: 69
and 84 ms) less the 34 ms load of their 64 MiB: 35 ms (L1) and 50 ms (disk) fixed per hit."""

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
        zero_ok = key == "hit_overhead_s"
        if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
                or not (value >= 0 if zero_ok else value > 0)):
            raise BadInputError(f"{where} {path}: {name} is {value!r}, not a number {'>=' if zero_ok else '>'} 0; "
                                "pass the JSON `kvops bench offload --json` printed")
        values[field_name] = float(value)
    return TransferFigures(**values), ""


def scaled_costs(costs: OffloadCosts, kv_bytes_per_token: int, flops_per_token: float,
                 hit_tokens: float) -> OffloadCosts:
    """``costs`` with its hit ratios recomputed for a model of ``kv_bytes_per_token`` and
    ``flops_per_token`` whose hits load ``hit_tokens`` tokens, on the machine that measured the
    figures: load = bytes / (copy share × memcpy) + the fixed time, recompute = tokens / (its
    prefill rate × its FLOPs per token / this model's). Without figures: unchanged. The ratio is
    against a prefill without the connector, where a measured one is against the offload server's
    cold TTFT: the planner's × (1 + miss overhead) then counts the miss cost on it once more, a
    conservative few percent."""
    fig = costs.figures
    if fig is None or flops_per_token <= 0 or hit_tokens <= 0:
        return costs
    rate = fig.prefill_tokens_per_s * fig.prefill_flops_per_token / flops_per_token
    recompute_s = hit_tokens / rate
    moved = hit_tokens * kv_bytes_per_token
    bandwidth = fig.memcpy_gb_per_s * 1e9

    def load_s(fraction: float, overhead_s: float) -> float:
        return moved / (fraction * bandwidth) + overhead_s

    l1, disk = load_s(fig.l1_copy_fraction, fig.l1_hit_overhead_s), load_s(fig.disk_copy_fraction, fig.disk_hit_overhead_s)
    derivation = (
        f"recomputed for this model on the measuring machine: a hit of {hit_tokens:,.0f} tokens loads "
        f"{moved / MIB:,.1f} MiB at {fig.l1_copy_fraction:.1%} (L1) / {fig.disk_copy_fraction:.1%} (disk) of "
        f"{fig.memcpy_gb_per_s:.1f} GB/s memcpy, plus {fig.l1_hit_overhead_s * 1e3:.0f} / "
        f"{fig.disk_hit_overhead_s * 1e3:.0f} ms fixed per hit: {l1 * 1e3:,.1f} / {disk * 1e3:,.1f} ms; recomputing "
        f"it takes {recompute_s * 1e3:,.1f} ms at {rate:,.1f} tokens/s ({fig.prefill_tokens_per_s:,.0f} tokens/s "
        f"measured at {fig.prefill_flops_per_token:.3g} FLOPs per token, this model {flops_per_token:.3g})")
    return costs.model_copy(update={"l1_ttft_ratio": l1 / recompute_s, "disk_ttft_ratio": disk / recompute_s,
                                    "derivation": derivation})
