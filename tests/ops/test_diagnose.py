"""Live diagnosis rules on two /metrics samples, and verdicts read back from a result file."""

from __future__ import annotations

import json

import pytest

from kvops.core.prom import MetricsSample
from kvops.core.verdict import PROBLEMS, Verdict
from kvops.ops.diagnose import diagnose_samples, merge, verdicts_from_result


def _pair(cache: dict[str, str] | None = None, **last: float) -> tuple[MetricsSample, MetricsSample]:
    first = MetricsSample(t=0.0, values={"preemptions": 5.0, "queue_sum": 0.0, "queue_count": 0.0,
                                         "ttft_sum": 0.0, "ttft_count": 0.0,
                                         "waiting": last.get("waiting", 0.0)})
    values = {"preemptions": 5.0, **last}
    return first, MetricsSample(t=5.0, values=values, cache_config=cache or {})


def _causes(verdicts: list[Verdict]) -> list[tuple[str, str]]:
    return [(v.problem, v.cause) for v in verdicts]


def test_idle_server_is_healthy():
    assert _causes(diagnose_samples(*_pair())) == [("healthy", "none")]


def test_preemptions_in_the_window_mean_kv_capacity():
    verdicts = diagnose_samples(*_pair(preemptions=9.0, kv_usage=0.97, running=4))
    assert _causes(verdicts) == [("kv-exhaustion", "kv-capacity")]
    assert verdicts[0].evidence["preemptions_in_window"] == 4


def test_a_request_seen_waiting_once_is_not_a_queue():
    first, last = _pair(waiting=2, kv_usage=0.2)
    first.values["waiting"] = 0.0
    assert _causes(diagnose_samples(first, last)) == [("healthy", "none")]


def test_waiting_with_free_kv_is_compute_bound():
    # requests finished in the window, their TTFT mostly prefill: no queueing verdict
    verdicts = diagnose_samples(*_pair(waiting=3, kv_usage=0.2, queue_sum=1.0, queue_count=4.0,
                                       ttft_sum=4.0, ttft_count=4.0))
    assert _causes(verdicts) == [("kv-exhaustion", "compute-bound")]
    assert "ttft_split" not in verdicts[0].evidence


def test_a_window_in_which_no_request_finished_says_ttft_cannot_be_split():
    # vLLM observes queue time at a request's finish: long outputs through one slot can finish
    # none in a short window, and "not queueing" would be a guess (a runbook check read so on a
    # starved CPU)
    verdicts = diagnose_samples(*_pair(waiting=3, kv_usage=0.2, running=1))
    assert _causes(verdicts) == [("kv-exhaustion", "compute-bound")]
    assert verdicts[0].evidence["finished_in_window"] == 0
    assert "rerun with --window 60" in verdicts[0].evidence["ttft_split"]


def test_prefix_caching_off_and_queueing():
    first, last = _pair({"enable_prefix_caching": "False"}, waiting=2, kv_usage=0.95,
                        queue_sum=8.0, queue_count=10.0, ttft_sum=10.0, ttft_count=10.0)
    assert _causes(diagnose_samples(first, last)) == [
        ("kv-exhaustion", "kv-capacity"), ("prefix-miss", "prefix-caching-disabled"),
        ("ttft-regression", "queueing")]


def test_verdict_slugs_are_the_designed_ones():
    with pytest.raises(ValueError, match="bad verdict"):
        Verdict("kv-exhaustion", "oom")
    assert set(PROBLEMS) == {"kv-exhaustion", "prefix-miss", "ttft-regression", "offload", "healthy",
                             "inconclusive"}


def test_result_file_verdicts_win_over_a_healthy_live_read(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"verdicts": [{"problem": "prefix-miss", "cause": "prefix-drift",
                                              "evidence": {"first_differing_token": 40},
                                              "next": "fix the template"}]}))
    merged = merge(diagnose_samples(*_pair()), verdicts_from_result(path))
    assert _causes(merged) == [("prefix-miss", "prefix-drift")]


OFFLOAD_METRICS = """\
# TYPE kvops_offload_server_up gauge
kvops_offload_server_up {up}
# TYPE kvops_offload_degraded gauge
kvops_offload_degraded{{engine="0",model_name="m"}} {degraded}
"""


@pytest.mark.parametrize(
    ("up", "degraded", "expected"),
    [
        (0, 1, [("offload", "unreachable")]),
        (1, 1, [("offload", "degraded")]),
        (1, 0, [("healthy", "none")]),
    ],
)
def test_offload_verdicts_from_the_plugin_gauges(up, degraded, expected):
    from kvops.core.prom import parse_metrics

    first = parse_metrics(OFFLOAD_METRICS.format(up=1, degraded=0), t=0.0)
    last = parse_metrics(OFFLOAD_METRICS.format(up=up, degraded=degraded), t=5.0)
    assert _causes(diagnose_samples(first, last)) == expected


def test_a_disk_tier_that_refuses_writes_is_an_offload_degraded_verdict():
    from kvops.core.prom import parse_metrics

    page = OFFLOAD_METRICS.format(up=1, degraded=0) + "# TYPE kvops_offload_disk_degraded gauge\n"
    first = parse_metrics(page + "kvops_offload_disk_degraded 0\n", t=0.0)
    last = parse_metrics(page + "kvops_offload_disk_degraded 1\n", t=5.0)
    [verdict] = diagnose_samples(first, last)
    assert (verdict.problem, verdict.cause) == ("offload", "degraded")
    assert verdict.evidence["kvops_offload_disk_degraded"] == 1
    assert "disk tier refuses writes" in verdict.next
    assert _causes(diagnose_samples(first, first)) == [("healthy", "none")]


def test_no_offload_gauges_no_offload_verdict():
    assert all(v.problem != "offload" for v in diagnose_samples(*_pair()))


def test_a_canary_that_could_not_load_is_an_offload_load_path_verdict():
    """Server up, not degraded, disk fine, and still no load comes back: only the canary knows."""
    from kvops.core.prom import parse_metrics

    page = OFFLOAD_METRICS.format(up=1, degraded=0) + "# TYPE kvops_offload_load_path_ok gauge\n"
    first = parse_metrics(page + "kvops_offload_load_path_ok 1\n", t=0.0)
    last = parse_metrics(page + "kvops_offload_load_path_ok 0\n", t=5.0)
    [verdict] = diagnose_samples(first, last)
    assert (verdict.problem, verdict.cause) == ("offload", "load-path")
    assert verdict.evidence["kvops_offload_load_path_ok"] == 0
    assert "kvops offload check --url" in verdict.next
    assert _causes(diagnose_samples(first, first)) == [("healthy", "none")]
