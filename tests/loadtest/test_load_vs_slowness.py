"""ttft-regression weighs load before phases, on hand-built summaries whose answer follows from
the definitions: more offered work with every phase slower is `load`; time in the queue is
`queueing`; a phase slower at the same load is that phase; a client behind its schedule with
users to spare makes the comparison `inconclusive`."""

from __future__ import annotations

import random
from typing import Any

from kvops.loadtest.analysis import load, ttft
from kvops.loadtest.config import TtftRegressionConfig
from kvops.loadtest.records import RequestRecord

CFG = TtftRegressionConfig(resamples=200)


def summary(rate: float, *, queue: float = 0.0, prefill: float = 0.05, prompt: float = 100.0,
            late: float = 0.0, in_flight: int = 3, users: int = 32, seed: int = 0,
            late_sends: int = 60) -> dict[str, Any]:
    rng = random.Random(seed)
    ttfts = [queue + prefill + 0.01 + rng.uniform(0, 0.005) for _ in range(60)]
    return {
        "rate_rps": rate, "users": users, "arrival_rate_rps": rate, "completion_rate_rps": rate,
        "lateness_p99_s": late,
        "load": {"arrival_rate_rps": rate, "prompt_tokens_mean": prompt, "output_tokens_mean": 16.0,
                 "token_rate": rate * (prompt + 16.0), "in_flight_max": in_flight},
        "samples": {"ttft_s": ttfts, "itl_mean_s": [0.01] * 60, "e2e_s": [0.3] * 60,
                    "lateness_s": [late] * late_sends + [0.001] * (60 - late_sends)},
        "intervals": {"queue": [(queue * 3, 3)] * 20, "prefill": [(prefill * 3, 3)] * 20,
                      "ttft": [((queue + prefill + 0.01) * 3, 3)] * 20},
    }


def _verdict(base: dict[str, Any], cand: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    _, (v,) = ttft.compare(CFG, base, cand)
    return v.problem, v.cause, v.evidence


def test_more_load_with_every_phase_slower_is_load_not_prefill():
    # the run: 80x the arrival rate, same prompts, queue +0.2 ms, prefill 4x slower
    problem, cause, ev = _verdict(summary(0.5), summary(40.0, queue=0.0002, prefill=0.2, seed=1))
    assert (problem, cause) == ("ttft-regression", "load")
    assert ev["load_ratio"]["arrival_rate_rps"] == 80.0
    assert ev["comparable_load"] is False
    assert ev["comparison_reliable"] is True


def test_longer_prompts_are_load_too():
    problem, cause, ev = _verdict(summary(1.0), summary(1.0, prompt=400.0, prefill=0.2, seed=1))
    assert (problem, cause) == ("ttft-regression", "load")
    assert ev["load_ratio"]["prompt_tokens_mean"] == 4.0


def test_longer_prompts_at_the_same_token_rate_are_load_not_prefill():
    # 4x longer prompts at a quarter of the rate: the same tokens per second, each request 4x
    # the prefill; the phase was not compared like for like
    base, cand = summary(4.0), summary(1.0, prompt=400.0, prefill=0.2, seed=1)
    cand["load"]["token_rate"] = base["load"]["token_rate"]
    problem, cause, ev = _verdict(base, cand)
    assert (problem, cause) == ("ttft-regression", "load")
    assert ev["comparable_load"] is False
    assert ev["load_ratio"]["prompt_tokens_mean"] == 4.0
    _, (v,) = ttft.compare(CFG, base, cand)
    assert "prompt_tokens_mean x4.0" in v.next


def test_time_waiting_for_admission_is_queueing_even_at_higher_load():
    problem, cause, _ = _verdict(summary(0.5), summary(20.0, queue=0.5, seed=1))
    assert (problem, cause) == ("ttft-regression", "queueing")


def test_slower_prefill_at_the_same_load_is_prefill():
    problem, cause, ev = _verdict(summary(1.0), summary(1.05, prefill=0.2, seed=1))
    assert (problem, cause) == ("ttft-regression", "prefill")
    assert ev["comparable_load"] is True


def test_same_load_same_times_is_healthy():
    problem, _, ev = _verdict(summary(1.0), summary(1.0, seed=1))
    assert problem == "healthy"
    assert ev["comparison_reliable"] is True


def test_client_behind_with_users_to_spare_is_inconclusive():
    problem, cause, ev = _verdict(summary(0.5), summary(40.0, prefill=0.2, late=6.2, in_flight=5,
                                                        seed=1))
    assert (problem, cause) == ("inconclusive", "client-bound")
    assert ev["comparison_reliable"] is False
    assert ev["client_behind"][0]["side"] == "candidate"
    assert ev["client_behind"][0]["lateness_p99_s"] == 6.2
    assert ev["client_behind"][0]["late_share"] == 1.0


def test_a_few_late_sends_leave_the_comparison_reliable():
    """CI's queueing run: a few of ~40 sends late at start-up (p99 over 1 s is the worst one); 3
    of 60 is 5%, not more, so the load compared is the load asked for."""
    problem, cause, ev = _verdict(summary(1.0), summary(1.0, queue=0.5, late=3.7, late_sends=3,
                                                        seed=1))
    assert (problem, cause) == ("ttft-regression", "queueing")
    assert ev["comparison_reliable"] is True
    assert "client_behind" not in ev
    problem, cause, ev = _verdict(summary(1.0), summary(1.0, queue=0.5, late=3.7, late_sends=4,
                                                        seed=1))
    assert (problem, cause) == ("inconclusive", "client-bound")
    assert ev["client_behind"][0]["late_share"] == round(4 / 60, 3)


def test_a_server_ttft_growth_beyond_the_lateness_is_the_servers_verdict():
    """CI's queueing run on a starved machine: 13% of sends over 1 s late (p99 1.75 s), while
    vLLM's own histograms put 3.3 s more in the queue: more than a burst of late sends adds."""
    problem, cause, ev = _verdict(summary(1.0), summary(1.0, queue=3.3, late=1.75, seed=1))
    assert (problem, cause) == ("ttft-regression", "queueing")
    assert ev["verdict_basis"] == "server"
    assert ev["comparison_reliable"] is False
    assert ev["client_behind"][0]["lateness_p99_s"] == 1.75


def test_a_server_ttft_growth_within_the_lateness_stays_client_bound():
    problem, cause, ev = _verdict(summary(1.0), summary(1.0, queue=1.5, late=1.75, seed=1))
    assert (problem, cause) == ("inconclusive", "client-bound")
    assert "verdict_basis" not in ev


def test_old_summaries_without_lateness_samples_use_the_p99():
    cand = summary(1.0, queue=0.5, late=3.7, seed=1)
    del cand["samples"]["lateness_s"]
    problem, cause, ev = _verdict(summary(1.0), cand)
    assert (problem, cause) == ("inconclusive", "client-bound")
    assert ev["client_behind"][0]["late_share"] is None


def test_client_behind_because_every_user_waited_keeps_the_server_side_cause():
    _, (v,) = ttft.compare(CFG, summary(0.5), summary(40.0, prefill=0.2, late=6.2, in_flight=32,
                                                       seed=1))
    assert (v.problem, v.cause) == ("ttft-regression", "load")
    assert v.evidence["comparison_reliable"] is False
    assert "all 32 users were waiting" in v.evidence["client_behind"][0]["why"]
    assert "unreliable" in v.next


def test_old_baselines_without_a_load_section_compare_arrival_rates():
    base = summary(0.5)
    del base["load"]
    problem, cause, ev = _verdict(base, summary(40.0, prefill=0.2, seed=1))
    assert (problem, cause) == ("ttft-regression", "load")
    assert ev["work_ratio"] == 80.0


def _rec(sent: float, e2e: float) -> RequestRecord:
    return RequestRecord(request_id=str(sent), kind="completions", sent_at=sent, e2e_s=e2e, ok=True,
                         prompt_tokens=10, completion_tokens=4)


def test_in_flight_from_the_clients_stamps():
    # [0, 2) [1, 3) [1.5, 2.5): three at once from 1.5 to 2; 5 s of requests over 3 s
    mean, peak = load.in_flight([_rec(0.0, 2.0), _rec(1.0, 2.0), _rec(1.5, 1.0)])
    assert peak == 3
    assert mean == round(5.0 / 3.0, 3)
    out = load.offered([_rec(0.0, 2.0)], [], 2.0)
    assert out["token_rate"] == 28.0


def test_a_baseline_recorded_behind_its_schedule_says_it_is_no_baseline():
    """Recorded while its client was starved (CI, stop 20: sends 5.8 s late), a baseline made
    every later comparison inconclusive; the recording run now says so itself, exit 3."""
    from kvops.loadtest.analysis.ttft import no_baseline

    def recorded(rate: float, **kwargs: Any) -> dict[str, Any]:
        return {**summary(rate, **kwargs), "ttft_p50_s": 0.06, "server_means_s": {}}

    late = no_baseline(recorded(1.0, late=5.8, late_sends=12, in_flight=9), CFG.late_s)
    assert (late.problem, late.cause) == ("inconclusive", "client-bound")
    assert late.evidence["client_behind"][0]["late_share"] == 0.2
    assert "no baseline" in late.next
    assert no_baseline(recorded(1.0), CFG.late_s).problem == "healthy"
    # a few late sends (5%), or late because every user waited on the server: still a baseline
    assert no_baseline(recorded(1.0, late=5.8, late_sends=3), CFG.late_s).problem == "healthy"
    assert no_baseline(recorded(1.0, late=5.8, in_flight=32), CFG.late_s).problem == "healthy"
