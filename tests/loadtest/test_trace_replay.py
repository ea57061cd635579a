"""trace-replay on hand-made traces: the replayed requests (timing, scaled and clipped lengths,
equal blocks exactly where the ids are equal), the prediction counted by hand from vLLM's rules
(whole blocks, last prompt token computed, a finished request's tail freed first), and the
verdict from /metrics counters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvops.core.errors import BadInputError
from kvops.core.prom import MetricsSample
from kvops.core.trace.read import read_trace
from kvops.core.trace.replay import (
    Replay,
    ReplayOptions,
    ReplayRequest,
    ServerCache,
    Timing,
    plan_replay,
    predict,
)
from kvops.loadtest.analysis import replay
from kvops.loadtest.analysis.tokens import ServerTokenizer
from kvops.loadtest.config import TraceReplayConfig, apply_overrides, load_config
from kvops.loadtest.records import RequestRecord

ROWS = [
    {"timestamp": 1000, "input_length": 1000, "output_length": 200, "hash_ids": [1, 2]},
    {"timestamp": 3000, "input_length": 1500, "output_length": 8, "hash_ids": [1, 2, 3]},
    {"timestamp": 5000, "input_length": 9000, "output_length": 0, "hash_ids": list(range(10, 28))},
]


def trace(tmp_path: Path, rows: list[dict] = ROWS) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_replay_times_lengths_and_blocks(tmp_path):
    plan = plan_replay(read_trace(trace(tmp_path)), ReplayOptions(
        speedup=2, length_scale=0.25, max_model_len=1024, max_output_tokens=16))
    assert plan.block_tokens == 128  # 512 x 0.25
    # send times: (t - 1 s) / 2; prompts ceil(len/4), the last clipped to 1024 - its 1 output
    # token; outputs round(len/4) capped at 16, at least 1; ids cut to the prompt's blocks
    assert [(r.send_at_s, r.prompt_tokens, r.max_tokens, r.block_ids) for r in plan.requests] == [
        (0.0, 250, 16, (1, 2)), (1.0, 375, 2, (1, 2, 3)), (2.0, 1023, 1, tuple(range(10, 18)))]
    assert plan.duration_s == 2.0


def test_equal_ids_give_equal_blocks_and_nothing_else(tmp_path):
    plan = plan_replay(read_trace(trace(tmp_path)), ReplayOptions(length_scale=0.25, max_model_len=4096))
    a, b, c = (plan.prompt(r) for r in plan.requests)
    assert (len(a), len(b)) == (250, 375)
    assert a == b[:250]  # ids 1, 2 (a's second block cut at 250 tokens)
    assert [b[i:i + 128] != c[i:i + 128] for i in (0, 128, 256)] == [True] * 3
    assert c[:128] != c[128:256]  # ids 10, 11


def test_duration_and_window_select_requests(tmp_path):
    source = read_trace(trace(tmp_path))
    assert [r.index for r in plan_replay(source, ReplayOptions(duration_s=2.0)).requests] == [0, 1]
    assert [r.index for r in plan_replay(source, ReplayOptions(start=1, limit=1)).requests] == [1]
    with pytest.raises(BadInputError, match="no requests from index 5"):
        plan_replay(source, ReplayOptions(start=5))


def test_a_trace_without_ids_replays_unique_blocks(tmp_path):
    path = tmp_path / "b.csv"
    path.write_text("Timestamp,Request tokens,Response tokens\n0,512,1\n1,512,1\n")
    plan = plan_replay(read_trace(path), ReplayOptions(length_scale=0.25))
    first, second = (plan.prompt(r) for r in plan.requests)
    assert first != second
    assert predict(plan, ServerCache(gpu_blocks=1000, block_size=128)).unbounded_hit_ratio == 0.0


def _two(bt: int = 128) -> Replay:
    return Replay(bt, (ReplayRequest(0, 0.0, 384, 1, (1, 2, 3)), ReplayRequest(1, 1.0, 384, 1, (1, 2, 4))))


def test_prediction_counted_by_hand():
    total = 768
    # unbounded: the second request finds blocks 1, 2: 256 tokens (under its 383 usable)
    assert predict(_two(), ServerCache(1000, 128)).hit_ratio == pytest.approx(256 / total)
    # one cache block: vLLM freed the first request tail first, so block 1 is what remains
    assert predict(_two(), ServerCache(1, 128)).hit_ratio == pytest.approx(128 / total)
    # an offload tier of one 128-token chunk, refreshed in order, holds block 3: no help
    assert predict(_two(), ServerCache(1, 128, 128.0, 128)).hit_ratio == pytest.approx(128 / total)
    # an unbounded tier in 256-token chunks finds 1+2 as one chunk: the larger hit counts
    both = predict(_two(), ServerCache(1, 128, float("inf"), 256))
    assert (both.gpu_hit_ratio, both.hit_ratio) == (pytest.approx(128 / total), pytest.approx(256 / total))
    # only requests that reached the server count
    assert predict(_two(), ServerCache(1000, 128), {1: Timing(1.0, 2.0)}).hit_ratio == 0.0


def test_a_request_finds_only_what_was_prefilled_before_it_was_sent():
    big = ServerCache(1000, 128, float("inf"), 128)
    in_time = {0: Timing(0.0, 0.5), 1: Timing(1.0, 1.5)}
    assert predict(_two(), big, in_time).hit_ratio == pytest.approx(256 / 768)
    queued = {0: Timing(0.0, 5.0), 1: Timing(1.0, 6.0)}  # the first still queued when the second left
    late = predict(_two(), big, queued)
    assert (late.gpu_hit_ratio, late.hit_ratio, late.unbounded_hit_ratio) == (0.0, 0.0, 0.0)


def _samples(queries: float, hits: float, ext_queries: float = 0.0, ext_hits: float = 0.0) -> list[MetricsSample]:
    info = {"num_gpu_blocks": "1000", "block_size": "128", "enable_prefix_caching": "True"}
    zero = {"prefix_queries": 0.0, "prefix_hits": 0.0, "external_prefix_queries": 0.0,
            "external_prefix_hits": 0.0}
    end = {"prefix_queries": queries, "prefix_hits": hits, "external_prefix_queries": ext_queries,
           "external_prefix_hits": ext_hits}
    return [MetricsSample(0, zero, info), MetricsSample(10, end, info)]


UNUSED = ServerTokenizer("http://unused", "m")  # text only for a drift, which these prompts lack


def _records() -> list[RequestRecord]:
    return [RequestRecord(request_id=str(i), kind="completions", sent_at=float(i), ok=True, group=str(i),
                          first_event_s=0.1) for i in (0, 1)]


@pytest.mark.parametrize(("samples", "verdict"), [
    (_samples(768, 256), ("healthy", "none")),          # measured = predicted 1/3
    (_samples(768, 256 - 30), ("healthy", "none")),     # 0.039 short: within 0.05
    (_samples(768, 128), ("prefix-miss", "eviction")),  # 1/6 short
    (_samples(768, 0, 768, 128), ("prefix-miss", "offload-miss")),
])
def test_verdict_from_the_counters(samples, verdict):
    config = TraceReplayConfig(tolerance=0.05)
    summary, (result,) = replay.analyse(config, _two(), _records(), samples, UNUSED)
    assert (result.problem, result.cause) == verdict
    assert summary["predicted_hit_ratio"] == round(256 / 768, 4)
    expected = (samples[-1].get("prefix_hits") + samples[-1].get("external_prefix_hits")) / 768
    assert summary["measured_hit_ratio"] == round(expected, 4)


def test_offload_tier_size_comes_from_the_plugin_when_the_scenario_gives_none():
    # a GPU cache of one block beside an offload tier: the tier's size decides the prediction
    samples = _samples(768, 0, 768, 128)
    samples[0].cache_config["num_gpu_blocks"] = "1"
    bytes_per_token = 4096.0
    samples[-1].values.update({"kvops_offload_capacity_bytes": 128 * bytes_per_token,
                               "kvops_offload_stored_bytes_total": 10 * bytes_per_token,
                               "kvops_offload_stored_tokens_total": 10.0})
    summary, _ = replay.analyse(TraceReplayConfig(), _two(), _records(), samples, UNUSED)
    assert (summary["offload_tokens"], summary["offload_tokens_from"]) == (128, "server")
    bounded = predict(_two(), ServerCache(1, 128, 128.0)).hit_ratio
    assert summary["predicted_hit_ratio"] == round(bounded, 4)
    # a connector without the kvops gauge: the tier is taken as unbounded, and the report says so
    del samples[-1].values["kvops_offload_capacity_bytes"]
    summary, _ = replay.analyse(TraceReplayConfig(), _two(), _records(), samples, UNUSED)
    assert summary["offload_tokens_from"] == "unbounded"
    unbounded = predict(_two(), ServerCache(1, 128, float("inf"))).hit_ratio
    assert summary["predicted_hit_ratio"] == round(unbounded, 4) != round(bounded, 4)
    # the scenario's own size wins over the server's
    summary, _ = replay.analyse(TraceReplayConfig(offload_tokens=512), _two(), _records(), samples, UNUSED)
    assert (summary["offload_tokens"], summary["offload_tokens_from"]) == (512, "scenario")


def test_hits_that_preemption_counted_twice_make_no_healthy_verdict():
    # vLLM's counters: 2 preemptions, and the measured ratio at the prediction only with them
    config = TraceReplayConfig(tolerance=0.05)
    preempted = _samples(768, 256)
    preempted[-1].values["preemptions"] = 2.0
    summary, (result,) = replay.analyse(config, _two(), _records(), preempted, UNUSED)
    assert (result.problem, result.cause) == ("inconclusive", "preempted")
    assert result.evidence["preemptions"] == 2.0
    assert result.evidence["comparison_reliable"] is False
    assert "fewer users" in result.next
    # short of the prediction despite the inflation: the cache problem stands
    short = _samples(768, 64)
    short[-1].values["preemptions"] = 2.0
    _, (result,) = replay.analyse(config, _two(), _records(), short, UNUSED)
    assert (result.problem, result.cause) == ("prefix-miss", "eviction")


def test_config_and_overrides():
    config = load_config("trace-replay")
    assert isinstance(config, TraceReplayConfig)
    changed = apply_overrides(config, speedup=10, length_scale=0.0625, users=4, duration_s=20)
    assert (changed.speedup, changed.length_scale, changed.users, changed.duration_s) == (10, 0.0625, 4, 20)
    with pytest.raises(BadInputError, match="--speedup applies to trace-replay only"):
        apply_overrides(load_config("prefix-miss"), speedup=2)
    with pytest.raises(BadInputError, match="--length-scale must be > 0"):
        apply_overrides(config, length_scale=0)


def test_sampling_keeps_whole_conversations(tmp_path):
    rows = [{"timestamp": i, "input_length": 1024, "output_length": 1, "hash_ids": ids}
            for i, ids in enumerate([[0, 4, 5], [0, 3], [0, 4, 5, 6], [7], [0, 3, 8], [9]])]
    plan = plan_replay(read_trace(trace(tmp_path, rows)), ReplayOptions(sample_conversations=2))
    # keys: second ids 4, 3, 4, 3 and, for the one-block requests, their indices 3 and 5;
    # the even ones are conversation 4's two turns
    assert [r.index for r in plan.requests] == [0, 2]
    assert plan.requests[1].send_at_s == pytest.approx(0.002)  # times relative to the first kept


@pytest.mark.parametrize(("args", "message"), [
    (["trace-replay"], "trace-replay needs --trace FILE"),
    (["trace-replay", "--trace", "BAD"], "line 2: not JSON"),
    (["prefix-miss", "--trace", "GOOD"], "--trace applies to trace-replay only"),
    (["trace-replay", "--trace", "GOOD", "--speedup", "0"], "--speedup must be > 0"),
])
def test_bad_replay_input_exits_2_before_any_process_starts(tmp_path, args, message):
    from typer.testing import CliRunner

    from kvops.ops.cli.main import app

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n{\n")
    paths = {"BAD": str(bad), "GOOD": str(trace(tmp_path))}
    argv = ["loadtest", args[0], "--url", "http://127.0.0.1:9", *(paths.get(a, a) for a in args[1:])]
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 2, res.output
    assert message in res.stderr
