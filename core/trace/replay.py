"""A trace turned into requests a real server can take, and the hit ratio it should then see.

Lengths are scaled by ``length_scale`` and clipped to the server's ``max_model_len``; a trace
block (512 tokens in Mooncake) becomes ``round(512 × length_scale)`` prompt tokens. Prompts are
token ids, built block by block from each block id (one seeded random block per id), so equal
leading ids give equal leading tokens and the server's prefix cache sees the trace's reuse, in
the server's own tokens; no tokenizer is involved. A block that is a whole number of the
server's KV blocks (128 tokens on vLLM's CPU backend) makes one trace block one or more cache
blocks, which the prediction assumes.

The prediction replays the same requests through two LRU models: vLLM's own cache
(``num_gpu_blocks``, whole KV blocks, the last prompt token always computed, a finished
request's blocks freed tail first) and, when offload is on, the offload tier (whole chunks,
refreshed in order); each request hits the larger of the two, as vLLM asks the connector only
for the tokens past its own hit.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvops.core.errors import BadInputError
from kvops.core.trace.read import Trace, TraceRequest
from kvops.core.trace.reuse import HitRule, reuse_profile

TOKEN_RANGE = (100, 1000)
"""Token ids the prompts draw from: ordinary tokens in every vocabulary we serve."""


@dataclass(frozen=True)
class ReplayOptions:
    speedup: float = 1.0
    length_scale: float = 0.25
    max_model_len: int = 2048
    max_output_tokens: int = 16
    start: int = 0
    """Index of the first trace request replayed (in arrival order)."""
    limit: int | None = None
    """How many requests at most (None: to the end)."""
    sample_conversations: int = 1
    """Of that window, keep the requests whose second block id (a one-block request: its index)
    is a multiple of N. Ids are chained prefix hashes, so the turns of one conversation share
    their second id and are kept or dropped together: the kept requests reuse each other as
    much as the whole trace does, in 1/N of the requests."""
    duration_s: float | None = None
    """Replay only requests due within this many seconds (after the speedup)."""
    seed: int = 0
    drift_at: int | None = None
    """Put a per-request span (a request id, a timestamp) at this token depth of every prompt."""
    drift_tokens: int = 8


@dataclass(frozen=True)
class ReplayRequest:
    index: int
    send_at_s: float
    """Seconds after the replay starts."""
    prompt_tokens: int
    max_tokens: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Replay:
    block_tokens: int
    requests: tuple[ReplayRequest, ...]
    seed: int = 0
    drift_at: int | None = None
    """Token depth of the per-request span written over each prompt (None: none); the
    prediction stays the trace's, so the shortfall is what such a span costs."""
    drift_tokens: int = 8

    @property
    def duration_s(self) -> float:
        return self.requests[-1].send_at_s if self.requests else 0.0

    def prompt(self, request: ReplayRequest) -> list[int]:
        """The request's token ids: one seeded block per block id, cut to its length, with the
        request's own span at ``drift_at``."""
        tokens: list[int] = []
        for block in request.block_ids:
            tokens += _block(self.seed, block, self.block_tokens)
        tokens = tokens[: request.prompt_tokens]
        if self.drift_at is not None and self.drift_at < len(tokens):
            span = per_request_span(request.index, self.drift_tokens, self.seed)
            end = min(len(tokens), self.drift_at + len(span))
            tokens[self.drift_at:end] = span[: end - self.drift_at]
        return tokens


@functools.lru_cache(maxsize=2048)
def _block(seed: int, block: int, length: int) -> tuple[int, ...]:
    """A block id's tokens (a trace's conversations reuse their blocks many times)."""
    rng = random.Random(f"{seed}-{block}")
    return tuple(rng.randrange(*TOKEN_RANGE) for _ in range(length))


def per_request_span(index: int, length: int, seed: int = 0) -> list[int]:
    """Tokens only this request has, like a request id: the first differs from every other
    request's (up to the range's width), the rest are seeded by the index."""
    low, high = TOKEN_RANGE
    rng = random.Random(f"{seed}-span-{index}")
    return [low + index % (high - low)] + [rng.randrange(low, high) for _ in range(length - 1)]


def plan_replay(trace: Trace, options: ReplayOptions) -> Replay:
    if options.speedup <= 0 or options.length_scale <= 0:
        raise BadInputError("--speedup and --length-scale must be > 0")
    if options.max_model_len < options.max_output_tokens + 1:
        raise BadInputError(f"max_model_len {options.max_model_len} leaves no room for a prompt "
                            f"and {options.max_output_tokens} output tokens")
    block = max(1, round(trace.block_tokens * options.length_scale))
    stop = None if options.limit is None else options.start + options.limit
    chosen = [(index, req) for index, req in enumerate(trace.requests[options.start:stop], options.start)
              if _conversation(index, req) % options.sample_conversations == 0]
    if not chosen:
        raise BadInputError(f"trace {trace.path}: no requests from index {options.start} on "
                            f"(sample_conversations {options.sample_conversations})")
    t0 = chosen[0][1].timestamp_s
    out = []
    for index, req in chosen:
        send_at = (req.timestamp_s - t0) / options.speedup
        if options.duration_s is not None and send_at > options.duration_s:
            break
        max_tokens = min(options.max_output_tokens, max(1, round(req.output_tokens * options.length_scale)))
        prompt = min(max(1, math.ceil(req.input_tokens * options.length_scale)),
                     options.max_model_len - max_tokens)
        ids = req.hash_ids if trace.has_hash_ids else tuple(-(index << 20) - j - 1 for j in range(
            math.ceil(prompt / block)))  # no ids in the trace: every block unique, no reuse
        out.append(ReplayRequest(index, send_at, prompt, max_tokens, tuple(ids[: math.ceil(prompt / block)])))
    return Replay(block, tuple(out), options.seed, options.drift_at, options.drift_tokens)


def _conversation(index: int, request: TraceRequest) -> int:
    return request.hash_ids[1] if len(request.hash_ids) > 1 else index


def conversation_of(request: ReplayRequest) -> int:
    """A replayed request's conversation key, as sample_conversations reads it from the trace."""
    return request.block_ids[1] if len(request.block_ids) > 1 else request.index


@dataclass(frozen=True)
class ServerCache:
    """What the server's caches hold, in tokens; ``offload_tokens`` None: no offload tier,
    inf: a tier larger than the replay can fill."""

    gpu_blocks: int
    block_size: int
    offload_tokens: float | None = None
    offload_chunk_tokens: int = 256


@dataclass(frozen=True)
class Prediction:
    prompt_tokens: int
    gpu_hit_ratio: float
    """vLLM's own cache alone."""
    hit_ratio: float
    """With the offload tier when there is one."""
    unbounded_hit_ratio: float
    """An infinite cache, at the server's block granularity."""


@dataclass(frozen=True)
class Timing:
    """When a replayed request went out and when its prompt's KV existed (its first token)."""

    sent_at: float
    prefilled_at: float | None


def predict(replay: Replay, cache: ServerCache, timing: dict[int, Timing] | None = None) -> Prediction:
    """The hit ratio the replayed requests should get: all of them, or with ``timing`` those that
    reached the server, each finding only blocks of requests prefilled before it was sent (a
    conversation's next turn sent while the last one still queues finds nothing of it)."""
    reqs = [r for r in replay.requests if timing is None or r.index in timing]
    if timing is not None:
        reqs.sort(key=lambda r: timing[r.index].sent_at)
    as_trace = [TraceRequest(r.send_at_s, r.prompt_tokens, r.max_tokens, r.block_ids) for r in reqs]
    total = sum(r.prompt_tokens for r in reqs)
    if total == 0:
        return Prediction(0, 0.0, 0.0, 0.0)
    inputs = np.asarray([r.prompt_tokens for r in reqs], dtype=np.int64)
    ready = _ready_blocks(reqs, timing) if timing is not None else None
    gpu_rule = HitRule(replay.block_tokens, cache.block_size, True)
    gpu = reuse_profile(as_trace, gpu_rule, head_last=True)
    gpu_hits = _capped(gpu.hit_tokens_per_request(cache.gpu_blocks * cache.block_size // replay.block_tokens),
                       gpu_rule, ready, inputs)
    hits = gpu_hits
    if cache.offload_tokens is not None:
        tier_rule = HitRule(replay.block_tokens, cache.offload_chunk_tokens, True)
        tier = reuse_profile(as_trace, tier_rule)
        capacity = cache.offload_tokens / replay.block_tokens
        tier_hits = tier.hit_tokens_per_request(math.floor(capacity) if math.isfinite(capacity) else capacity)
        hits = np.maximum(gpu_hits, _capped(tier_hits, tier_rule, ready, inputs))
    unbounded = _capped(gpu.hit_tokens_per_request(float("inf")), gpu_rule, ready, inputs)
    return Prediction(total, float(gpu_hits.sum()) / total, float(hits.sum()) / total,
                      float(unbounded.sum()) / total)


def _capped(hits: npt.NDArray[np.int64], rule: HitRule, ready: npt.NDArray[np.int64] | None,
            inputs: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    if ready is None:
        return hits
    capped: npt.NDArray[np.int64] = np.minimum(hits, rule.tokens(ready, inputs))
    return capped


def _ready_blocks(reqs: list[ReplayRequest], timing: dict[int, Timing]) -> npt.NDArray[np.int64]:
    """Per request (in send order): its leading blocks that some request prefilled before it was sent."""
    done = sorted((t.prefilled_at, r.block_ids) for r in reqs if (t := timing[r.index]).prefilled_at is not None)
    seen: set[int] = set()
    out, j = [], 0
    for req in reqs:
        sent = timing[req.index].sent_at
        while j < len(done) and done[j][0] <= sent:
            seen.update(done[j][1])
            j += 1
        k = 0
        while k < len(req.block_ids) and req.block_ids[k] in seen:
            k += 1
        out.append(k)
    return np.asarray(out, dtype=np.int64)
