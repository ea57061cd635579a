"""The admission policy against adversarial request sequences (hypothesis).

The oracle is a small paged-KV engine written here, independently of the policy: sequences grow
one token per step, take a block whenever they cross a block boundary, and when no block is free
the newest running sequence is preempted and recomputed later, as vLLM's scheduler does
(vllm/v1/core/sched/scheduler.py, RUNNING loop). The policy only decides who may start. Under
``strict`` no sequence may ever be preempted, whatever arrives; under ``off`` the same engine
does preempt, which shows that the engine can fail the property.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvops.core.admission.policy import (
    AdmissionPolicy,
    DrainRate,
    KVBudget,
    OutputLengthQuantile,
    Policy,
    QueueBudget,
    QueueState,
    RequestShape,
    ReservationLedger,
    blocks_for_tokens,
    queue_decision,
    spec_decode_lookahead_tokens,
)

BLOCK = 16


@dataclass
class Seq:
    prompt: int
    max_tokens: int | None
    stop_at: int  # output length at which it stops by itself (EOS)
    abort_after: int | None  # steps after arrival at which the client disconnects
    arrival: int
    output: int = 0
    tokens: int = 0  # tokens whose KV is held
    preemptions: int = 0
    state: str = "new"


@dataclass
class Engine:
    """A paged KV cache and an FCFS scheduler whose only admission input is the policy."""

    policy: AdmissionPolicy
    max_model_len: int
    free_blocks: int = field(init=False)
    waiting: list[Seq] = field(default_factory=list)
    running: list[Seq] = field(default_factory=list)
    preemptions: int = 0
    rejected: int = 0
    finished: int = 0
    aborted: int = 0

    def __post_init__(self) -> None:
        self.free_blocks = self.policy.budget.usable_blocks

    def shape(self, s: Seq) -> RequestShape:
        return RequestShape(s.prompt, s.max_tokens, s.output)

    def target(self, s: Seq) -> int:
        cap = self.max_model_len - s.prompt
        return min(s.stop_at, cap if s.max_tokens is None else min(s.max_tokens, cap))

    def arrive(self, seqs: list[Seq], n: int) -> None:
        if self.policy.never_fits(self.shape(seqs[0]), n) is not None:
            self.rejected += len(seqs)
            return
        for s in seqs:
            s.state = "waiting"
        self.waiting.extend(seqs)

    def release(self, s: Seq) -> None:
        self.free_blocks += blocks_for_tokens(s.tokens, BLOCK)
        s.tokens = 0

    def step(self, now: int) -> None:
        for s in [s for s in self.running + self.waiting if s.abort_after is not None and now >= s.arrival + s.abort_after]:
            (self.running if s in self.running else self.waiting).remove(s)
            self.release(s)
            s.state = "aborted"
            self.aborted += 1
        self.decode()
        self.admit()

    def make_room(self, s: Seq, extra: int) -> None:
        """Preempt the newest running sequences (vLLM's FCFS preemption) until ``extra`` blocks
        are free for ``s``, or ``s`` itself was preempted."""
        while extra > self.free_blocks:
            victim = self.running.pop()
            self.release(victim)
            victim.preemptions += 1
            victim.state = "waiting"
            self.preemptions += 1
            self.waiting.insert(0, victim)
            if victim is s:
                break

    def decode(self) -> None:
        i = 0
        while i < len(self.running):
            s = self.running[i]
            extra = blocks_for_tokens(s.tokens + 1, BLOCK) - blocks_for_tokens(s.tokens, BLOCK)
            self.make_room(s, extra)
            if s.state != "running":
                continue
            self.free_blocks -= extra
            s.tokens += 1
            s.output += 1
            if s.output >= self.target(s):
                self.running.remove(s)
                self.release(s)
                s.state = "done"
                self.finished += 1
                self.policy.record_finished(s.output)
                continue
            i += 1

    def admit(self) -> None:
        reserved = sum(self.policy.reserve_blocks(self.shape(s)) for s in self.running)
        while self.waiting:
            head = self.waiting[0]
            decision = self.policy.admit(self.shape(head), reserved, len(self.running))
            # Prefill recomputes the prompt and any output a preempted sequence already had.
            need_now = blocks_for_tokens(head.prompt + head.output, BLOCK)
            if not decision.admit or need_now > self.free_blocks:
                return
            self.waiting.pop(0)
            self.free_blocks -= need_now
            head.tokens = head.prompt + head.output
            head.state = "running"
            self.running.append(head)
            reserved += decision.need_blocks


@st.composite
def workloads(draw: st.DrawFn) -> tuple[int, int, list[tuple[int, int, list[Seq]]]]:
    usable = draw(st.integers(8, 64))
    max_model_len = draw(st.integers(2, usable)) * BLOCK  # vLLM refuses to start otherwise
    arrivals = []
    for _ in range(draw(st.integers(1, 25))):
        at = draw(st.integers(0, 40))
        burst = draw(st.integers(1, 6))
        for _ in range(burst):
            prompt = draw(st.integers(1, max_model_len - 1))
            max_tokens = draw(st.one_of(st.none(), st.integers(1, 4 * max_model_len)))  # huge too
            n = draw(st.integers(1, 3))
            seqs = [
                Seq(
                    prompt=prompt,
                    max_tokens=max_tokens,
                    stop_at=draw(st.integers(1, max_model_len)),
                    abort_after=draw(st.one_of(st.none(), st.integers(0, 60))),
                    arrival=at,
                )
                for _ in range(n)
            ]
            arrivals.append((at, n, seqs))
    return usable, max_model_len, arrivals


def run(policy_name: Policy, usable: int, max_model_len: int, arrivals, headroom: int = 0, **kw) -> Engine:
    budget = KVBudget(usable, BLOCK, max_model_len, headroom_blocks=headroom)
    engine = Engine(AdmissionPolicy(budget, policy_name, **kw), max_model_len)
    horizon = max(at for at, _, _ in arrivals) + sum(
        len(seqs) * max_model_len * 2 for _, _, seqs in arrivals
    )
    for now in range(horizon):
        for at, n, seqs in arrivals:
            if at == now:
                engine.arrive(seqs, n)
        engine.step(now)
        if policy_name != "off" and engine.running:
            # The reservation invariant behind "no preemption" (idle admissions excepted).
            reserved = sum(engine.policy.reserve_blocks(engine.shape(s)) for s in engine.running)
            assert len(engine.running) == 1 or reserved + headroom <= usable or policy_name == "expected"
        if not engine.waiting and not engine.running and now > max(at for at, _, _ in arrivals):
            break
    return engine


@settings(max_examples=150, deadline=None)
@given(workloads(), st.integers(0, 4))
def test_strict_never_preempts_and_answers_everyone(workload, headroom):
    usable, max_model_len, arrivals = workload
    engine = run("strict", usable, max_model_len, arrivals, headroom=headroom)
    total = sum(len(seqs) for _, _, seqs in arrivals)
    assert engine.preemptions == 0
    assert not engine.waiting, "a request was left hanging"
    assert not engine.running, "a request was left hanging"
    assert engine.finished + engine.aborted + engine.rejected == total


@settings(max_examples=100, deadline=None)
@given(workloads(), st.floats(0.1, 1.0))
def test_expected_policy_always_drains_even_with_preemptions(workload, quantile):
    usable, max_model_len, arrivals = workload
    engine = run("expected", usable, max_model_len, arrivals, quantile=quantile, min_samples=3)
    total = sum(len(seqs) for _, _, seqs in arrivals)
    assert not engine.waiting
    assert not engine.running
    assert engine.finished + engine.aborted + engine.rejected == total


def test_the_engine_does_preempt_without_admission():
    """A burst of long generations: prompts fit, decode growth does not."""
    arrivals = [(0, 1, [Seq(prompt=16, max_tokens=200, stop_at=200, abort_after=None, arrival=0) for _ in range(1)]) for _ in range(8)]
    off = run("off", 16, 256, arrivals)
    strict = run("strict", 16, 256, arrivals)
    assert off.preemptions > 0
    assert strict.preemptions == 0
    assert off.finished == strict.finished == 8


@given(
    st.integers(1, 4096), st.integers(0, 4096), st.one_of(st.none(), st.integers(1, 8192)),
    st.integers(1, 50),
)
def test_reservation_bounds(prompt, output, max_tokens, samples):
    """expected reserves at least what a (re-admitted) sequence holds + 1, at most the worst case."""
    max_model_len = 8192
    policy = AdmissionPolicy(KVBudget(1024, BLOCK, max_model_len), "expected", 0.5, min_samples=1)
    for k in range(samples):
        policy.record_finished(k)
    shape = RequestShape(prompt, max_tokens, output)
    worst = policy.worst_tokens(shape)
    reserve = policy.reserve_tokens(shape)
    assert reserve <= worst
    assert reserve >= min(worst, prompt + output + 1)
    strict = AdmissionPolicy(KVBudget(1024, BLOCK, max_model_len), "strict")
    assert strict.reserve_tokens(shape) == worst == min(prompt + (max_tokens or max_model_len), max_model_len)


@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=300), st.floats(0.01, 1.0), st.integers(1, 100))
def test_output_quantile_matches_numpy_over_the_window(lengths, q, window):
    est = OutputLengthQuantile(q, window)
    for value in lengths:
        est.add(value)
    recent = lengths[-window:]
    assert est.value() == int(np.percentile(recent, q * 100, method="inverted_cdf"))


@given(st.integers(0, 10**6), st.integers(1, 512))
def test_blocks_for_tokens_is_ceiling_division(tokens, block):
    assert blocks_for_tokens(tokens, block) == math.ceil(tokens / block)


@given(st.integers(1, 4), st.integers(1, 8192), st.one_of(st.none(), st.integers(1, 8192)))
def test_never_fits_iff_worst_case_exceeds_the_cache(n, prompt, max_tokens):
    usable, max_model_len = 64, 1024
    policy = AdmissionPolicy(KVBudget(usable, BLOCK, max_model_len), "strict")
    shape = RequestShape(min(prompt, max_model_len - 1), max_tokens)
    tokens = min(shape.prompt_tokens + (max_tokens or max_model_len), max_model_len)
    expected_refusal = n * math.ceil(tokens / BLOCK) > usable
    why = policy.never_fits(shape, n)
    assert (why is not None) == expected_refusal
    if why:
        assert str(usable * BLOCK) in why
        assert "\n" not in why


def test_never_fits_speaks_the_requests_api():
    policy = AdmissionPolicy(KVBudget(8, BLOCK, 1 << 20), "strict")
    shape = RequestShape(10, 10 * 8 * BLOCK)
    chat = policy.never_fits(shape, 2)
    assert chat is not None
    assert chat.endswith("lower max_tokens or n")
    assert "n=2 x (prompt 10 + max_tokens 1280)" in chat
    responses = policy.never_fits(shape, 1, field="max_output_tokens", has_n=False)
    assert responses is not None
    assert responses.endswith("lower max_output_tokens")
    assert "(prompt 10 + max_output_tokens 1280," in responses
    assert "n=" not in responses


@given(
    st.integers(0, 500), st.integers(0, 10**6), st.floats(0.0, 50.0), st.integers(1, 4),
    st.one_of(st.none(), st.integers(1, 200)), st.one_of(st.none(), st.integers(1, 10**6)),
    st.one_of(st.none(), st.floats(0.1, 100.0)), st.integers(1, 120),
)
def test_queue_decision_respects_every_limit(queued, kv, drain, n, max_req, max_kv, max_wait, retry_max):
    budget = QueueBudget(max_req, max_kv, max_wait, retry_max)
    state = QueueState(queued, kv if queued else 0, drain)
    d = queue_decision(budget, state, n, request_kv_tokens=n * 100)
    over_requests = max_req is not None and queued + n > max_req
    over_kv = max_kv is not None and queued > 0 and state.queued_kv_tokens + n * 100 > max_kv
    # No drain measured yet: no wait prediction, so only the other limits can refuse.
    over_wait = max_wait is not None and queued > 0 and drain > 0 and (queued + n) / drain > max_wait
    assert d.admit == (not (over_requests or over_kv or over_wait))
    if not d.admit:
        assert 1 <= d.retry_after_s <= retry_max


def test_retry_after_follows_the_drain_rate():
    budget = QueueBudget(max_queued_requests=10, retry_after_max_s=600)
    slow = queue_decision(budget, QueueState(30, 0, drain_rps=1.0))
    fast = queue_decision(budget, QueueState(30, 0, drain_rps=10.0))
    assert (slow.retry_after_s, fast.retry_after_s) == (21, 3)  # (30 + 1 - 10) / rate, rounded up


def test_drain_rate_counts_finishes_in_its_window():
    rate = DrainRate(window_s=10.0)
    for t in range(20):
        rate.record(float(t), 2)
    # finishes at t=9..19 remain (t >= 19 - 10): 11 stamps x 2 over a 10 s span
    assert rate.rate(19.0) == pytest.approx(22 / 10.0)
    assert rate.rate(100.0) == 0.0


def test_requests_in_prefill_that_fit_are_not_counted_as_waiting():
    policy = AdmissionPolicy(KVBudget(usable_blocks=10, block_size=BLOCK, max_model_len=160), "strict")
    four = RequestShape(prompt_tokens=10, max_tokens=54)  # 64 tokens: 4 blocks
    # 4 blocks started + 4 pending fit in 10; the next 4-block request does not, nor the 1-block
    # request behind it (FCFS).
    small = RequestShape(prompt_tokens=1, max_tokens=1)
    waiting = policy.waiting_behind_budget([four], [four, four, small])
    assert waiting == [four, small]
    assert policy.waiting_behind_budget([], [four, four]) == []


@given(st.lists(st.tuples(st.integers(1, 900), st.one_of(st.none(), st.integers(1, 900)), st.integers(0, 100)), max_size=40),
       st.sampled_from(["strict", "expected"]))
def test_ledger_totals_equal_the_policy_sum(shapes, policy_name):
    policy = AdmissionPolicy(KVBudget(512, BLOCK, 1024), policy_name, 0.5, min_samples=1)
    policy.record_finished(10)
    ledger = ReservationLedger(policy)
    batch = [(f"r{i}", RequestShape(*s)) for i, s in enumerate(shapes)]
    expected = sum(policy.reserve_blocks(shape) for _, shape in batch)
    for _ in range(2):  # memoized the second time round
        assert ledger.total_blocks(batch, lambda item: item[0], lambda item: item[1]) == expected
    for rid, _ in batch:
        ledger.forget(rid)
    assert ledger.total_blocks([], lambda item: item[0], lambda item: item[1]) == 0


# -- speculative decoding: drafts and lookahead take KV slots past the sequence ----------------


@dataclass
class SpecEngine(Engine):
    """The oracle engine with speculative decoding of ``k`` tokens, as vLLM allocates it: each
    step a sequence is scheduled with its k drafts and ``allocate_slots`` adds k lookahead slots
    (vllm/v1/core/kv_cache_manager.py:542-544), capped at max_model_len; rejected drafts leave
    their blocks allocated. Drafts are accepted at random (seeded)."""

    k: int = 0
    seed: int = 0
    held: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.rng = np.random.default_rng(self.seed)

    def release(self, s: Seq) -> None:
        self.free_blocks += blocks_for_tokens(max(self.held.pop(id(s), 0), s.tokens), BLOCK)
        s.tokens = 0

    def decode(self) -> None:
        i = 0
        while i < len(self.running):
            s = self.running[i]
            want = min(s.tokens + 1 + 2 * self.k, self.max_model_len)
            held = max(self.held.get(id(s), 0), s.tokens)
            extra = max(blocks_for_tokens(want, BLOCK) - blocks_for_tokens(held, BLOCK), 0)
            self.make_room(s, extra)
            if s.state != "running":
                continue
            self.free_blocks -= extra
            self.held[id(s)] = max(held, want)
            grow = min(1 + int(self.rng.integers(0, self.k + 1)), self.target(s) - s.output)
            s.tokens += grow
            s.output += grow
            if s.output >= self.target(s):
                self.running.remove(s)
                self.release(s)
                s.state = "done"
                self.finished += 1
                continue
            i += 1


def run_spec(k: int, lookahead: int, usable: int, max_model_len: int, arrivals, seed: int = 0) -> SpecEngine:
    budget = KVBudget(usable, BLOCK, max_model_len, lookahead_tokens=lookahead)
    engine = SpecEngine(AdmissionPolicy(budget, "strict"), max_model_len, k=k, seed=seed)
    for now in range(10_000):
        for at, n, seqs in arrivals:
            if at == now:
                engine.arrive(seqs, n)
        engine.step(now)
        if not engine.waiting and not engine.running and now > max(at for at, _, _ in arrivals):
            break
    return engine


def test_spec_decode_lookahead_is_twice_the_speculated_tokens():
    assert spec_decode_lookahead_tokens(0) == 0
    assert spec_decode_lookahead_tokens(4) == 8


@settings(max_examples=100, deadline=None)
@given(workloads(), st.integers(1, 6), st.integers(0, 1000))
def test_strict_with_the_spec_lookahead_never_preempts_a_speculating_engine(workload, k, seed):
    usable, max_model_len, arrivals = workload
    engine = run_spec(k, spec_decode_lookahead_tokens(k), usable, max_model_len, arrivals, seed)
    total = sum(len(seqs) for _, _, seqs in arrivals)
    assert engine.preemptions == 0
    assert not engine.waiting, "a request was left hanging"
    assert not engine.running, "a request was left hanging"
    assert engine.finished + engine.aborted + engine.rejected == total


def test_without_the_lookahead_a_speculating_engine_preempts():
    # Two sequences of 15 + 17 tokens reserve 2 blocks each: 4 of 4 usable. Speculating 4 tokens
    # they reach 2 x 3 blocks, so one is preempted, unless the reservation counts the lookahead.
    def arrivals():
        return [(0, 1, [Seq(prompt=15, max_tokens=17, stop_at=17, abort_after=None, arrival=0)]) for _ in range(2)]

    assert run_spec(4, 0, 4, 64, arrivals()).preemptions > 0
    counted = run_spec(4, spec_decode_lookahead_tokens(4), 4, 64, arrivals())
    assert counted.preemptions == 0
    assert counted.finished == 2
