"""JSON assembly of ``kvops bench offload``: one variant's ratios, both modes, the tuning table.

Pure functions over what the bench measured (no server), so the contract keys are unit-tested:
the default variant's ratios are the top-level keys (DESIGN.md), ``modes`` holds the same ratio
keys per transfer mode, ``tuning`` one row per knob tried, each against the default measured in
the same run. Outputs are judged as the chaos bench judges them (ops/bench/greedy.py): a text
that differs from the no-connector server's is a tie flip when that server finds every token of
it within a near-tie of its best (the tiny random model's ties flip with batch and prefix split),
wrong otherwise; ``outputs_correct`` is true when every difference is a tie flip.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from kvops.ops.bench.greedy import Judged, tally
from kvops.ops.bench.offload_figures import Loads, goals, load_figures
from kvops.ops.bench.paired import block_ratios

Gaps = dict[str, list[tuple[float, ...] | None]]
"""tier -> per prompt of a pass: the no-connector server's per-token gaps (its best logprob minus
the token's, ops/bench/greedy.py) of the offload server's text, scored where that text differs
from the no-connector server's own (None: not scored)."""

OUTPUT_KEYS = ("outputs_identical", "outputs_correct", "tie_flips", "wrong_outputs", "max_logprob_gap",
               "split_matched_outputs")
"""What a pass, a variant and a tuning row say about the greedy texts."""

FIGURE_KEYS = ("load_ms_per_mib", "memcpy_ms_per_mib", "load_copy_fraction_of_memcpy", "load_mib_per_hit",
               "load_s_per_hit", "hit_overhead_s", "server_page_faults_per_mib", "hit_over_prefix_hit_s",
               "offload_overhead_s")
"""The load's own figures, which carry over to another machine (ops/bench/offload_figures.py)."""

RATIO_KEYS = ("l1_ttft_ratio", "disk_ttft_ratio", "miss_overhead_ratio", "copy_fraction_of_memcpy")
"""The keys a mode and a tuning row carry (lower is better, except the copy fraction, which the
verdict of a tuning row leaves out: it has no samples to tell an effect from noise)."""


@dataclass(frozen=True)
class FirstPass:
    """The tiers measured on the fresh offload server, before vLLM had handed out every KV block
    once: runs and baseline as in ``Measured``, the connector's load rate over the pass, the
    LMCache server's minor page faults per hit (tier -> [per prompt]), the differing texts'
    gaps."""

    runs: dict[str, list[tuple[float, str]]]
    baseline: list[tuple[float, str]]
    load_gb_per_s: float
    server_faults: dict[str, list[int]] = field(default_factory=dict)
    gaps: Gaps = field(default_factory=dict)
    loads: Loads = field(default_factory=dict)
    split_baseline: list[str] = field(default_factory=list)
    """As in ``Measured``."""


@dataclass(frozen=True)
class Measured:
    """One offload server's measurements (a variant), beside the shared no-connector server.

    runs: tier -> [(TTFT s, greedy text)] for cold / l1 / disk; baseline: the no-connector
    server's [(TTFT s, text)] on the same prompts; misses: {"baseline", "offload"} cold TTFTs in
    ABBA order; hits: tier -> LMCache hit tokens summed over the runs; load/store GB/s from the
    connector's own counters."""

    transfer_mode: str
    runs: dict[str, list[tuple[float, str]]]
    baseline: list[tuple[float, str]]
    misses: dict[str, list[float]]
    hits: dict[str, float]
    load_gb_per_s: float
    store_gb_per_s: float
    settings: dict[str, Any] = field(default_factory=dict)
    miss_split: dict[str, dict[str, float | None]] = field(default_factory=dict)
    """{"no_connector", "offload"} -> vLLM's own mean queue / prefill / TTFT seconds of the miss
    requests (its histograms, read before and after the miss blocks)."""
    hit_split: dict[str, dict[str, float | None]] = field(default_factory=dict)
    """{"l1", "disk"} -> the same of the offload server's hits."""
    server_faults: dict[str, list[int]] = field(default_factory=dict)
    """tier -> the LMCache server's minor page faults during each hit."""
    first_pass: FirstPass | None = None
    gaps: Gaps = field(default_factory=dict)
    """The differing texts of ``runs``, scored by the no-connector server."""
    l1_transfer: str = ""
    """engine_driven: "shm" (the worker copies from L1 in /dev/shm) or "pickled"; "" otherwise
    (kvops_info's offload_l1_transfer label)."""
    loads: Loads = field(default_factory=dict)
    """tier -> per hit: (bytes, seconds) the connector counted for its load."""
    worker_copy: str = ""
    """engine_driven: the worker's copy, "kvops" or "lmcache" (kvops_offload_worker_copy); ""
    otherwise."""
    split_baseline: list[str] = field(default_factory=list)
    """A plugin-free server's text on each prompt of ``baseline`` when its prefill is split where
    a full hit splits it (all but the last token, then that token: ``offload.SPLIT_ARGS``); what an
    L1 or disk hit may equal instead where this CPU computes a split prefill differently (empty:
    not measured)."""
    prefix_hits: list[float] = field(default_factory=list)
    """The no-connector server's TTFT on each prompt of ``baseline`` and one token more, served at
    once after it: vLLM's own prefix-cache hit computing one token, the floor under an offload hit
    (empty: not measured)."""


def tier_ratios(runs: dict[str, list[tuple[float, str]]]) -> dict[str, Any]:
    """Median hit TTFT / median cold TTFT per tier, and the same per prompt."""
    median = {tier: statistics.median(t for t, _ in runs[tier]) for tier in runs}
    per_prompt = {tier: [t / cold for (t, _), (cold, _) in zip(runs[tier], runs["cold"], strict=True)]
                  for tier in ("l1", "disk")}
    return {"l1_ttft_ratio": median["l1"] / median["cold"],
            "disk_ttft_ratio": median["disk"] / median["cold"],
            "l1_ttft_ratio_per_prompt": per_prompt["l1"],
            "disk_ttft_ratio_per_prompt": per_prompt["disk"],
            "ttft_s": median}


@dataclass(frozen=True)
class Output(Judged):
    """One tier's greedy text on one prompt of a pass, beside the no-connector server's."""

    tier: str
    prompt: int
    """The prompt's index in its pass."""
    text: str | None
    expected: tuple[str, ...]
    gaps: tuple[float, ...] | None = None


def outputs(measured: FirstPass | Measured) -> list[Output]:
    """Every tier's text on every prompt of a pass, judged against the no-connector server's text
    on the same prompt, with its gaps where they were scored."""

    def gap(tier: str, index: int) -> tuple[float, ...] | None:
        per_prompt = measured.gaps.get(tier, [])
        return per_prompt[index] if index < len(per_prompt) else None

    def expected(tier: str, index: int) -> tuple[str, ...]:
        split = measured.split_baseline
        same_split = (split[index],) if tier != "cold" and index < len(split) else ()
        return (measured.baseline[index][1], *same_split)

    return [Output(tier, index, text, expected(tier, index), gap(tier, index))
            for tier, runs in measured.runs.items() for index, (_, text) in enumerate(runs)]


def _differs(output: Output) -> bool:
    """The text is not the no-connector server's unsplit one (it may still be its split one)."""
    return output.text is not None and output.text != output.expected[0]


def output_checks(judged: list[Output]) -> dict[str, Any]:
    """OUTPUT_KEYS over ``judged``: identical (no text differs from the unsplit one), correct
    (every difference the same-split text or a tie flip), the counts and the largest gap scored."""
    counts = tally(judged)
    return {"outputs_identical": not any(_differs(output) for output in judged),
            "outputs_correct": counts["wrong_outputs"] == 0, **counts,
            "split_matched_outputs": sum(_differs(output) and not output.unexpected for output in judged)}


def differing_outputs(passes: dict[str, list[Output]]) -> list[dict[str, Any]]:
    """Each text that differs from the no-connector server's, named by pass, tier and prompt."""
    return [{"pass": name, "tier": output.tier, "prompt": output.prompt, "got": output.text,
             "expected": output.expected[0], "logprob_gaps": output.gaps,
             "verdict": "split_matched" if not output.unexpected else "tie_flip" if output.tie_flip else "wrong"}
            for name, judged in passes.items() for output in judged if _differs(output)]


def faults_per_load(faults: dict[str, list[int]]) -> dict[str, float | None]:
    """Median page faults per hit, per tier (None: not counted)."""
    return {tier: statistics.median(counts) if counts else None for tier, counts in faults.items()}


def first_pass_result(first: FirstPass, memcpy_gb_per_s: float) -> dict[str, Any]:
    """What ``first_pass`` shows: the hit ratios, copy fraction and page faults of the fresh server."""
    ratios = tier_ratios(first.runs)
    faults = faults_per_load(first.server_faults)
    return {
        **ratios,
        "copy_fraction_of_memcpy": first.load_gb_per_s / memcpy_gb_per_s,
        "server_page_faults_per_load": faults,
        **load_figures(first.loads, ratios["ttft_s"], faults, memcpy_gb_per_s),
        **output_checks(outputs(first)),
    }


def miss_block_ratios(ttfts: dict[str, list[float]]) -> list[float]:
    """Per ABBA block: offload / no-connector cold TTFT - 1 (two rounds per side per block)."""
    return [ratio - 1 for ratio in block_ratios(ttfts["baseline"], ttfts["offload"])]


def spread(values: list[float]) -> dict[str, float]:
    """Min, quartiles and max (the quartiles interpolate; with 4 blocks they are ~ the 2nd and
    3rd smallest)."""
    low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    return {"min": min(values), "q1": low, "q3": high, "max": max(values)}


def variant_result(m: Measured, memcpy_gb_per_s: float) -> dict[str, Any]:
    """The ratio keys and raw figures of one variant (the top-level keys for the default); its
    OUTPUT_KEYS and ``differing_outputs`` cover both passes, ``first_pass``'s the first alone."""
    ratios = tier_ratios(m.runs)
    blocks = miss_block_ratios(m.misses)
    first = first_pass_result(m.first_pass, memcpy_gb_per_s) if m.first_pass else None
    passes = {"measured": outputs(m), **({"first": outputs(m.first_pass)} if m.first_pass else {})}
    repeats = len(m.runs["cold"])
    faults = faults_per_load(m.server_faults)
    prefix_hit = statistics.median(m.prefix_hits) if m.prefix_hits else None
    cold = statistics.median(t for t, _ in m.baseline)
    return {
        "l1_ttft_ratio": ratios["l1_ttft_ratio"],
        "disk_ttft_ratio": ratios["disk_ttft_ratio"],
        "miss_overhead_ratio": statistics.median(blocks),
        "miss_overhead_spread": spread(blocks),
        "miss_overhead_blocks": blocks,
        "l1_ttft_ratio_per_prompt": ratios["l1_ttft_ratio_per_prompt"],
        "disk_ttft_ratio_per_prompt": ratios["disk_ttft_ratio_per_prompt"],
        "miss_ttft_s": {"no_connector": statistics.median(m.misses["baseline"]),
                        "offload": statistics.median(m.misses["offload"])},
        "miss_time_split_s": m.miss_split,
        "hit_time_split_s": m.hit_split,
        "copy_fraction_of_memcpy": m.load_gb_per_s / memcpy_gb_per_s,
        # lmcache_driven stores are submitted in the step and copied later by the server, so the
        # step time says nothing about copy speed there.
        "store_fraction_of_memcpy": (m.store_gb_per_s / memcpy_gb_per_s
                                     if m.transfer_mode == "engine_driven" else None),
        **output_checks([output for judged in passes.values() for output in judged]),
        "differing_outputs": differing_outputs(passes),
        "repeats": repeats,
        "transfer_mode": m.transfer_mode,
        "l1_transfer": m.l1_transfer,
        "worker_copy_used": m.worker_copy,  # not "worker_copy": the top level's copy timings
        "ttft_s": {**ratios["ttft_s"], "no_connector": statistics.median(m.misses["baseline"])},
        "hit_tokens_per_request": {tier: hits / repeats for tier, hits in m.hits.items()},
        "load_gb_per_s": m.load_gb_per_s,
        "store_gb_per_s": m.store_gb_per_s,
        "server_page_faults_per_load": faults,
        **load_figures(m.loads, ratios["ttft_s"], faults, memcpy_gb_per_s, prefix_hit),
        "prefix_hit_ttft_s": prefix_hit,
        "prefix_hit_ttft_ratio": None if prefix_hit is None else prefix_hit / cold,
        "first_pass": first,
    }


def mode_entry(result: dict[str, Any]) -> dict[str, Any]:
    """What ``modes`` shows per transfer mode: the ratio keys and the evidence beside them."""
    keys = (*RATIO_KEYS, "miss_overhead_spread", "miss_overhead_blocks", "l1_ttft_ratio_per_prompt",
            "disk_ttft_ratio_per_prompt", "store_fraction_of_memcpy", *OUTPUT_KEYS,
            "differing_outputs", "ttft_s", "hit_tokens_per_request", "miss_time_split_s",
            "hit_time_split_s", "server_page_faults_per_load", *FIGURE_KEYS, "worker_copy_used", "first_pass")
    return {key: result[key] for key in keys}


@dataclass(frozen=True)
class Knob:
    """A setting changed from the default variant, and what the bench may say about it: an
    offload setting, or (``server_env``) the environment of the ``lmcache server`` process."""

    name: str
    value: Any
    default: Any
    note: str
    server_env: tuple[tuple[str, str], ...] = ()
    """Set: the knob is this environment of the LMCache server, not an offload setting."""
    transfer_mode: str | None = None
    """Set: the knob acts only in this transfer mode; it is measured there and compared with
    that mode's variant (``modes``), whatever mode the default chose."""

    def overrides(self) -> dict[str, Any]:
        """The offload settings this knob changes."""
        return {} if self.server_env else {self.name: self.value}


def noise(result: dict[str, Any]) -> dict[str, float]:
    """How far a ratio moves by chance within one variant: the miss blocks' interquartile range,
    half the range of the per-prompt hit ratios. The copy fraction has no samples to judge by."""
    spread_ = result["miss_overhead_spread"]

    def half_range(values: list[float]) -> float:
        return (max(values) - min(values)) / 2

    return {"miss_overhead_ratio": spread_["q3"] - spread_["q1"],
            "l1_ttft_ratio": half_range(result["l1_ttft_ratio_per_prompt"]),
            "disk_ttft_ratio": half_range(result["disk_ttft_ratio_per_prompt"])}


def tuning_row(knob: Knob, tried: dict[str, Any], default: dict[str, Any]) -> dict[str, Any]:
    """One knob: its ratios, the change from the variant it departs from (the default, or the
    variant of the knob's own transfer mode) measured in the same run, a verdict.

    A ratio counts as better or worse only when it moved by more than the larger of the two
    variants' own noise (``noise``); ``helps`` needs one better and none worse: a difference
    inside the run's noise is not an effect."""
    delta = {key: tried[key] - default[key] for key in RATIO_KEYS}
    judged = {key: max(a, b) for (key, a), b in zip(noise(default).items(), noise(tried).values(),
                                                    strict=True)}
    better = [key for key, limit in judged.items() if -delta[key] > limit]
    worse = [key for key, limit in judged.items() if delta[key] > limit]
    verdict = ("helps" if better and not worse else "hurts" if worse and not better
               else "mixed" if worse else "no clear effect")
    return {
        "knob": knob.name, "value": knob.value, "default": knob.default,
        **({"server_env": dict(knob.server_env)} if knob.server_env else {}),
        "transfer_mode": tried["transfer_mode"],
        **{key: tried[key] for key in RATIO_KEYS},
        "delta_vs_default": delta,
        "compared_with_transfer_mode": default["transfer_mode"],
        "noise": judged,
        "miss_overhead_spread": tried["miss_overhead_spread"],
        **{key: tried[key] for key in OUTPUT_KEYS},
        "effect": verdict,
        "note": knob.note,
    }


def assemble(default: dict[str, Any], modes: dict[str, dict[str, Any]],
             tuning: list[tuple[Knob, dict[str, Any]]], context: dict[str, Any]) -> dict[str, Any]:
    """The whole JSON: ``context`` (shape, memcpy, mode setting...) and the default's keys on top
    (DESIGN.md contract) with issue 43's ``goals`` and ``goal_met``, then ``modes`` and ``tuning``."""
    return {
        **context,
        **default,
        **goals(default),
        "modes": {mode: mode_entry(result) for mode, result in modes.items()},
        "tuning": [tuning_row(knob, tried, modes[knob.transfer_mode] if knob.transfer_mode else default)
                   for knob, tried in tuning],
    }
