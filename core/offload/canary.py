"""The load-path canary's verdict, free of vLLM: what the front end saw, what the worker reported.

An offload tier that stores but never loads shows no error: hit rate 0, every request quietly
recomputes. The canary (kvops.plugin.offload.canary) proves the load path end to end with two
tiny requests of a prompt nobody else sends, exactly one LMCache chunk long. The first computes
and stores it. vLLM must recompute at least the last prompt token, so its own prefix cache serves
the second one only up to the last full block below it; the rest of the chunk can come only
through the connector (LMCache's connector returns a full-prompt hit minus one token). So the
second request's cached tokens above vLLM's block-aligned share are tokens the connector loaded,
and the worker half of our connector checks those blocks against the checksums it took when it
stored them, and reports the canary's loads apart from everyone else's (request id prefix).
Nothing is evicted, reset or cleared: user requests running at the same time see two more
one-token requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

CANARY_REQUEST_PREFIX = "kvops-canary-"
"""Request ids of canary requests; the worker reports their loads under the canary keys."""
VERIFIED = "kvops_canary_verified"
"""Canary loads whose blocks matched the checksums taken when they were stored."""
UNVERIFIED = "kvops_canary_unverified"
"""Canary loads without checksums to compare (verify_kv off, GPU KV, digest lost)."""
FAILED = "kvops_canary_failed"
"""Canary loads LMCache reported as failed (blocks recomputed)."""
CORRUPT = "kvops_canary_corrupt"
"""Canary loads whose blocks did not match their checksums."""
REPORT_KEYS = (VERIFIED, UNVERIFIED, FAILED, CORRUPT)


def canary_tokens(length: int, vocab_size: int, rng: random.Random | None = None) -> list[int]:
    """A prompt no user sends (fresh random ids, away from the special ids at the bottom)."""
    rng = rng or random.SystemRandom()
    low = min(10, max(vocab_size - 2, 0))
    return [rng.randrange(low, vocab_size) for _ in range(length)]


def canary_length(chunk_tokens: int, block_size: int) -> int:
    """One LMCache chunk (a whole number of vLLM blocks, which the preflight enforces)."""
    if chunk_tokens % block_size:
        return chunk_tokens * block_size
    return chunk_tokens


def local_share(length: int, block_size: int) -> int:
    """Tokens vLLM's own prefix cache can serve of a prompt it holds: whole blocks below the
    last token (vLLM recomputes at least one token)."""
    return (length - 1) // block_size * block_size


@dataclass(frozen=True)
class CanaryOutcome:
    """What the front end saw and what the worker reported for one canary."""

    length: int
    block_size: int
    stored_cached_tokens: int
    """Cached tokens of the first (storing) request: 0 for a prompt nobody sent before."""
    loaded_cached_tokens: int
    """Cached tokens of the last reading request: local share + what the connector loaded."""
    same_output: bool
    """The reading request's greedy token equals the storing request's."""
    reports: dict[str, int]
    """Worker reports for the canary's loads (REPORT_KEYS); empty when stats are off."""
    stats_enabled: bool = True


@dataclass(frozen=True)
class CanaryResult:
    """The verdict: ok, and one line saying why."""

    ok: bool
    reason: str
    loaded_tokens: int
    checked_at: float

    def as_json(self) -> dict[str, object]:
        return {"ok": self.ok, "reason": self.reason, "loaded_tokens": self.loaded_tokens,
                "checked_at": self.checked_at}


def judge(outcome: CanaryOutcome, checked_at: float) -> CanaryResult:
    """ok only when the connector loaded tokens, the worker found them intact, and the output
    matches; otherwise the first thing that went wrong, in the order a load happens."""
    share = local_share(outcome.length, outcome.block_size)
    loaded = max(0, outcome.loaded_cached_tokens - share)
    reports = outcome.reports

    def result(ok: bool, reason: str) -> CanaryResult:
        return CanaryResult(ok, reason, loaded, checked_at)

    if loaded == 0:
        return result(False, (
            f"loads do not happen: a {outcome.length}-token prefix was stored and read again, "
            f"and the connector loaded none of it (vLLM's own cache served {share}); LMCache "
            "did not keep it or does not find it (L1 smaller than a chunk, stores failing, "
            "lookups failing)"))
    if reports.get(FAILED, 0):
        return result(False, f"LMCache found the canary's {loaded} tokens but failed to load "
                              "them (vLLM recomputed them)")
    if reports.get(CORRUPT, 0):
        return result(False, f"the canary's {loaded} loaded tokens do not match the checksums "
                              "taken when they were stored (corrupt tier)")
    if not outcome.same_output:
        return result(False, "the output after loading differs from the output computed from "
                              "scratch (wrong KV loaded)")
    if reports.get(VERIFIED, 0):
        return result(True, f"loaded {loaded} tokens through the connector; checksums match")
    if reports.get(UNVERIFIED, 0):
        return result(True, f"loaded {loaded} tokens through the connector (no checksums to "
                             "compare: verify_kv is off or the KV is not on the CPU)")
    if not outcome.stats_enabled:
        return result(True, f"loaded {loaded} tokens through the connector (vLLM stats are "
                             "off: no worker report to check)")
    return result(False, f"vLLM counted {loaded} tokens from the connector but the worker "
                          "reported no finished load of them")
