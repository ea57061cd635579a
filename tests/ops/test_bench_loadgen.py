"""The loadgen bench's judgement of a step, and who it says stopped the ramp."""

from __future__ import annotations

from kvops.ops.bench import loadgen


def _step(rate: float, error_ms: float, **kw: object) -> dict:
    base = {"rate_rps": rate, "errors": 0, "completion_rate_rps": rate, "ttft_error_ms_mean": error_ms,
            "lateness_p50_ms": 1.0, "arrival_rate_rps": rate}
    return {**base, **kw}


def test_error_is_judged_against_the_tools_own_light_load_floor():
    assert loadgen.judge(_step(2, 18.0), 18.0)["sustained"]
    assert loadgen.judge(_step(8, 27.0), 18.0)["sustained"]
    assert loadgen.judge(_step(16, 29.0), 18.0)["failed_on"] == ["ttft error"]
    # a negative floor (client faster than the server's clock) is no licence for more error
    assert loadgen.judge(_step(16, 11.0), -3.0)["failed_on"] == ["ttft error"]


def test_late_sends_failures_and_a_server_that_falls_behind_are_named():
    late = loadgen.judge(_step(32, 5.0, lateness_p50_ms=40.0), 5.0)
    assert late["failed_on"] == ["behind schedule"]
    drained = loadgen.judge(_step(32, 5.0, completion_rate_rps=20.0), 5.0)
    assert drained["failed_on"] == ["completions behind"]
    no_lateness = {k: v for k, v in _step(4, 5.0, errors=2).items() if k != "lateness_p50_ms"}
    assert loadgen.judge(no_lateness, 5.0)["failed_on"] == ["errors"]


def test_limited_by_the_server_when_both_tools_fail_at_the_same_rate():
    ok, bad = {"rate_rps": 2, "sustained": True}, {"rate_rps": 4, "sustained": False,
                                                   "failed_on": ["completions behind"]}
    assert loadgen._limited_by([ok, bad], [ok, bad]).startswith("server")
    assert loadgen._limited_by([ok, bad], [ok, {**bad, "rate_rps": 8}]).startswith("load generator")
    assert loadgen._best([ok, bad]) == 2
