"""The load a run offered and carried, so that a TTFT comparison weighs load before phases.

At 80× the baseline's arrival rate every phase of every request slows (vLLM admits them all and
each step batches more work): that is more load, not a slower prefill, and the fix is capacity
or a like-for-like comparison, not a prompt or build hunt. So the load is compared first
(arrival rate × tokens per request, with concurrency and the server's running/waiting beside
it), and phase times only count as slower when the load is comparable.

A client that fell behind its own arrival schedule did not offer the load it meant to: either
every user of its pool was waiting on a response (the server was slower than the offered load,
which is itself the finding), or it ran out of CPU with users to spare (the measurement is the
problem; the comparison means nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvops.core.prom import MetricsSample
from kvops.core.stats import mean
from kvops.loadtest.records import RequestRecord


def more_workers(processes: int) -> int:
    """Locust workers a rerun of a client-bound run asks for: more processes than the run had
    (two where it ran in one, twice its workers where it was distributed), never its own count."""
    return 2 if processes <= 1 else 2 * processes


def in_flight(records: Sequence[RequestRecord]) -> tuple[float | None, int]:
    """Time-weighted mean and the maximum of requests in flight, from the client's stamps."""
    spans = [(r.sent_at, r.done_at) for r in records if r.e2e_s is not None]
    if not spans:
        return None, 0
    start, end = min(s for s, _ in spans), max(e for _, e in spans)
    busy = sum(e - s for s, e in spans)
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    level = peak = 0
    for _, step in edges:
        level += step
        peak = max(peak, level)
    return (round(busy / (end - start), 3) if end > start else None), peak


def offered(records: Sequence[RequestRecord], samples: Sequence[MetricsSample],
            arrival_rate_rps: float | None) -> dict[str, Any]:
    """What one run asked of the server and what the server held, for the comparison."""
    ok = [r for r in records if r.ok]
    prompt = mean([float(r.prompt_tokens) for r in ok if r.prompt_tokens is not None])
    output = mean([float(r.completion_tokens) for r in ok if r.completion_tokens is not None])
    concurrency, peak = in_flight(records)
    running = mean([s.get("running") for s in samples])
    waiting = mean([s.get("waiting") for s in samples])
    per_request = (prompt or 0.0) + (output or 0.0)
    return {
        "arrival_rate_rps": arrival_rate_rps,
        "prompt_tokens_mean": _round(prompt), "output_tokens_mean": _round(output),
        "token_rate": _round(arrival_rate_rps * per_request) if arrival_rate_rps and per_request else None,
        "concurrency_mean": concurrency, "in_flight_max": peak,
        "running_mean": _round(running), "waiting_mean": _round(waiting),
    }


def _round(x: float | None) -> float | None:
    return round(x, 3) if x is not None else None


@dataclass(frozen=True)
class LoadComparison:
    ratios: dict[str, float | None]
    """Candidate over baseline, per load measure."""
    work_ratio: float | None
    """Offered tokens per second (arrival rate × prompt+output tokens), else the arrival rate."""
    higher: bool
    """The candidate offered more work than the baseline beyond the tolerance."""
    longer: tuple[str, ...] = ()
    """Length measures (prompt, output tokens) longer than the baseline's beyond the tolerance:
    each request is more work even at the same offered tokens per second (a 4x longer prompt at a
    quarter of the rate prefills 4x longer), so no phase is compared like for like."""

    @property
    def comparable(self) -> bool:
        return not self.higher and not self.longer

    def grew(self, tolerance: float) -> list[str]:
        return [k for k, v in self.ratios.items() if v is not None and v > 1 + tolerance]


LENGTH_KEYS = ("prompt_tokens_mean", "output_tokens_mean")
RATIO_KEYS = ("arrival_rate_rps", "prompt_tokens_mean", "output_tokens_mean", "token_rate",
              "concurrency_mean", "running_mean", "waiting_mean")


def compare(base: dict[str, Any], cand: dict[str, Any], tolerance: float) -> LoadComparison:
    """``base``/``cand`` are ttft summaries; old baselines without a ``load`` section fall back
    to their arrival rate (or the configured rate)."""
    b = base.get("load") or {"arrival_rate_rps": base.get("arrival_rate_rps") or base.get("rate_rps")}
    c = cand.get("load") or {"arrival_rate_rps": cand.get("arrival_rate_rps") or cand.get("rate_rps")}
    ratios = {k: _ratio(c.get(k), b.get(k)) for k in RATIO_KEYS}
    work = ratios["token_rate"] if ratios["token_rate"] is not None else ratios["arrival_rate_rps"]
    longer = tuple(k for k in LENGTH_KEYS if (ratios[k] or 0.0) > 1 + tolerance)
    return LoadComparison(ratios, work, work is not None and work > 1 + tolerance, longer)


def _ratio(c: Any, b: Any) -> float | None:
    if not isinstance(c, (int, float)) or not isinstance(b, (int, float)) or b <= 0:
        return None
    return round(float(c) / float(b), 3)


POOL_BUSY = 0.9
LATE_SHARE = 0.05
"""More than this share of sends later than ``late_s``: the client fell behind its schedule. A
share, not the p99: over a 20 s run (~40 sends) the p99 is the single worst send, and one send
held up by a busy start-up is not a load that differs from the one asked for."""


@dataclass(frozen=True)
class Lateness:
    side: str
    """"baseline" or "candidate"."""
    lateness_p99_s: float
    users: int | None
    in_flight_max: int | None
    late_share: float | None = None
    """Share of sends later than ``late_s`` (None: an old summary without the samples)."""

    @property
    def pool_exhausted(self) -> bool:
        """(Nearly) every user was busy: the server, not the client's CPU, held the arrivals
        back (a user hands a request back a moment before it sends the next overdue one)."""
        return (self.users is not None and self.in_flight_max is not None
                and self.in_flight_max >= POOL_BUSY * self.users)

    def to_dict(self) -> dict[str, Any]:
        why = (f"all {self.users} users were waiting on responses, so arrivals queued in the "
               "client: the server was slower than the offered load" if self.pool_exhausted else
               "the load generator fell behind with users to spare (its CPU)")
        return {"side": self.side, "lateness_p99_s": self.lateness_p99_s, "late_share": self.late_share,
                "users": self.users, "in_flight_max": self.in_flight_max, "why": why}


def behind(base: dict[str, Any], cand: dict[str, Any], late_s: float) -> list[Lateness]:
    """The runs that sent more than LATE_SHARE of their arrivals over ``late_s`` late (a summary
    without the lateness samples: its p99 over ``late_s``)."""
    found = (fell_behind(side, summary, late_s) for side, summary in (("baseline", base), ("candidate", cand)))
    return [x for x in found if x is not None]


def fell_behind(side: str, summary: dict[str, Any], late_s: float) -> Lateness | None:
    """How far one run's sends fell behind its schedule, when they did (else None)."""
    late = summary.get("lateness_p99_s")
    if not isinstance(late, (int, float)) or late <= late_s:
        return None
    sends = (summary.get("samples") or {}).get("lateness_s")
    share = round(sum(1 for x in sends if x > late_s) / len(sends), 3) if sends else None
    if share is not None and share <= LATE_SHARE:
        return None
    load = summary.get("load") or {}
    return Lateness(side, round(float(late), 3), summary.get("users"), load.get("in_flight_max"), share)
