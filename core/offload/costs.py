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
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from kvops.core import kinds
from kvops.core.errors import BadInputError
from kvops.core.kinds import read_mapping_of_kind
from kvops.core.offload.settings import TransferMode


class OffloadCosts(BaseModel):
    """One transfer mode's measured costs, relative to recomputing the prompt."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)  # NaN/inf: never a setting

    transfer_mode: TransferMode
    l1_ttft_ratio: float
    disk_ttft_ratio: float
    miss_overhead_ratio: float
    source: str


MEASURED: dict[str, OffloadCosts] = {
    "engine_driven": OffloadCosts(
        transfer_mode="engine_driven", l1_ttft_ratio=0.27, disk_ttft_ratio=0.25, miss_overhead_ratio=0.27,
        source="kvops bench offload --json, engine_driven, 2,048-token prompts (DESIGN.md 'Measured on the "
               "landed product'; issue 16)"),
    "lmcache_driven": OffloadCosts(
        transfer_mode="lmcache_driven", l1_ttft_ratio=0.046, disk_ttft_ratio=0.056, miss_overhead_ratio=0.039,
        source="kvops bench offload --json, the default mode (auto: lmcache_driven), 2,048-token prompts, "
               "through the kvops connector, hits after one pass over the KV cache: the larger of two quiet "
               "runs' hit ratios, the largest of three runs' miss medians (issue 16)"),
}
"""The built-in costs. LMCache's own connector measured less in lmcache_driven (no measurable
miss cost, research/offload_bench.md §4); these are ours, which the product runs. engine_driven:
the figures issue 16 quoted (later runs measured L1 0.19, disk 0.19, miss +0.15 to +0.25).
lmcache_driven: two quiet full runs on a 2-core AVX-512 box (README) gave L1 0.046 and 0.042,
disk 0.055 and 0.056; the miss medians of three were +0.039, -0.063 and -0.009, a spread that is
the difference between two servers (the connector's own share, its lookup, is ~0.3%), so the
plan counts the largest."""

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
    return OffloadCosts(transfer_mode=mode, source=f"{path} (kvops bench offload --json, {mode}{shape}{noise})",
                        **ratios)
