"""kv-exhaustion's ramp sized from the server's capacity, and the verdict of a run that never
reached a limit. Capacities are the arithmetic of vLLM's allocator: whole blocks per request,
block 0 reserved (vllm/v1/core/block_pool.py)."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from kvops.core.prom import MetricsSample
from kvops.loadtest.analysis import kv, ramp
from kvops.loadtest.config import KvExhaustionConfig, apply_overrides, doubling_steps, load_config

DEFAULT = KvExhaustionConfig(step_s=10, max_duration_s=120)


def test_the_issues_server_ramps_past_twice_its_knee():
    # 61 blocks of 16, requests of 65 tokens (5 blocks): 12 fit; the old ramp stopped at 8
    cap = ramp.Capacity(num_gpu_blocks=61, block_size=16, max_num_seqs=256, tokens_per_request=65)
    assert cap.kv_concurrency == 12
    r = ramp.size(DEFAULT, cap)
    assert r.steps == [1, 2, 4, 8, 16, 24]
    assert r.step_s == 10
    assert r.covers_knee


def test_max_num_seqs_below_the_kv_limit_sets_the_knee():
    cap = ramp.Capacity(num_gpu_blocks=4097, block_size=128, max_num_seqs=2, tokens_per_request=200)
    assert cap.knee == 2
    assert ramp.size(DEFAULT, cap).steps == [1, 2, 4, 8]  # never below the old 1, 2, 4, 8


def test_the_issues_48_block_cache_ramps_to_twice_its_knee_in_40_s():
    # issue 41: the packaged scenario, --duration 40, SmolLM2 on 48 blocks of 128 (47 usable)
    # and 387-token requests (4 blocks): a knee of 11. 40 s / 6 steps floored to 5 steps and the
    # ramp stopped at 16, short of the 22 it targets
    run = apply_overrides(load_config("kv-exhaustion"), duration_s=40)
    assert isinstance(run, KvExhaustionConfig)
    cap = ramp.Capacity(num_gpu_blocks=48, block_size=128, max_num_seqs=128, tokens_per_request=387)
    assert cap.knee == 11
    r = ramp.size(run, cap)
    assert r.steps == [1, 2, 4, 8, 16, 22]
    assert r.steps[-1] == 2 * cap.knee == r.wanted_top
    assert r.covers_knee
    assert len(r.steps) * r.step_s <= run.max_duration_s + 1e-9


def test_a_short_budget_shortens_steps_then_leaves_low_steps_out_never_the_top():
    cap = ramp.Capacity(num_gpu_blocks=4097, block_size=128, max_num_seqs=256, tokens_per_request=400)
    full = ramp.size(DEFAULT, cap)
    assert full.steps[-1] == 256  # 2 x 256 capped by max_users
    short = apply_overrides(DEFAULT, duration_s=20)
    assert isinstance(short, KvExhaustionConfig)
    assert short.steps is None
    r = ramp.size(short, cap)
    assert r.step_s == short.min_step_s == 5
    # the unloaded first step, then the top three: the knee (256) and what lies just below it
    assert r.steps == [1, 64, 128, 256]


@given(blocks=st.integers(2, 100_000), block_size=st.sampled_from([16, 32, 128]),
       seqs=st.one_of(st.none(), st.integers(1, 1024)), tokens=st.floats(1, 20_000),
       budget=st.floats(1, 1000), step_s=st.floats(1, 60), min_step_s=st.floats(0.5, 30),
       max_users=st.integers(1, 4096))
def test_a_sized_ramp_ends_at_its_top_and_fits_its_budget(blocks, block_size, seqs, tokens, budget,
                                                          step_s, min_step_s, max_users):
    config = KvExhaustionConfig(max_duration_s=budget, step_s=step_s, min_step_s=min_step_s,
                                max_users=max_users)
    r = ramp.size(config, ramp.Capacity(blocks, block_size, seqs, tokens))
    assert r.steps[-1] == r.wanted_top
    assert r.steps == sorted(set(r.steps))
    assert set(r.steps) <= set(doubling_steps(r.wanted_top))
    if len(r.steps) > 1:  # one step may outlast a budget shorter than min_step_s
        assert len(r.steps) * r.step_s <= budget * (1 + 1e-9)
    knee = r.capacity.knee
    if knee is not None and 2 * knee <= max_users:
        assert r.covers_knee


def _step(users: int, running: float, kv_usage: float, request_s: float | None = None) -> kv.StepResult:
    return kv.StepResult(0, users, 0, 10, 5, 0, 0.1, 0.1, 10, 0, 0.0, running, kv_usage, 0,
                         request_s_p50=request_s)


def _sized_run(scenario: KvExhaustionConfig, cap: ramp.Capacity, top_kv_usage: float,
               request_s: float | None = None) -> tuple[KvExhaustionConfig, kv.Verdict]:
    """A sized ramp in which no step bound, its top step at ``top_kv_usage``: the config it ran
    with (as the scenario caches it) and its verdict."""
    r = ramp.size(scenario, cap)
    run = scenario.model_copy(update={"steps": r.steps, "step_s": r.step_s})
    steps = [_step(u, u, top_kv_usage * u / r.steps[-1], request_s) for u in r.steps]
    return run, kv._no_limit(run, steps, {}, r.to_dict())


def _given_run(scenario: KvExhaustionConfig, users: int, duration_s: float, top_kv_usage: float,
               predicted: int | None, request_s: float | None = None
               ) -> tuple[KvExhaustionConfig, kv.Verdict]:
    """``--users U --duration D`` and no step bound; ``predicted``: the cache's concurrency."""
    run = apply_overrides(scenario, users=users, duration_s=duration_s)
    assert isinstance(run, KvExhaustionConfig)
    assert run.steps
    steps = [_step(u, u, top_kv_usage * u / users, request_s) for u in run.steps]
    evidence = {"predicted_max_concurrency": predicted} if predicted else {}
    return run, kv._no_limit(run, steps, evidence, None)


def _advised(verdict: kv.Verdict, scenario: KvExhaustionConfig) -> KvExhaustionConfig:
    """The run the verdict's ``next`` asks for, as `kvops loadtest` would configure it."""
    users, duration = re.search(r"--users (\d+)", verdict.next), re.search(r"--duration (\d+)", verdict.next)
    assert users, verdict.next
    assert duration, verdict.next
    advised = apply_overrides(scenario, users=int(users[1]), duration_s=float(duration[1]))
    assert isinstance(advised, KvExhaustionConfig)
    assert advised.steps
    return advised


def _goes_beyond(verdict: kv.Verdict, run: KvExhaustionConfig, scenario: KvExhaustionConfig) -> bool:
    """The advised run offers more users than the run did, or the same users for longer steps."""
    advised, ran = _advised(verdict, scenario), run.steps or []
    assert advised.steps
    return advised.steps[-1] > ran[-1] or (advised.steps[-1] == ran[-1] and advised.step_s > run.step_s)


def test_the_issues_full_cache_without_a_queue_asks_for_longer_steps_not_the_same_run():
    # issue 41: 98% KV at the top and no step bound, a request outliving the 6.7-s steps; it
    # advised "rerun with --duration 40", the run it had just done
    scenario = apply_overrides(load_config("kv-exhaustion"), duration_s=40)
    assert isinstance(scenario, KvExhaustionConfig)
    run, v = _sized_run(scenario, ramp.Capacity(48, 128, 128, 387), 0.98, request_s=14.0)
    assert (v.problem, v.cause) == ("inconclusive", "limit-not-reached")
    assert v.evidence["max_users_tested"] == 22
    assert "filled (98%)" in v.next
    assert "--duration 40 " not in v.next
    advised = _advised(v, scenario)
    assert advised.steps == run.steps  # the same users, 1 ... 22
    # steps long enough to see two 14-s requests through after the settle share
    assert advised.step_s >= 2 * 14.0 / (1 - scenario.settle_fraction)
    assert advised.step_s >= 2 * run.step_s


def test_a_whole_ramp_past_twice_the_knee_asks_for_more_users():
    run, v = _sized_run(DEFAULT, ramp.Capacity(61, 16, 256, 65), 0.3)
    assert run.steps == [1, 2, 4, 8, 16, 24]
    assert "less KV than" in v.next
    assert "--users 48 " in v.next  # 4 x the knee of 12, more than the 24 just run
    assert _advised(v, DEFAULT).step_s == run.step_s  # more users: steps as long as these were


def test_a_ramp_capped_by_max_users_says_to_go_past_the_cap():
    capped = KvExhaustionConfig(step_s=10, max_duration_s=600, max_users=16)
    run, v = _sized_run(capped, ramp.Capacity(4097, 128, 256, 400), 0.05)
    assert run.steps[-1] == 16
    assert "max_users 16" in v.next
    assert "--users 512 " in v.next  # 2 x the knee of 256 (max_num_seqs), past the cap


def test_unknown_capacity_falls_back_to_the_fixed_ramp():
    r = ramp.size(DEFAULT, ramp.capacity_of(MetricsSample(t=0.0), 300))
    assert r.steps == [1, 2, 4, 8]
    assert r.capacity.knee is None
    run, v = _sized_run(DEFAULT, ramp.capacity_of(MetricsSample(t=0.0), 300), 0.1)
    assert "publishes no KV capacity" in v.next
    assert _goes_beyond(v, run, DEFAULT)


def test_capacity_from_a_scrape():
    sample = MetricsSample(t=0.0, values={ramp.SCHED_MAX_SEQS: 4.0},
                           cache_config={"num_gpu_blocks": "12", "block_size": "128"})
    cap = ramp.capacity_of(sample, 388)
    assert (cap.kv_concurrency, cap.max_num_seqs, cap.knee) == (2, 4, 2)


def test_no_limit_on_a_sized_ramp_is_inconclusive_never_healthy():
    short = apply_overrides(DEFAULT, duration_s=20)
    assert isinstance(short, KvExhaustionConfig)
    run, v = _sized_run(short, ramp.Capacity(4097, 128, 256, 400), 0.08)
    assert (v.problem, v.cause) == ("inconclusive", "limit-not-reached")
    assert v.evidence["kv_usage_max_reached"] == 0.08
    assert v.evidence["max_users_tested"] == 256
    assert _goes_beyond(v, run, short)


def test_no_limit_at_the_load_the_operator_asked_for_is_inconclusive_too():
    # --users 4 against a cache that holds ~15: the load fit, the limit was never tested
    run, v = _given_run(DEFAULT, 4, 16, 0.04, predicted=15)
    assert (v.problem, v.cause) == ("inconclusive", "limit-not-reached")
    assert v.evidence["limit_reached"] is False
    assert v.evidence["max_users_tested"] == 4
    assert "without --users" in v.next
    assert "--users 30 " in v.next
    assert _goes_beyond(v, run, DEFAULT)


def test_the_operators_twice_the_prediction_is_not_advised_again():
    # --users 30 against the same cache: 30 was what it advised for --users 4; nothing bound
    run, v = _given_run(DEFAULT, 30, 40, 0.5, predicted=15)
    assert "--users 30 " not in v.next
    assert "--users 60 " in v.next
    assert _goes_beyond(v, run, DEFAULT)


def test_the_operators_full_cache_without_a_queue_asks_for_longer_steps():
    run, v = _given_run(DEFAULT, 16, 40, 0.97, predicted=11, request_s=3.0)
    assert "--users 16 " in v.next
    assert "--duration 40 " not in v.next
    assert _advised(v, DEFAULT).step_s >= 2 * run.step_s


@given(sized=st.booleans(), top=st.integers(1, 512), knee=st.one_of(st.none(), st.integers(1, 512)),
       usage=st.floats(0, 1), request_s=st.one_of(st.none(), st.floats(0.01, 120)),
       duration=st.integers(1, 600), max_users=st.integers(1, 512))
def test_a_next_run_never_repeats_the_run(sized, top, knee, usage, request_s, duration, max_users):
    scenario = KvExhaustionConfig(max_duration_s=duration, max_users=max_users)
    if sized:
        blocks = None if knee is None else knee * 4 + 1  # 4-block requests: ``knee`` of them fit
        run, v = _sized_run(scenario, ramp.Capacity(blocks, 128, None, 500), usage, request_s)
    else:
        run, v = _given_run(scenario, top, duration, usage, knee, request_s)
    assert (v.problem, v.cause) == ("inconclusive", "limit-not-reached")
    assert _goes_beyond(v, run, scenario), v.next


def test_users_the_server_never_saw_are_client_bound():
    v = kv._no_limit(DEFAULT, [_step(1, 1, 0.01), _step(64, 20, 0.2)], {}, None)
    assert (v.problem, v.cause) == ("inconclusive", "client-bound")
    assert "--workers 2 " in v.next  # one process ran it
    # a master and two workers fell behind: more than two, not "--workers N" again
    v = kv._no_limit(DEFAULT, [_step(1, 1, 0.01), _step(64, 20, 0.2)], {}, None, processes=2)
    assert "--workers 4 " in v.next
