"""KV-budget admission, as plain arithmetic: who may start now, who can never fit, when to retry.

vLLM admits a waiting request as soon as its *prompt* fits (vllm/v1/core/kv_cache_manager.py,
``full_sequence_must_fit``) and preempts the newest running request when decode growth runs out
of blocks. This module decides admission on the worst case instead: a request starts only when
its reservation (prompt + max_tokens, or a learned quantile of output length) plus what every
running request may still grow into plus a headroom fits in the cache. Nothing here imports vLLM;
the scheduler subclass (kvops.plugin.admission) and the HTTP front door
(kvops.plugin.admission.http) only feed it numbers, so it is tested on its own against
adversarial sequences.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, TypeVar

R = TypeVar("R")
Policy = Literal["strict", "expected", "off"]
POLICIES: tuple[Policy, ...] = ("strict", "expected", "off")


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    """KV blocks that hold ``tokens`` tokens (vLLM rounds every sequence up to whole blocks)."""
    return -(-max(tokens, 0) // block_size)


def spec_decode_lookahead_tokens(num_lookahead_tokens: int) -> int:
    """Extra KV slots per sequence with speculative decoding of k tokens
    (``VllmConfig.num_lookahead_tokens``). In its last step a sequence holding prompt +
    max_tokens - 1 tokens is scheduled with its k draft tokens (vLLM does not cut drafts at
    max_tokens) and ``allocate_slots`` adds k lookahead slots on top, capped at max_model_len
    (vllm/v1/core/kv_cache_manager.py:542-544): up to 2k beyond prompt + max_tokens."""
    return 2 * max(num_lookahead_tokens, 0)


@dataclass(frozen=True)
class KVBudget:
    """The KV cache as admission sees it: blocks usable by requests, and their size."""

    usable_blocks: int
    """num_blocks - 1: vLLM keeps one null block (vllm/v1/core/block_pool.py, null_block)."""
    block_size: int
    max_model_len: int
    headroom_blocks: int = 0
    """Blocks kept free beyond every reservation, applied only while something runs."""
    lookahead_tokens: int = 0
    """KV slots a sequence may take past prompt + max_tokens with speculative decoding: see
    ``spec_decode_lookahead_tokens``."""

    @property
    def usable_tokens(self) -> int:
        return self.usable_blocks * self.block_size


@dataclass(frozen=True)
class RequestShape:
    """What admission needs to know of one sequence (an n>1 request is n of them in vLLM)."""

    prompt_tokens: int
    max_tokens: int | None
    """None: unset, vLLM then allows up to max_model_len (v1/engine/input_processor.py:477)."""
    output_tokens: int = 0
    """Tokens generated so far: non-zero for a running or a preempted, re-admitted request."""


@dataclass(frozen=True)
class AdmissionDecision:
    """One scheduler-side verdict, with the numbers that justify it (for logs and tests)."""

    admit: bool
    reason: Literal["fits", "idle", "off", "over_budget"]
    need_blocks: int
    reserved_blocks: int
    budget_blocks: int


class OutputLengthQuantile:
    """Online quantile of the output lengths of recently finished requests.

    A bounded window (a sorted list plus arrival order) so that the estimate follows a workload
    that changes; O(window) per update, which is small next to one model step.
    """

    def __init__(self, quantile: float, window: int = 1024) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.quantile = quantile
        self._order: deque[int] = deque()
        self._sorted: list[int] = []
        self._window = window

    def __len__(self) -> int:
        return len(self._order)

    def add(self, output_tokens: int) -> None:
        if len(self._order) == self._window:
            oldest = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        self._order.append(output_tokens)
        bisect.insort(self._sorted, output_tokens)

    def value(self) -> int | None:
        """The q-quantile (nearest rank), or None before any sample."""
        if not self._sorted:
            return None
        rank = max(1, math.ceil(self.quantile * len(self._sorted)))
        return self._sorted[rank - 1]


class AdmissionPolicy:
    """Reservations and the admit/never-fits decisions for one engine's KV cache."""

    def __init__(
        self,
        budget: KVBudget,
        policy: Policy = "strict",
        quantile: float = 0.9,
        min_samples: int = 20,
        window: int = 1024,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.budget = budget
        self.policy: Policy = policy
        self.min_samples = min_samples
        self.output_lengths = OutputLengthQuantile(quantile, window)

    # -- per-sequence sizes ------------------------------------------------------------------

    def worst_tokens(self, shape: RequestShape) -> int:
        """KV slots the sequence may take: prompt + max_tokens + the speculative lookahead,
        capped by max_model_len."""
        limit = self.budget.max_model_len
        if shape.max_tokens is None:
            return limit
        return min(shape.prompt_tokens + shape.max_tokens + self.budget.lookahead_tokens, limit)

    def reserve_tokens(self, shape: RequestShape) -> int:
        """Tokens to reserve for the sequence under the active policy.

        ``expected`` reserves prompt + the learned output quantile, but never less than what the
        sequence already holds plus one token (so a preempted request that is re-admitted, or a
        request that outgrew the estimate, reserves at least its current length) and never more
        than the worst case. Before ``min_samples`` finished requests it behaves as ``strict``.
        """
        worst = self.worst_tokens(shape)
        if self.policy != "expected" or len(self.output_lengths) < self.min_samples:
            return worst
        estimate = self.output_lengths.value() or 0
        lookahead = self.budget.lookahead_tokens
        current = shape.prompt_tokens + shape.output_tokens + 1 + lookahead
        return min(worst, max(shape.prompt_tokens + estimate + lookahead, current))

    def reserve_blocks(self, shape: RequestShape) -> int:
        return blocks_for_tokens(self.reserve_tokens(shape), self.budget.block_size)

    # -- decisions ---------------------------------------------------------------------------

    def admit(
        self, candidate: RequestShape, reserved_blocks: int, running: int
    ) -> AdmissionDecision:
        """May ``candidate`` start, given the blocks the ``running`` sequences reserve?

        An idle engine admits anything: with nothing running there is nothing to preempt, and
        refusing would starve a request whose reservation exceeds usable minus headroom.
        """
        need = self.reserve_blocks(candidate)
        budget = self.budget.usable_blocks
        if self.policy == "off":
            return AdmissionDecision(True, "off", need, reserved_blocks, budget)
        if running == 0:
            return AdmissionDecision(True, "idle", need, reserved_blocks, budget)
        fits = need + reserved_blocks + self.budget.headroom_blocks <= budget
        return AdmissionDecision(fits, "fits" if fits else "over_budget", need, reserved_blocks, budget)

    def request_kv_tokens(self, shape: RequestShape, n: int = 1) -> int:
        """Worst-case KV tokens of a whole request: n sequences, each rounded to blocks."""
        per_sequence = blocks_for_tokens(self.worst_tokens(shape), self.budget.block_size)
        return n * per_sequence * self.budget.block_size

    def never_fits(
        self, shape: RequestShape, n: int = 1, max_request_fraction: float = 1.0,
        field: str = "max_tokens", has_n: bool = True,
    ) -> str | None:
        """Why a request can never be served within its worst case, or None when it can.

        The limit is a fraction of the whole cache; n parallel samples count n times (vLLM fans
        them out into n sequences, v1/engine/async_llm.py add_request). ``field`` names the
        request's output limit in the message (max_output_tokens on /v1/responses, which has
        no n: ``has_n`` False).
        """
        need = self.request_kv_tokens(shape, n)
        limit = int(self.budget.usable_tokens * max_request_fraction)
        if need <= limit:
            return None
        ask = f"{field} unset (= max_model_len)" if shape.max_tokens is None else f"{field} {shape.max_tokens}"
        per_request = f"n={n} x (prompt {shape.prompt_tokens} + {ask})" if has_n else (
            f"prompt {shape.prompt_tokens} + {ask}")
        return (
            f"request needs up to {need} KV tokens ({per_request}, "
            f"rounded to {self.budget.block_size}-token blocks) but this server admits at most "
            f"{limit} KV tokens per request; lower {field}{' or n' if has_n else ''}"
        )

    def waiting_behind_budget(
        self, started: list[RequestShape], pending: list[RequestShape]
    ) -> list[RequestShape]:
        """Which of the ``pending`` requests (in arrival order) the scheduler will hold back.

        The front end cannot see the engine's queue, only which requests have produced a first
        token (``started``). Replaying the scheduler's own rule over them in FCFS order tells a
        request that is merely in prefill (it fits, it will start) from one that waits for KV.
        """
        reserved = sum(self.reserve_blocks(s) for s in started)
        running = len(started)
        for i, shape in enumerate(pending):
            decision = self.admit(shape, reserved, running)
            if not decision.admit:
                return pending[i:]  # FCFS: everything behind the first held-back request waits
            reserved += decision.need_blocks
            running += 1
        return []

    def record_finished(self, output_tokens: int) -> None:
        """Learn from a request that finished normally (stopped or length-capped).

        Aborted requests must not be recorded: a client that disconnects early would bias the
        quantile low and make ``expected`` over-admit.
        """
        self.output_lengths.add(max(output_tokens, 0))


class ReservationLedger:
    """Per-request reservations for the per-step sum over the running batch.

    Under ``strict`` a request's reservation never changes (prompt + max_tokens), so it is
    computed once per request and the per-step sum costs a dict lookup per running request;
    ``expected`` reservations grow with the output and are recomputed.
    """

    def __init__(self, policy: AdmissionPolicy) -> None:
        self.policy = policy
        self._fixed: dict[str, int] = {}

    def total_blocks(
        self,
        requests: Iterable[R],
        request_id: Callable[[R], str],
        shape_of: Callable[[R], RequestShape],
    ) -> int:
        """Blocks reserved by ``requests`` (vLLM Request objects in the scheduler, anything
        with an id and a shape in tests)."""
        if self.policy.policy != "strict":
            return sum(self.policy.reserve_blocks(shape_of(r)) for r in requests)
        fixed = self._fixed
        total = 0
        for request in requests:
            rid = request_id(request)
            blocks = fixed.get(rid)
            if blocks is None:
                blocks = fixed[rid] = self.policy.reserve_blocks(shape_of(request))
            total += blocks
        return total

    def forget(self, request_id: str) -> None:
        self._fixed.pop(request_id, None)


def headroom_blocks(usable_blocks: int, headroom_fraction: float) -> int:
    return math.ceil(usable_blocks * headroom_fraction)


# -- the queue in front of the engine: 429 decisions and Retry-After ---------------------------


class DrainRate:
    """Requests leaving the system per second, over a sliding window of finish times.

    Time is passed in (monotonic seconds) so that the arithmetic is testable without clocks.
    """

    def __init__(self, window_s: float = 30.0, min_span_s: float = 1.0) -> None:
        self.window_s = window_s
        self.min_span_s = min_span_s
        self._finished: deque[float] = deque()

    def record(self, now_s: float, count: int = 1) -> None:
        self._finished.extend([now_s] * count)
        self._expire(now_s)

    def rate(self, now_s: float) -> float:
        """Finished requests per second over the window; 0.0 when nothing finished in it."""
        self._expire(now_s)
        if not self._finished:
            return 0.0
        span = max(now_s - self._finished[0], self.min_span_s)
        return len(self._finished) / span

    def _expire(self, now_s: float) -> None:
        while self._finished and self._finished[0] < now_s - self.window_s:
            self._finished.popleft()


@dataclass(frozen=True)
class QueueBudget:
    """Limits on work that has been accepted but has not started (no first token yet)."""

    max_queued_requests: int | None = None
    max_queued_kv_tokens: int | None = None
    max_queue_wait_s: float | None = None
    retry_after_max_s: int = 60


@dataclass(frozen=True)
class QueueState:
    queued_requests: int
    queued_kv_tokens: int
    drain_rps: float


QueueReason = Literal["ok", "queued_requests", "queued_kv_tokens", "queue_wait"]
"""Why the queue budget admitted ("ok") or refused a request (the front door's metric reasons)."""


@dataclass(frozen=True)
class QueueDecision:
    admit: bool
    reason: QueueReason
    predicted_wait_s: float
    retry_after_s: int


def predicted_wait_s(state: QueueState, n: int = 1) -> float:
    """Seconds until a request arriving now would start, from the queue ahead and the drain."""
    ahead = state.queued_requests + n
    if state.queued_requests == 0:
        return 0.0
    if state.drain_rps <= 0.0:
        return math.inf
    return ahead / state.drain_rps


def queue_decision(
    budget: QueueBudget, state: QueueState, n: int = 1, request_kv_tokens: int = 0
) -> QueueDecision:
    """Accept a request into the queue, or refuse it with the seconds after which to retry.

    Retry-After is the time the current drain rate needs to bring the queue back under the
    limit that refused the request; with no drain measured yet it is 1 s (re-probe soon).
    """
    wait = predicted_wait_s(state, n)
    excess_requests = 0.0
    reason: QueueReason = "ok"
    if budget.max_queued_requests is not None and state.queued_requests + n > budget.max_queued_requests:
        reason = "queued_requests"
        excess_requests = state.queued_requests + n - budget.max_queued_requests
    elif (
        budget.max_queued_kv_tokens is not None
        and state.queued_requests > 0
        and state.queued_kv_tokens + request_kv_tokens > budget.max_queued_kv_tokens
    ):
        reason = "queued_kv_tokens"
        per_request = state.queued_kv_tokens / state.queued_requests
        over = state.queued_kv_tokens + request_kv_tokens - budget.max_queued_kv_tokens
        excess_requests = over / max(per_request, 1.0)
    elif (
        budget.max_queue_wait_s is not None
        and state.drain_rps > 0.0  # no finish seen yet: no prediction, the other limits apply
        and wait > budget.max_queue_wait_s
    ):
        reason = "queue_wait"
        excess_requests = (wait - budget.max_queue_wait_s) * state.drain_rps
    if reason == "ok":
        return QueueDecision(True, reason, wait, 0)
    return QueueDecision(False, reason, wait, retry_after_s(excess_requests, state.drain_rps, budget))


def retry_after_s(excess_requests: float, drain_rps: float, budget: QueueBudget) -> int:
    """Whole seconds (HTTP Retry-After), at least 1 and at most the configured maximum."""
    if drain_rps <= 0.0:
        return 1
    seconds = excess_requests / drain_rps
    if not math.isfinite(seconds) or seconds >= budget.retry_after_max_s:
        return budget.retry_after_max_s  # a drain too slow to measure: the longest wait
    return max(1, math.ceil(seconds))


# -- planner integration -----------------------------------------------------------------------


def recommended_settings(
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    typical_prompt_tokens: int,
    typical_output_tokens: int,
    headroom_fraction: float = 0.02,
) -> dict[str, object]:
    """The ``admission`` section of kvops settings consistent with a capacity plan.

    The queue may hold about one cache-full of worst-case work (so a queued request waits at
    most roughly one turnover of the running batch) and no more requests than can run at once.
    Meant for ``kvops plan``; the result validates as KvopsSettings.admission.
    """
    usable = max(num_blocks - 1, 1)
    per_request = blocks_for_tokens(typical_prompt_tokens + typical_output_tokens, block_size)
    concurrent = max(1, min(max_num_seqs, int(usable * (1 - headroom_fraction)) // max(per_request, 1)))
    return {
        "policy": "strict",
        "headroom_fraction": headroom_fraction,
        "max_queued_requests": concurrent,
        "max_queued_kv_fraction": 1.0,
    }
