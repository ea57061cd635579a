"""Scenario definitions as data: the YAML files beside this module, validated (extra=forbid).

A scenario file fixes the workload; command-line overrides (users, rate, duration, dataset)
replace single fields. Nothing here imports Locust, so ``kvops loadtest`` validates inputs
before it starts any process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvops.ops.errors import BadInputError

SCENARIOS: dict[str, str] = {
    "kv-exhaustion": "kv_exhaustion",
    "prefix-miss": "prefix_miss",
    "ttft-regression": "ttft_regression",
}
HERE = Path(__file__).resolve().parent


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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
    steps: list[int] = Field(default_factory=lambda: [1, 2, 4, 8], min_length=1)
    step_s: float = Field(8.0, gt=0)
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
    confidence: float = Field(0.95, gt=0, lt=1)
    resamples: int = Field(1000, ge=100)


ScenarioConfig = KvExhaustionConfig | PrefixMissConfig | TtftRegressionConfig
_MODELS: dict[str, type[ScenarioConfig]] = {
    "kv-exhaustion": KvExhaustionConfig,
    "prefix-miss": PrefixMissConfig,
    "ttft-regression": TtftRegressionConfig,
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
    try:
        raw = yaml.safe_load(Path(source).read_text()) or {}
    except OSError as exc:
        raise BadInputError(f"cannot read scenario file {source}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise BadInputError(f"scenario file {source} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise BadInputError(f"scenario file {source}: expected a mapping at the top level")
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
                    duration_s: float | None = None) -> ScenarioConfig:
    """Command-line overrides: users (kv: the last step; doubling from 1), rate, duration."""
    update: dict[str, Any] = {}
    if isinstance(config, KvExhaustionConfig):
        if users is not None:
            update["steps"] = doubling_steps(users)
        if duration_s is not None:
            update["step_s"] = duration_s / len(update.get("steps", config.steps))
    else:
        if users is not None:
            update["users"] = users
        if duration_s is not None:
            update["duration_s"] = duration_s
    if rate is not None:
        if not isinstance(config, TtftRegressionConfig):
            raise BadInputError(f"--rate applies to ttft-regression only, not {config.scenario}")
        update["rate_rps"] = rate
    return config.model_copy(update=update)


def doubling_steps(max_users: int) -> list[int]:
    if max_users < 1:
        raise BadInputError("--users must be at least 1")
    steps = [1]
    while steps[-1] * 2 < max_users:
        steps.append(steps[-1] * 2)
    if steps[-1] != max_users:
        steps.append(max_users)
    return steps
