"""The analyses on hand-built runs whose answer follows from the definitions: vLLM's block
hashing (whole blocks, last prompt token never cached), its gauges, bootstrap CIs."""

from __future__ import annotations

import random

import pytest

from kvops.core.prom import MetricsSample
from kvops.core.promql import FleetReadings
from kvops.core.stats import bootstrap_relative_change, row_percentile
from kvops.loadtest.analysis import kv, prefix, ttft
from kvops.loadtest.analysis.tokens import ServerTokenizer
from kvops.loadtest.config import KvExhaustionConfig, TtftRegressionConfig
from kvops.loadtest.records import RequestRecord


def _rec(sent: float, ttft_s: float = 0.1, group: str | None = "0", **kw) -> RequestRecord:
    return RequestRecord(request_id=str(sent), kind="completions", sent_at=sent, ttft_s=ttft_s,
                         e2e_s=1.0, ok=True, group=group, **kw)


def _item(sent: float, tokens: list[int], intended: int, first: float = 0.1) -> prefix.PrefixTokens:
    return prefix.PrefixTokens(_rec(sent, ttft_s=first), tokens, intended)


def test_ideal_hits_count_whole_blocks_of_prefilled_prompts_only():
    shared = list(range(300))
    a = _item(0.0, shared + [1000, 1001], 300)
    b = _item(1.0, shared + [2000], 300)  # after a's first token: 2 whole blocks of 4
    c = _item(1.05, shared + [3000], 300, first=5.0)  # b (first token at 1.1) not yet usable
    early = _item(0.05, shared + [4000], 300)  # sent before a's first token (0.1): no hit
    hits = prefix.ideal_hits([a, b, c, early], block=128)
    assert hits == [0, 256, 256, 0]


def test_last_prompt_token_is_never_a_hit():
    tokens = list(range(256))
    first, again = _item(0.0, tokens, 256), _item(1.0, tokens, 256)
    assert prefix.ideal_hits([first, again], block=128) == [0, 128]


def test_drift_point_is_the_groups_common_prefix():
    base = list(range(200))
    items = [_item(float(i), base[:150] + [900 + i] + base[151:], 200) for i in range(3)]
    assert prefix.drift_point(items) == (150, "0")
    same = [_item(float(i), base + [900 + i], 200) for i in range(3)]
    assert prefix.drift_point(same) is None


def _sample(t: float, **values: float) -> MetricsSample:
    return MetricsSample(t=t, values=dict(values))


def test_evictions_are_vllms_sampled_count_and_mean_idle_time_over_the_run():
    # 4 blocks evicted during the run after 10 s idle in all: 2.5 s each; before: 3 blocks
    samples = [_sample(0, evict_idle_count=3, evict_idle_sum=30.0), _sample(5),
               _sample(10, evict_idle_count=7, evict_idle_sum=40.0)]
    assert prefix.evictions(samples) == {"evicted_blocks_sampled": 4,
                                         "idle_before_evict_s_mean": 2.5}


def test_evictions_are_unknown_without_kv_cache_metrics():
    assert prefix.evictions([_sample(0, preemptions=1), _sample(10, preemptions=2)]) == {
        "evicted_blocks_sampled": None, "idle_before_evict_s_mean": None}


def test_kv_step_classes():
    cfg = KvExhaustionConfig(steps=[1, 2], step_s=10)
    ok = kv.StepResult(0, 1, 0, 10, 5, 0, 0.1, 0.1, 10, 0, 0.0, 1, 0.3, 0)
    transient = kv.StepResult(0, 1, 0, 10, 5, 0, 0.1, 0.1, 10, 1, 0.1, 1, 0.3, 0)
    kv_bound = kv.StepResult(1, 2, 10, 20, 5, 0, 0.1, 0.1, 10, 2, 0.5, 2, 0.95, 0)
    preempt = kv.StepResult(1, 2, 10, 20, 5, 0, 0.1, 0.1, 10, 0, 0.0, 2, 0.5, 1)
    seq = kv.StepResult(1, 2, 10, 20, 5, 0, 0.1, 0.1, 10, 3, 0.8, 1, 0.4, 0)
    compute = kv.StepResult(1, 2, 10, 20, 5, 0, 0.1, 0.1, 10, 3, 0.8, 2, 0.4, 0)
    failing = kv.StepResult(1, 2, 10, 20, 10, 5, 0.1, 0.1, 10, 0, 0.0, 2, 0.4, 0)
    assert kv.classify(ok, None, cfg) == kv.OK
    assert kv.classify(transient, None, cfg) == kv.OK  # one scrape caught a request in passing
    assert kv.classify(kv_bound, ok, cfg) == kv.KV_BOUND
    assert kv.classify(preempt, ok, cfg) == kv.KV_BOUND
    assert kv.classify(seq, ok, cfg) == kv.SEQ_BOUND
    assert kv.classify(compute, ok, cfg) == kv.COMPUTE_BOUND
    assert kv.classify(failing, ok, cfg) == kv.FAILING


def test_kv_step_classes_with_the_servers_max_num_seqs():
    # running flat at 1 step after step: a plateau, but with the plugin's gauge saying the
    # server admits 32 it is the token budget, not the sequence limit
    cfg = KvExhaustionConfig(steps=[1, 2], step_s=10)
    before = kv.StepResult(0, 1, 0, 10, 5, 0, 0.1, 0.1, 10, 3, 0.8, 1, 0.01, 0, max_num_seqs=32)
    flat = kv.StepResult(1, 2, 10, 20, 5, 0, 0.1, 0.1, 10, 3, 0.8, 1, 0.01, 0, max_num_seqs=32)
    assert kv.classify(flat, before, cfg) == kv.COMPUTE_BOUND
    pinned = kv.StepResult(1, 2, 10, 20, 5, 0, 0.1, 0.1, 10, 3, 0.8, 2, 0.01, 0, max_num_seqs=2)
    assert kv.classify(pinned, None, cfg) == kv.SEQ_BOUND  # no previous step needed


def test_measure_step_reads_the_plugins_max_num_seqs():
    cfg = KvExhaustionConfig(steps=[1], step_s=10)
    samples = [_sample(t, running=1, waiting=0, kv_usage=0.1, kvops_scheduler_max_num_seqs=7)
               for t in range(0, 11)]
    assert kv.measure_step(0, 1, 0, 10, cfg, [], samples).max_num_seqs == 7
    bare = [_sample(t, running=1, waiting=0, kv_usage=0.1) for t in range(0, 11)]
    assert kv.measure_step(0, 1, 0, 10, cfg, [], bare).max_num_seqs is None


def test_predicted_concurrency_from_cache_config():
    sample = MetricsSample(t=0, cache_config={"num_gpu_blocks": "12", "block_size": "128"})
    # 465 tokens → 4 blocks; 11 usable blocks (block 0 is vLLM's null block) → 2 requests
    assert kv.predicted_concurrency(sample, 465)["predicted_max_concurrency"] == 2


def test_the_verdicts_knee_is_the_one_the_ramp_was_sized_with():
    # a dataset whose bodies ask 400 output tokens, not the workload's default: the ramp sized
    # itself from the bodies (900 tokens: 8 blocks of 128), so the verdict must predict with it
    cfg = KvExhaustionConfig(steps=[1, 2], step_s=10)
    cache = {"num_gpu_blocks": "81", "block_size": "128"}
    samples = [MetricsSample(t=float(t), values={"running": 1.0, "waiting": 0.0, "kv_usage": 0.1},
                             cache_config=cache) for t in range(0, 21)]
    records = [_rec(float(t), prompt_tokens=500) for t in range(0, 20)]
    ramp = {"sized_from": "server", "steps": [1, 2], "tokens_per_request": 900.0,
            "predicted_knee_users": 10, "wanted_top_users": 20}
    _, [verdict] = kv.analyse(cfg, records, samples, 0.0, ramp=ramp)
    assert verdict.evidence["predicted_max_concurrency"] == 80 // 8
    assert verdict.evidence["tokens_per_request"] == 900.0
    _, [operator] = kv.analyse(cfg, records, samples, 0.0)  # steps the operator gave: as measured
    assert operator.evidence["tokens_per_request"] == 500 + cfg.workload.max_tokens


def test_bootstrap_ci_brackets_a_known_shift():
    rng = random.Random(1)
    base = [rng.gauss(1.0, 0.05) for _ in range(200)]
    cand = [x * 1.5 for x in base]
    point, low, high = bootstrap_relative_change(base, cand, row_percentile(50))
    assert point == pytest.approx(0.5, abs=1e-9)
    assert low < 0.5 < high or low == pytest.approx(0.5)
    same = bootstrap_relative_change(base, base, row_percentile(50))
    assert same is not None
    assert same[1] <= 0 <= same[2]


def test_ttft_regression_attributed_to_queueing():
    cfg = TtftRegressionConfig(resamples=200)
    rng = random.Random(2)

    def summary(queue: float, rate: float) -> dict:
        ttfts = [0.05 + queue + rng.uniform(0, 0.01) for _ in range(60)]
        return {"rate_rps": rate, "arrival_rate_rps": rate, "completion_rate_rps": 1.0,
                "samples": {"ttft_s": ttfts, "itl_mean_s": [0.01] * 60, "e2e_s": [1.0] * 60},
                "intervals": {"queue": [(queue * 3, 3)] * 20, "prefill": [(0.15, 3)] * 20,
                              "ttft": [((0.05 + queue) * 3, 3)] * 20}}

    table, verdicts = ttft.compare(cfg, summary(0.0, 0.5), summary(0.5, 4.0))
    assert verdicts[0].problem == "ttft-regression"
    assert verdicts[0].cause == "queueing"
    assert table["ttft_p50"]["regressed"]
    _, same = ttft.compare(cfg, summary(0.0, 0.5), summary(0.0, 0.5))
    assert same[0].problem == "healthy"


def test_requests_without_a_first_token_at_the_end_count_with_their_wait():
    waiting = RequestRecord(request_id="w", kind="completions", sent_at=0.0, e2e_s=7.0,
                            stopped=True)
    samples = ttft.client_samples([_rec(0.0, ttft_s=0.2), waiting])
    assert sorted(samples["ttft_s"]) == [0.2, 7.0]


def test_a_request_cut_off_before_any_answer_of_the_run_is_no_ttft():
    # CI's all-refused run: prompts over max-model-len, each refused in 22 ms; the last one was
    # sent as the run ended and stopped 1.7 ms later. Its 1.7 ms made the run "healthy"
    refused = [RequestRecord(request_id=f"r{i}", kind="completions", sent_at=float(i),
                             headers_s=0.022, e2e_s=0.022, status=400, error="HTTP 400")
               for i in range(11)]
    cut = RequestRecord(request_id="cut", kind="completions", sent_at=11.0, e2e_s=0.0017,
                        stopped=True)
    samples = ttft.client_samples([*refused, cut])
    assert samples["ttft_s"] == []
    alone = ttft.no_baseline(_summary(samples["ttft_s"]), TtftRegressionConfig().late_s)
    assert (alone.problem, alone.cause) == ("inconclusive", "no-samples")
    # waiting longer than the refusals took still counts: the server had answered others by then
    waited = RequestRecord(request_id="w", kind="completions", sent_at=11.0, e2e_s=3.0, stopped=True)
    assert ttft.client_samples([*refused, waited])["ttft_s"] == [3.0]
    # and with no answer at all in the run (every request still waiting) every wait counts
    assert ttft.client_samples([cut, waited])["ttft_s"] == [0.0017, 3.0]


def test_requests_cut_off_after_their_first_token_count_with_their_ttft_and_itls():
    # 16x load, 12 s: every request was still decoding when the run ended (measured; the
    # comparison had no sample and said healthy)
    cut = RequestRecord(request_id="c", kind="completions", sent_at=0.0, ttft_s=2.4, e2e_s=9.0,
                        itl_s=[0.1, 0.3], stopped=True)
    failed = RequestRecord(request_id="f", kind="completions", sent_at=0.0, ttft_s=0.5,
                           e2e_s=0.6, status=500, error="boom")
    samples = ttft.client_samples([_rec(0.0, ttft_s=0.2), cut, failed])
    assert sorted(samples["ttft_s"]) == [0.2, 2.4]
    assert samples["itl_mean_s"] == [pytest.approx(0.2)]
    assert samples["e2e_s"] == [1.0]  # a cut-off request's end-to-end time is not one


def _summary(ttfts: list[float]) -> dict:
    return {"rate_rps": 1.0, "arrival_rate_rps": 1.0, "completion_rate_rps": None,
            "server_means_s": {}, "samples": {"ttft_s": ttfts, "itl_mean_s": [], "e2e_s": []},
            "intervals": {}}


def test_a_run_without_any_ttft_is_inconclusive_not_healthy():
    cfg = TtftRegressionConfig(resamples=100)
    _, (verdict,) = ttft.compare(cfg, _summary([0.1] * 20), _summary([]))
    assert (verdict.problem, verdict.cause) == ("inconclusive", "no-samples")
    assert verdict.evidence["without_ttft"] == ["candidate"]
    _, (verdict,) = ttft.compare(cfg, _summary([]), _summary([]))
    assert verdict.evidence["without_ttft"] == ["baseline", "candidate"]
    alone = ttft.no_baseline(_summary([]), cfg.late_s)
    assert (alone.problem, alone.cause) == ("inconclusive", "no-samples")


def test_a_run_without_any_ttft_says_what_it_lacked_not_to_run_it_again():
    # every prompt refused: the same run would be refused again, so the next step names the refusal
    cfg = TtftRegressionConfig(rate_rps=2.0, duration_s=6.0)
    refused = [RequestRecord(request_id=str(i), kind="completions", sent_at=float(i), e2e_s=0.02,
                             status=400, error="This model's maximum context length is 2048 tokens")
               for i in range(3)]
    v = ttft.no_baseline(ttft.summarise(cfg, refused, [], 6.0), cfg.late_s)
    assert (v.problem, v.cause) == ("inconclusive", "no-samples")
    assert "HTTP 400 x3" in v.next
    assert "maximum context length" in v.next
    assert "run it again" not in v.next
    # nothing sent: 1 s at 0.2 req/s ends before its first arrival; a longer run, not the same
    quiet = TtftRegressionConfig(rate_rps=0.2, duration_s=1.0)
    v = ttft.no_baseline(ttft.summarise(quiet, [], [], 1.0), quiet.late_s)
    assert "--duration 15" in v.next  # three arrivals' worth at 0.2/s


def test_client_summary_sets_first_event_and_first_text_beside_the_server():
    from kvops.loadtest.finalize import client_summary

    # the server timed 3 first tokens (Δsum 0.060 s): the two finished requests and the one
    # the run's end cut off after its first event; the second request's first event had no text
    recs = [_rec(0.0, ttft_s=0.020, first_event_s=0.020),
            _rec(1.0, ttft_s=0.050, first_event_s=0.020),
            RequestRecord(request_id="cut", kind="completions", sent_at=2.0, first_event_s=0.026,
                          stopped=True)]
    before = MetricsSample(t=0, values={"ttft_sum": 1.0, "ttft_count": 10})
    after = MetricsSample(t=3, values={"ttft_sum": 1.060, "ttft_count": 13})
    out = client_summary(recs, [before, after])
    assert out["server_ttft_count"] == 3 == out["first_event_count"]
    assert out["first_event_client_minus_server_ms"] == pytest.approx(2.0)  # 22 ms vs 20 ms
    assert out["ttft_client_minus_server_ms"] == pytest.approx(15.0)  # 35 ms vs 20 ms
    assert out["ttft_after_first_event_ms_mean"] == pytest.approx(15.0)
    assert out["first_event_without_text"] == 1


def test_preemptions_after_a_steps_end_belong_to_the_next_step():
    # the counter rises 0.5 s after step 1 ends (10 s): the next step's users caused it
    cfg = KvExhaustionConfig(steps=[1, 2], step_s=10)
    samples = [_sample(t, running=1, waiting=0, kv_usage=0.5, preemptions=0 if t <= 10 else 3)
               for t in [x * 0.5 for x in range(0, 41)]]
    assert kv.measure_step(0, 1, 0, 10, cfg, [], samples).preemptions == 0
    assert kv.measure_step(1, 2, 10, 20, cfg, [], samples).preemptions == 3


def _fleet(unread: set[int], preempted_at: float = 9.0) -> list[MetricsSample]:
    """A two-replica fleet read once a second through FleetReadings; replica b preempts once at
    ``preempted_at`` and is missing from the readings at the times in ``unread``."""
    fleet = FleetReadings()
    readings = []
    for t in range(0, 21):
        replicas = {"a:1": _sample(t, running=1, kv_usage=0.5, preemptions=0)}
        if t not in unread:
            replicas["b:1"] = _sample(t, running=2, kv_usage=1.0, preemptions=int(t >= preempted_at))
        readings.append(fleet.add(replicas, t=float(t)))
    return readings


def test_a_replica_unread_over_a_steps_end_reports_the_steps_preemptions_at_its_next_reading():
    """Replica b preempts at 9 s, in step 0, but its scrapes fail from 8 s to 12 s: the fleet
    holds its count at 0 through the step's end, and the step must still count its preemption."""
    cfg = KvExhaustionConfig(steps=[1, 2], step_s=10)
    read = kv.measure_step(0, 1, 0, 10, cfg, [], _fleet(set()))
    assert (read.preemptions, read.counters_late_s) == (1, 0.0)
    late = kv.measure_step(0, 1, 0, 10, cfg, [], _fleet({8, 9, 10, 11, 12}))
    assert (late.preemptions, late.counters_late_s) == (1, 3.0)
    # a replica never read again within the next step cannot say when it preempted: not counted
    assert kv.measure_step(0, 1, 0, 10, cfg, [], _fleet(set(range(8, 21)))).preemptions == 0
    # the same gap with every replica read at the end: the next step's preemption stays its own
    after = _fleet({8, 9}, preempted_at=10.5)
    assert kv.measure_step(0, 1, 0, 10, cfg, [], after).preemptions == 0
    assert kv.measure_step(1, 2, 10, 20, cfg, [], after).preemptions == 1


def test_a_small_pool_is_full_when_the_next_prompt_does_not_fit():
    """Two staging replicas of 15 usable 128-token blocks, 409-token prompts (4 blocks): at 80%
    usage 3 blocks are free and no waiting request can be admitted, so a queued step is KV-bound
    though usage stays under kv_usage_bound (CI read such a step as compute-bound)."""
    cfg = KvExhaustionConfig(steps=[8], step_s=10)
    replica = {"num_gpu_blocks": "16", "block_size": "128"}
    fleet = FleetReadings()
    samples = [fleet.add({"a:1": MetricsSample(t, {"kv_usage": 0.8, "waiting": 3, "running": 3}, dict(replica)),
                          "b:1": MetricsSample(t, {"kv_usage": 0.4, "waiting": 0, "running": 2}, dict(replica))},
                         t=float(t)) for t in range(0, 11)]
    assert samples[-1].values["kv_free_blocks_min"] == 3.0  # the fullest replica's, not the fleet's 12
    records = [_rec(t, group=None, prompt_tokens=409) for t in (1.0, 2.0, 3.0)]
    step = kv.measure_step(0, 8, 0, 10, cfg, records, samples)
    assert (step.kv_free_blocks_min, step.prompt_blocks_min) == (3.0, 4)
    assert kv.classify(step, None, cfg) == kv.KV_BOUND
    short = kv.measure_step(0, 8, 0, 10, cfg, [_rec(t, group=None, prompt_tokens=300) for t in (1.0, 2.0)], samples)
    assert kv.classify(short, None, cfg) == kv.COMPUTE_BOUND  # 3 blocks hold a 300-token prompt
    # one server: usage over its num_gpu_blocks - 1 usable blocks
    one = [MetricsSample(t, {"kv_usage": 0.8, "waiting": 2, "running": 3}, dict(replica)) for t in range(0, 11)]
    assert kv.classify(kv.measure_step(0, 8, 0, 10, cfg, records, one), None, cfg) == kv.KV_BOUND


def test_a_prefix_run_that_finished_no_request_is_no_sample_not_healthy():
    # issue 41: SmolLM2 on a loaded CPU, 15 s: the one request sent was still running at the
    # end, and the verdict said "healthy, nothing to do" over a hit rate of nothing
    tokenizer = ServerTokenizer("http://127.0.0.1:9", "unused")  # no finished prompt to count
    cut = RequestRecord(request_id="c", kind="completions", sent_at=0.0, e2e_s=15.0, stopped=True)
    _, [v] = prefix.analyse([cut], [], tokenizer, 0.8, duration_s=15.0)
    assert (v.problem, v.cause) == ("inconclusive", "no-samples")
    assert v.evidence["stopped_in_flight"] == 1
    assert "--duration 31" in v.next  # long enough for it to finish twice, not the 15 s again
    refused = RequestRecord(request_id="r", kind="completions", sent_at=0.0, e2e_s=0.01, status=400,
                            error="maximum context length is 2048 tokens")
    _, [v] = prefix.analyse([refused, refused], [], tokenizer, 0.8, duration_s=15.0)
    assert "HTTP 400 x2" in v.next
    assert "--duration" not in v.next
