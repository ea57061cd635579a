"""The verdict contract every diagnosis speaks: a named problem, its cause, the numbers behind
it, and what to run next (../shared/DESIGN.md, "A verdict is ...")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PROBLEMS: dict[str, tuple[str, ...]] = {
    "kv-exhaustion": ("kv-capacity", "max-num-seqs", "compute-bound", "failing"),
    "prefix-miss": ("prefix-caching-disabled", "prefix-drift", "eviction", "offload-miss"),
    "ttft-regression": ("load", "queueing", "prefill", "decode"),
    "offload": ("degraded", "unreachable", "load-path"),
    "healthy": ("none",),
    # the run could not establish what it set out to test: the load never reached the limit,
    # or the load generator fell behind its own schedule
    # (target-down: Prometheus cannot scrape a replica, so `kvops diagnose --prometheus` cannot
    # say what ails it; scrape-timeout: the same, but the replica accepted the scrape and did not
    # answer in time, as a server overloaded does; preempted: a trace replay's recomputed blocks
    # counted as hits again; no-samples: no request of a ttft-regression run measured a TTFT,
    # or none of a prefix-miss run finished: all failed, none sent, or all cut off at the end)
    "inconclusive": ("limit-not-reached", "client-bound", "target-down", "scrape-timeout",
                     "preempted", "no-samples"),
}
KV_USAGE_BOUND = 0.9


@dataclass(frozen=True)
class Verdict:
    problem: str
    cause: str
    evidence: dict[str, Any] = field(default_factory=dict)
    next: str = ""

    def __post_init__(self) -> None:
        if self.cause not in PROBLEMS.get(self.problem, ()):
            raise ValueError(f"bad verdict {self.problem}/{self.cause}")

    def to_dict(self) -> dict[str, Any]:
        return {"problem": self.problem, "cause": self.cause, "evidence": self.evidence,
                "next": self.next}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Verdict:
        return cls(str(data["problem"]), str(data["cause"]), dict(data.get("evidence") or {}),
                   str(data.get("next", "")))


def healthy(**evidence: Any) -> Verdict:
    return Verdict("healthy", "none", evidence, "nothing to do")


def describe(verdict: Verdict) -> list[str]:
    """The lines a person reads: problem / cause, the evidence, what to run next."""
    lines = [f"{verdict.problem} / {verdict.cause}"]
    lines += [f"  {key}: {value}" for key, value in verdict.evidence.items()]
    lines.append(f"  next: {verdict.next}")
    return lines


def any_problem(verdicts: list[Verdict]) -> bool:
    """Exit code 3 (check failed) whenever a verdict names a problem."""
    return any(v.problem != "healthy" for v in verdicts)
