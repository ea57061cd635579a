"""Scenario definitions as data: the YAML files beside this module, validated (extra=forbid).

A scenario file fixes the workload; command-line overrides (users, rate, duration, dataset)
replace single fields. Nothing here imports Locust, so ``kvops loadtest`` validates inputs
before it starts any process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvops.core import kinds
from kvops.core.errors import BadInputError
from kvops.core.kinds import read_mapping_of_kind

SCENARIOS: dict[str, str] = {
    "kv-exhaustion": "kv_exhaustion",
    "prefix-miss": "prefix_miss",
    "ttft-regression": "ttft_regression",
    "trace-replay": "trace_replay",
}
HERE = Path(__file__).resolve().parent / "scenarios"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # NaN/inf: never a setting


class Workload(_Strict):
    """What each generated request asks for."""

    api: Literal["completions", "chat"] = "completions"
    prompt_words: int = Field(200, ge=1)
    max_tokens: int = Field(128, ge=1)
    ignore_eos: bool = True
    temperature: float = 0.0
    seed: int = 0


class KvExhaustionConfig(_Strict):
    scenario: Literal["kv-exhaustion"] = "kv-exhaustion"
    workload: Workload = Workload(prompt_words=200, max_tokens=128)
    steps: list[int] | None = Field(None, min_length=1)
    """Users per step; unset: sized from the server (loadtest/analysis/ramp.py) to reach past
    the knee its KV cache and --max-num-seqs predict."""
    step_s: float = Field(8.0, gt=0)
    max_users: int = Field(256, ge=1)
    """A sized ramp stops here even if the predicted knee lies higher."""
    max_duration_s: float = Field(120.0, gt=0)
    """A sized ramp's time budget: steps that do not fit are left out (`--duration` sets it)."""
    min_step_s: float = Field(5.0, gt=0)
    """A sized ramp shortens its steps to fit the budget, but not below this."""
    settle_fraction: float = Field(0.25, ge=0, lt=1)
    """Leading part of each step left out of its classification (ramp and queue build-up)."""
    error_rate_failing: float = 0.05
    kv_usage_bound: float = 0.9


class PrefixMissConfig(_Strict):
    scenario: Literal["prefix-miss"] = "prefix-miss"
    api: Literal["completions", "chat"] = "completions"
    groups: int = Field(4, ge=1)
    prefix_words: int = Field(300, ge=1)
    system_template: str = "You are a helpful assistant for team {group}. Policy: {prefix}"
    """Rendered per request: {group}, {prefix} (the group's fixed words), {timestamp}, {request}."""
    question_words: int = Field(24, ge=1)
    max_tokens: int = Field(8, ge=1)
    users: int = Field(2, ge=1)
    duration_s: float = Field(30.0, gt=0)
    min_ratio: float = Field(0.8, gt=0, le=1)
    """Measured/expected hit rate below this is a miss."""
    seed: int = 0


class TtftRegressionConfig(_Strict):
    scenario: Literal["ttft-regression"] = "ttft-regression"
    workload: Workload = Workload(prompt_words=120, max_tokens=64)
    rate_rps: float = Field(1.0, gt=0)
    users: int = Field(32, ge=1)
    """Size of the user pool that serves the open-loop arrivals (lateness grows if too small)."""
    duration_s: float = Field(30.0, gt=0)
    threshold_rel: float = Field(0.25, ge=0)
    """A metric regresses when the lower end of its CI of relative change exceeds this."""
    scrape_interval_s: float = Field(1.0, gt=0)
    """/metrics sampling period; each scrape costs the server's API process a few ms."""
    min_abs_s: float = Field(0.005, ge=0)
    load_tolerance_rel: float = Field(0.25, ge=0)
    """Offered work (arrival rate × tokens per request) this much above the baseline's is more
    load: TTFT is then blamed on load (or queueing), not on a phase."""
    late_s: float = Field(1.0, gt=0)
    """More than 5% of sends later than this (kvops.loadtest.analysis.load.LATE_SHARE): the
    client fell behind its schedule, the comparison is unreliable."""
    confidence: float = Field(0.95, gt=0, lt=1)
    resamples: int = Field(1000, ge=100)


class TraceReplayConfig(_Strict):
    scenario: Literal["trace-replay"] = "trace-replay"
    speedup: float = Field(1.0, gt=0)
    """Arrival times are divided by this (`--speedup`)."""
    length_scale: float = Field(0.25, gt=0)
    """Prompt and output lengths, and the trace's block, are multiplied by this (`--length-scale`)."""
    start: int = Field(0, ge=0)
    """Index of the first trace request replayed, in arrival order."""
    requests: int | None = Field(None, ge=1)
    """How many requests at most (unset: to the end of the trace)."""
    sample_conversations: int = Field(1, ge=1)
    """Keep one conversation in N of that window (kvops.core.trace.replay): fewer requests, the
    same reuse per request, so a slow server can replay a long stretch of the trace."""
    duration_s: float | None = Field(None, gt=0)
    """Replay only the requests due within this many seconds (`--duration`)."""
    max_output_tokens: int = Field(16, ge=1)
    """Scaled output lengths are capped here: generated blocks are not what the trace measures."""
    users: int = Field(64, ge=1)
    """Size of the user pool that serves the arrivals (lateness grows if too small)."""
    tolerance: float = Field(0.05, ge=0, le=1)
    """prefix-miss when the measured hit ratio is below the predicted one by more than this."""
    offload_tokens: float | None = Field(None, gt=0)
    """Tokens the offload tier holds (its largest tier); unset: more than the replay fills."""
    drain_s: float = Field(60.0, gt=0)
    """After the last arrival, how long the run may wait for requests still in flight."""
    seed: int = 0
    drift_at: int | None = Field(None, ge=0)
    """What-if: write a per-request span (drift_tokens long, like a request id or timestamp a
    gateway adds) at this token depth of every prompt; the prediction stays the trace's, so the
    report shows what the span costs and the verdict names it (prefix-drift)."""
    drift_tokens: int = Field(8, ge=1)


ScenarioConfig = KvExhaustionConfig | PrefixMissConfig | TtftRegressionConfig | TraceReplayConfig
_MODELS: dict[str, type[ScenarioConfig]] = {
    "kv-exhaustion": KvExhaustionConfig,
    "prefix-miss": PrefixMissConfig,
    "ttft-regression": TtftRegressionConfig,
    "trace-replay": TraceReplayConfig,
}


def check_scenario(name: str) -> str:
    if name not in SCENARIOS:
        raise BadInputError(f"unknown scenario {name!r}: choose one of {', '.join(SCENARIOS)}")
    return name


def default_file(name: str) -> Path:
    return HERE / f"{SCENARIOS[check_scenario(name)]}.yaml"


def load_config(name: str, path: Path | None = None, **overrides: Any) -> ScenarioConfig:
    """The scenario's file (its packaged default unless ``path``), with overrides applied."""
    source = path or default_file(name)
    raw = read_mapping_of_kind(Path(source), "scenario file", kinds.SCENARIO)
    raw.setdefault("scenario", name)
    if raw["scenario"] != name:
        raise BadInputError(f"scenario file {source} is for {raw['scenario']!r}, not {name!r}")
    try:
        config = _MODELS[name].model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise BadInputError(f"scenario file {source}: field {where!r}: {err['msg']}") from exc
    return apply_overrides(config, **overrides)


def apply_overrides(config: ScenarioConfig, *, users: int | None = None, rate: float | None = None,
                    duration_s: float | None = None, speedup: float | None = None,
                    length_scale: float | None = None) -> ScenarioConfig:
    """Command-line overrides: users (kv: the last step; doubling from 1), rate, duration,
    speedup and length scale (trace-replay)."""
    update: dict[str, Any] = {}
    if isinstance(config, KvExhaustionConfig):
        if users is not None:
            update["steps"] = doubling_steps(users)
        steps: list[int] | None = update.get("steps", config.steps)
        if duration_s is not None:
            if steps is None:
                update["max_duration_s"] = duration_s  # the ramp is sized to fit it
            else:
                update["step_s"] = duration_s / len(steps)
    else:
        if users is not None:
            update["users"] = users
        if duration_s is not None:
            update["duration_s"] = duration_s
    if rate is not None:
        if not isinstance(config, TtftRegressionConfig):
            raise BadInputError(f"--rate applies to ttft-regression only, not {config.scenario}")
        update["rate_rps"] = rate
    for flag, value, key in (("--speedup", speedup, "speedup"), ("--length-scale", length_scale, "length_scale")):
        if value is None:
            continue
        if not isinstance(config, TraceReplayConfig):
            raise BadInputError(f"{flag} applies to trace-replay only, not {config.scenario}")
        if value <= 0:
            raise BadInputError(f"{flag} must be > 0, got {value}")
        update[key] = value
    try:  # validated like the file's own fields (model_copy would not check them: --rate nan ran)
        return type(config).model_validate({**config.model_dump(), **update})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise BadInputError(f"command line: {where}: {err['msg']} (check --users, --rate, --duration, "
                            "--speedup, --length-scale)") from None


def doubling_steps(max_users: int) -> list[int]:
    if max_users < 1:
        raise BadInputError("--users must be at least 1")
    steps = [1]
    while steps[-1] * 2 < max_users:
        steps.append(steps[-1] * 2)
    if steps[-1] != max_users:
        steps.append(max_users)
    return steps
