"""kv-exhaustion's ramp sized from the server's capacity, and the verdict of a run that never
reached a limit. Capacities are the arithmetic of vLLM's allocator: whole blocks per request,
block 0 reserved (vllm/v1/core/block_pool.py)."""

from __future__ import annotations

from kvops.core.prom import MetricsSample
from kvops.loadtest.analysis import kv, ramp
from kvops.loadtest.config import KvExhaustionConfig, apply_overrides

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


def test_a_short_budget_shortens_steps_then_leaves_the_top_out():
    cap = ramp.Capacity(num_gpu_blocks=4097, block_size=128, max_num_seqs=256, tokens_per_request=400)
    full = ramp.size(DEFAULT, cap)
    assert full.steps[-1] == 256  # 2 x 256 capped by max_users
    short = apply_overrides(DEFAULT, duration_s=20)
    assert isinstance(short, KvExhaustionConfig)
    assert short.steps is None
    r = ramp.size(short, cap)
    assert r.step_s == short.min_step_s == 5
    assert r.steps == [1, 2, 4, 8]
    assert not r.covers_knee
    assert "--duration" in ramp.next_run(r.to_dict(), short)


def test_a_whole_ramp_past_twice_the_knee_does_not_advise_the_same_run_again():
    cap = ramp.Capacity(num_gpu_blocks=61, block_size=16, max_num_seqs=256, tokens_per_request=65)
    r = ramp.size(DEFAULT, cap)
    assert r.covers_knee
    advice = ramp.next_run(r.to_dict(), DEFAULT)
    assert "less KV than" in advice
    assert "--users 48" in advice  # 4 x the knee of 12, more than the 24 just run
    assert "--duration" not in advice


def test_a_ramp_capped_by_max_users_says_to_go_past_the_cap():
    capped = KvExhaustionConfig(step_s=10, max_duration_s=600, max_users=16)
    cap = ramp.Capacity(num_gpu_blocks=4097, block_size=128, max_num_seqs=256, tokens_per_request=400)
    r = ramp.size(capped, cap)
    assert r.steps[-1] == 16
    assert not r.covers_knee
    advice = ramp.next_run(r.to_dict(), capped)
    assert "max_users 16" in advice
    assert "--users 512" in advice  # 2 x the knee of 256 (max_num_seqs), past the cap


def test_unknown_capacity_falls_back_to_the_fixed_ramp():
    r = ramp.size(DEFAULT, ramp.capacity_of(MetricsSample(t=0.0), 300))
    assert r.steps == [1, 2, 4, 8]
    assert r.capacity.knee is None
    assert "publishes no KV capacity" in ramp.next_run(r.to_dict(), DEFAULT)


def test_capacity_from_a_scrape():
    sample = MetricsSample(t=0.0, values={ramp.SCHED_MAX_SEQS: 4.0},
                           cache_config={"num_gpu_blocks": "12", "block_size": "128"})
    cap = ramp.capacity_of(sample, 388)
    assert (cap.kv_concurrency, cap.max_num_seqs, cap.knee) == (2, 4, 2)


def _step(users: int, running: float, kv_usage: float) -> kv.StepResult:
    return kv.StepResult(0, users, 0, 10, 5, 0, 0.1, 0.1, 10, 0, 0.0, running, kv_usage, 0)


def test_no_limit_on_a_sized_ramp_is_inconclusive_never_healthy():
    r = ramp.size(apply_overrides(DEFAULT, duration_s=20),  # type: ignore[arg-type]
                  ramp.Capacity(4097, 128, 256, 400))
    steps = [_step(u, u, 0.01 * u) for u in r.steps]
    v = kv._no_limit(DEFAULT, steps, {}, r.to_dict())
    assert (v.problem, v.cause) == ("inconclusive", "limit-not-reached")
    assert v.evidence["kv_usage_max_reached"] == 0.08
    assert v.evidence["max_users_tested"] == 8
    assert "--duration" in v.next


def test_no_limit_at_the_load_the_operator_asked_for_is_inconclusive_too():
    # --users 4 against a cache that holds ~15: the load fit, the limit was never tested
    v = kv._no_limit(DEFAULT, [_step(1, 1, 0.01), _step(4, 4, 0.04)],
                     {"predicted_max_concurrency": 15}, None)
    assert (v.problem, v.cause) == ("inconclusive", "limit-not-reached")
    assert v.evidence["limit_reached"] is False
    assert v.evidence["max_users_tested"] == 4
    assert "without --users" in v.next
    assert "--users 30" in v.next


def test_users_the_server_never_saw_are_client_bound():
    v = kv._no_limit(DEFAULT, [_step(1, 1, 0.01), _step(64, 20, 0.2)], {}, None)
    assert (v.problem, v.cause) == ("inconclusive", "client-bound")
