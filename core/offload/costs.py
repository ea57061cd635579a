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

from kvops.core.errors import BadInputError
from kvops.core.files import read_mapping
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
        transfer_mode="lmcache_driven", l1_ttft_ratio=0.070, disk_ttft_ratio=0.082, miss_overhead_ratio=0.15,
        source="kvops bench offload --json with KVOPS_BENCH_OFFLOAD_TRANSFER_MODE=lmcache_driven, 2,048-token "
               "prompts, through the kvops connector (issue 16)"),
}
"""The built-in costs. LMCache's own connector measured less in lmcache_driven (no measurable
miss cost, research/offload_bench.md §4); these are ours, which the product runs."""

BENCH_KEYS = ("l1_ttft_ratio", "disk_ttft_ratio", "miss_overhead_ratio")


def read_bench_costs(path: Path, where: str = "--offload-costs") -> OffloadCosts:
    """The costs in a ``kvops bench offload --json`` document; a missing or non-numeric ratio
    or an unknown transfer mode exits 2 naming the file and the key."""
    doc = read_mapping(path, where)
    mode = doc.get("transfer_mode")
    if mode not in MEASURED:
        raise BadInputError(f"{where} {path}: transfer_mode {mode!r} is not engine_driven or lmcache_driven; "
                            "pass the JSON `kvops bench offload --json` printed")
    ratios: dict[str, float] = {}
    for key in BENCH_KEYS:
        value = doc.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise BadInputError(f"{where} {path}: {key} is {value!r}, not a number >= 0; pass the JSON "
                                "`kvops bench offload --json` printed")
        ratios[key] = float(value)
    prompt = doc.get("prompt_tokens")
    shape = f", {prompt}-token prompts" if isinstance(prompt, int) else ""
    return OffloadCosts(transfer_mode=mode, source=f"{path} (kvops bench offload --json, {mode}{shape})", **ratios)
