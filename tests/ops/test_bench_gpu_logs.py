"""``kvops bench planner``'s gpu_logs: every published run with a config here is planned and set
beside its log; the others are listed with the reason, and the fitted runs are kept apart."""

from __future__ import annotations

import json

from kvops.ops.bench import gpu_logs

SUMMARY_KEYS = {"gpu_logs_cases", "weights_error_pct_max", "available_kv_error_pct_mean",
                "available_kv_error_pct_max", "kv_tokens_exact", "gpu_logs"}


def test_every_logged_run_is_planned_or_named() -> None:
    out = gpu_logs.run()
    assert SUMMARY_KEYS <= out.keys()
    runs = gpu_logs.LOGS.read_text().splitlines()
    assert out["gpu_logs_cases"] + len(out["gpu_logs_skipped"]) == len(runs)
    assert {s["why"] for s in out["gpu_logs_skipped"]} == {"no config.json here"}
    other = out["other_logs"]
    public = gpu_logs.PUBLIC_LOGS.read_text().splitlines()
    assert other["gpu_logs_cases"] + len(other["gpu_logs_skipped"]) == len(public)
    assert not any(c["fit"] for c in other["gpu_logs"])  # no constant was read off these
    json.dumps(out)  # the bench prints it


def test_each_run_carries_the_log_the_prediction_and_the_version_accounting() -> None:
    out = gpu_logs.run()
    logged = {json.loads(line)["url"]: json.loads(line) for line in gpu_logs.LOGS.read_text().splitlines()}
    for case in out["gpu_logs"]:
        source = logged[case["url"]]
        assert case["logged"]["weights_gib"] == source["model_loading_gib"]
        assert case["logged"]["kv_cache_tokens"] == source["kv_cache_tokens"]
        assert "CUDA-graph" in case["accounting"]
        assert (case["kv_tokens_exact"] is None) == (case["pp"] > 1)
    held_out = [c for c in out["gpu_logs"] if not c["fit"]]
    assert out["held_out_cases"] == len(held_out) > 0
    assert {c["model"] for c in out["gpu_logs"] if c["fit"]} == set(gpu_logs.FIT_MODELS)


def test_no_logged_h100_run_is_promised_more_kv_than_it_had() -> None:
    """Issue 40's goal, against the logs: available KV never more than 0.5% above the logged
    figure (Qwen2.5-72B at TP2, 3.04 GiB of KV, was +4.0%: 0.08 GiB of allocator rounding in its
    weights and a wider model's non-torch memory), mean |error| within 1%, max within 2%."""
    out = gpu_logs.run()
    over = {(c["model"], c["tp"]): c["available_kv_error_pct"] for c in out["gpu_logs"]
            if c["available_kv_error_pct"] > 0.5}
    assert not over
    assert out["available_kv_error_pct_mean"] <= 1.0
    assert out["available_kv_error_pct_max"] <= 2.0
