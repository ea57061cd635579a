"""The chaos bench's report: per fault, what the clients saw and how long the server took to
come back, assembled from plain records so the counting is tested without a server.

A request is *answered* when the server returned a completion, *lost* otherwise (an error
status, a reset connection, a timeout), and *wrong* when answered with text that is none of
the greedy outputs a server without offload gives for the same prompt (computed cold, and with
its 512-token prefix from its own prefix cache, as after an LMCache load) and that the same
server, scoring it token by token, does not find greedy up to a near-tie (ops/bench/greedy.py:
the tiny random model's near-tied logits flip when KV is computed in another order; wrong KV
moves them by far more). Such flips are counted apart as ``tie_flips``. Recovery is the time from
the moment the fault was cleared to the first health probe after which every probe was healthy;
``None`` when the server was still unhealthy at the last probe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvops.ops.bench.greedy import Judged, tally


@dataclass(frozen=True)
class Sent(Judged):
    """One client request of the load and what came back."""

    started: float
    text: str | None
    """The completion's text; None when no completion came back (lost)."""
    expected: tuple[str, ...]
    error: str = ""
    prompt: int = -1
    """The prompt's seed, to name it among the wrong outputs."""
    token_ids: tuple[int, ...] = ()
    gaps: tuple[float, ...] | None = None
    """Per generated token, the reference server's best logprob minus this token's (scored only
    when the text is none of ``expected``; None: not scored)."""


@dataclass(frozen=True)
class Probe:
    """One health probe after the fault was cleared."""

    at: float
    healthy: bool


@dataclass(frozen=True)
class FaultRun:
    """Everything one fault produced."""

    name: str
    sent: Sequence[Sent]
    cleared_at: float
    probes: Sequence[Probe]
    engine_crashes: int


def recovery_s(cleared_at: float, probes: Sequence[Probe]) -> float | None:
    """Seconds from clearing the fault to the first probe that starts an unbroken healthy run
    reaching the last probe; None when the last probe was unhealthy (or there was none)."""
    ordered = sorted((p for p in probes if p.at >= cleared_at), key=lambda p: p.at)
    if not ordered or not ordered[-1].healthy:
        return None
    first = len(ordered) - 1
    while first > 0 and ordered[first - 1].healthy:
        first -= 1
    return max(0.0, ordered[first].at - cleared_at)


def fault_report(run: FaultRun) -> dict[str, Any]:
    answered = [s for s in run.sent if s.text is not None]
    errors = sorted({s.error for s in run.sent if s.text is None and s.error})
    return {
        "name": run.name,
        "sent": len(run.sent),
        "answered": len(answered),
        "lost": len(run.sent) - len(answered),
        **tally(answered),
        "engine_crashes": run.engine_crashes,
        "recovery_s": recovery_s(run.cleared_at, run.probes),
        "lost_errors": errors[:5],
        "wrong_examples": [{"prompt": s.prompt, "got": s.text, "expected": s.expected,
                            "logprob_gaps": s.gaps} for s in answered if s.wrong][:3],
        "tie_flip_examples": [{"prompt": s.prompt, "got": s.text, "expected": s.expected,
                               "logprob_gaps": s.gaps} for s in answered if s.tie_flip][:3],
    }


def goal_met(fault: dict[str, Any]) -> bool:
    """The issue's goal for one fault: nothing lost, nothing wrong, no crash, and it recovered."""
    return (fault["lost"] == 0 and fault["wrong_outputs"] == 0 and fault["engine_crashes"] == 0
            and fault["recovery_s"] is not None)


def chaos_report(runs: Sequence[FaultRun], **extra: Any) -> dict[str, Any]:
    faults = [fault_report(run) for run in runs]
    for fault in faults:
        fault["goal_met"] = goal_met(fault)
    totals = {key: sum(f[key] for f in faults)
              for key in ("sent", "answered", "lost", "wrong_outputs", "engine_crashes")}
    return {"faults": faults, "totals": totals,
            "goal_met": all(f["goal_met"] for f in faults), **extra}
