"""Read what a live server decided (its startup log line or ``vllm:cache_config_info``) and
compare it with a planner result; say which term explains a difference.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvops.core import http
from kvops.core.errors import BadInputError, KvopsError
from kvops.core.plan import Expectation, ExpectedCapacity, NonKvTerms
from kvops.core.prom import CACHE_INFO, info_labels, samples_by_name
from kvops.ops.capacity.calibration import Calibration, calibration_from_metrics, measured_from_log

# v1/core/kv_cache_utils.py update_kv_cache_capacity (one line since 0.2x; "GPU" or "CPU").
# (?<![A-Z]): the device name starts a word, so a long run of capitals is tried once, not once
# per letter (a 20,000-capital line took 37 s without it)
LOG_LINE = re.compile(
    r"(?<![A-Z])(?P<dev>[A-Z]+(?: \+ host)?) KV cache size: (?P<tokens>[\d,]+) tokens, Maximum concurrency "
    r"for (?P<mml>[\d,]+) tokens per request: (?P<conc>[\d.]+)x")


@dataclass(frozen=True)
class Observed:
    """What the server reports; fields it does not report are None."""

    kv_cache_size_tokens: int
    max_concurrency: float | None = None
    max_model_len: int | None = None
    num_blocks: int | None = None
    block_size: int | None = None
    source: str = ""


def parse_log(text: str) -> Observed:
    matches = list(LOG_LINE.finditer(text))
    if not matches:
        raise BadInputError("log has no 'KV cache size: N tokens, Maximum concurrency ...' line; "
                            "pass the server's startup log")
    m = matches[-1]
    return Observed(
        kv_cache_size_tokens=int(m["tokens"].replace(",", "")), max_concurrency=float(m["conc"]),
        max_model_len=int(m["mml"].replace(",", "")), source="log")


def _opt_int(labels: dict[str, str], key: str) -> int | None:
    value = labels.get(key)
    return int(value) if value not in (None, "None", "") and str(value).isdigit() else None


def cache_config_labels(text: str) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` (v1/metrics/loggers.py: CacheConfig as labels)."""
    labels = info_labels(samples_by_name(text), CACHE_INFO)
    if labels is None:
        raise BadInputError("no vllm:cache_config_info in /metrics; is this a vLLM server?")
    return labels


def parse_metrics(text: str) -> Observed:
    return observed_from_labels(cache_config_labels(text))


def observed_from_labels(labels: dict[str, str]) -> Observed:
    """What ``vllm:cache_config_info``'s labels say, from /metrics or from Prometheus."""
    tokens = _opt_int(labels, "kv_cache_size_tokens")
    if tokens is None:
        raise BadInputError("vllm:cache_config_info has no kv_cache_size_tokens label (vLLM < 0.2x?)")
    conc = labels.get("kv_cache_max_concurrency")
    return Observed(
        kv_cache_size_tokens=tokens,
        max_concurrency=float(conc) if conc not in (None, "None", "") else None,
        num_blocks=_opt_int(labels, "num_gpu_blocks"), block_size=_opt_int(labels, "block_size"),
        source="metrics")


def fetch_identity(url: str, timeout_s: float = 10.0) -> tuple[str, str]:
    """(vLLM version, served model) from the server's /version and /v1/models."""
    import requests

    base = url.rstrip("/").removesuffix("/metrics")
    try:
        version = http.get(base + "/version", timeout_s).json()["version"]
        models = http.get(base + "/v1/models", timeout_s).json()["data"]
    except (requests.RequestException, ValueError, KeyError, TypeError) as exc:
        raise KvopsError(f"cannot read {base}/version and /v1/models: {exc}; check --url") from None
    first = models[0] if models else {}
    return str(version), str(first.get("root") or first.get("id") or "?")


def fetch_metrics(url: str, timeout_s: float = 10.0) -> str:
    import requests

    target = url.rstrip("/") + ("" if url.rstrip("/").endswith("/metrics") else "/metrics")
    try:
        response = http.get(target, timeout_s)
        response.raise_for_status()
    except requests.RequestException as exc:
        raise KvopsError(f"cannot read {target}: {exc}; check --url") from None
    return response.text


def term_differences(plan_non_kv: NonKvTerms, measured: Calibration) -> dict[str, float]:
    """Measured − planned GiB per non-KV term, for the terms the server's log splits out."""
    planned = dict(plan_non_kv.items())
    if measured.includes_weights:
        return {"non_kv_gib": round(measured.non_kv_gib - sum(planned.values()), 4)}
    out = {}
    for key, value in planned.items():
        got = getattr(measured, key, None) if key in Calibration.model_fields else None
        if isinstance(got, float):
            out[key] = round(got - value, 4)
    return out


def verify_against(doc: Expectation, observed: Observed, measured: Calibration | None) -> dict[str, Any]:
    """Compare a kv-capacity or plan JSON with the server; name the non-KV term when both the
    plan's terms and the log's measurements are there."""
    terms = term_differences(doc.non_kv, measured) if measured and doc.non_kv else None
    return compare(doc.capacity, observed, terms)


def compare(expected: ExpectedCapacity, observed: Observed, terms: dict[str, float] | None = None) -> dict[str, Any]:
    """Field-by-field comparison; ``explanation`` names the term that accounts for a gap.

    ``terms`` (measured − planned GiB per non-KV term, from the server's log) lets the
    explanation name the term; without it only the size of the gap is known.
    """
    fields = {"kv_cache_size_tokens": observed.kv_cache_size_tokens,
              "num_blocks": observed.num_blocks, "block_size": observed.block_size}
    diffs = {k: {"expected": getattr(expected, k), "observed": v} for k, v in fields.items()
             if v is not None and getattr(expected, k) is not None and getattr(expected, k) != v}
    conc = expected.max_concurrency
    if observed.max_concurrency is not None and conc is not None:
        digits = 2 if observed.source == "log" else 6
        if round(conc, digits) != round(observed.max_concurrency, digits):
            diffs["max_concurrency"] = {"expected": conc, "observed": observed.max_concurrency}
    explanation = _explain(expected, observed, diffs)
    if diffs and terms:
        worst = max(terms, key=lambda k: abs(terms[k]))
        explanation += (f"; the server's log puts {worst[:-4]} at {terms[worst]:+.2f} GiB from the plan "
                        "(the largest non-KV difference)")
    return {"match": not diffs, "source": observed.source, "differences": diffs,
            "non_kv_differences_gib": terms or {}, "explanation": explanation}


def _explain(expected: ExpectedCapacity, observed: Observed, diffs: dict[str, Any]) -> str:
    if not diffs:
        return "the server's KV sizing equals the plan"
    if "block_size" in diffs:
        return "block size differs: pass --block-size/--device as the server ran"
    if observed.num_blocks is not None and "num_blocks" not in diffs:
        return "same blocks, different per-request blocks: max_model_len, max_num_batched_tokens, async scheduling or mamba cache mode differ"
    tokens = expected.kv_cache_size_tokens
    if expected.bytes_per_block is not None and tokens:
        gap = (observed.kv_cache_size_tokens - tokens) / tokens
        return (f"capacity differs by {gap:+.2%}: the available KV bytes differ (non-KV terms: weights, "
                "activation peak, non-torch, CUDA graphs, or gpu_memory_utilization); "
                "write a calibration with --calibration-out and plan with --calibration")
    return "capacity differs: available KV bytes or per-request blocks differ"


def read_server(
    url: str | None, log_text: str | None, log_source: str, plan_doc: Expectation, *,
    compare: bool, calibrate: bool,
) -> tuple[Observed | None, Calibration | None]:
    """What the server decided (for a comparison) and what it measured (for a calibration).

    From a log the non-KV split is read when the log has it (and required when calibrating);
    from a URL the calibration is the live block count against the plan the server ran.
    """
    if url is not None:
        metrics = fetch_metrics(url)
        cal = calibration_from_metrics(cache_config_labels(metrics), plan_doc, *fetch_identity(url),
                                       url) if calibrate else None
        return (parse_metrics(metrics) if compare else None), cal
    assert log_text is not None
    cal = measured_from_log(log_text, log_source, required=calibrate)
    return (parse_log(log_text) if compare else None), cal
