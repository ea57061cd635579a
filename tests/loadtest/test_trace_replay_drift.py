"""Drift in a trace replay, on records built in-process: one conversation of four turns (trace
blocks of 128 tokens, server blocks of 16), replayed with and without a per-request span at
token 40. Every count below is worked out by hand from those numbers; the prompts' own tokens
are the only input the drift inference reads."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvops.core.prom import MetricsSample
from kvops.core.trace.read import read_trace
from kvops.core.trace.replay import Replay, ReplayOptions, plan_replay
from kvops.loadtest.analysis import drift, prefix, replay
from kvops.loadtest.analysis.tokens import ServerTokenizer
from kvops.loadtest.config import TraceReplayConfig
from kvops.loadtest.records import RequestRecord

BLOCK = 16
AT = 40  # two whole server blocks before it
LENGTHS = (256, 384, 512, 640)  # prompts: 1024..2560 trace tokens x 0.25
TOTAL = sum(LENGTHS)
# each turn repeats the last one's blocks: with an unbounded cache, turn n hits all of turn n-1's
# whole 128-token blocks (its last token always computed): 256 + 384 + 512
PREDICTED = (256 + 384 + 512) / TOTAL
# with the span at 40, turns 2-4 reach only the two blocks before it
WITH_SPAN = 3 * 32 / TOTAL
# shared text: all of turn 1's 256 tokens but the span's 8; 248 -> 15 whole blocks, turns 2-4
COULD_BE = 3 * 240 / TOTAL


class IdsAsText(ServerTokenizer):
    """/detokenize stood in by the ids themselves: the text of a span is then checkable."""

    def __init__(self) -> None:
        super().__init__("http://unused", "m")

    def text(self, tokens: list[int]) -> str:
        return " ".join(map(str, tokens))


def plan(tmp_path: Path, drift_at: int | None) -> Replay:
    path = tmp_path / "conversation.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 1000 * t, "input_length": 512 * (t + 2),
                                        "output_length": 4, "hash_ids": list(range(1, t + 3))}) + "\n"
                            for t in range(4)))
    return plan_replay(read_trace(path), ReplayOptions(length_scale=0.25, drift_at=drift_at))


def records(r: Replay) -> list[RequestRecord]:
    # sequential: each turn's prefill done 0.1 s after it was sent, a second before the next
    return [RequestRecord(request_id=str(q.index), kind="completions", sent_at=100.0 + q.send_at_s,
                          ok=True, group=str(q.index), first_event_s=0.1) for q in r.requests]


def samples(hits: float) -> list[MetricsSample]:
    info = {"num_gpu_blocks": "1000", "block_size": str(BLOCK), "enable_prefix_caching": "True"}
    keys = ("prefix_queries", "prefix_hits", "external_prefix_queries", "external_prefix_hits")
    return [MetricsSample(0, dict.fromkeys(keys, 0.0), info),
            MetricsSample(9, {**dict.fromkeys(keys, 0.0), "prefix_queries": TOTAL, "prefix_hits": hits}, info)]


def test_the_span_is_written_over_each_prompt_at_its_depth(tmp_path):
    clean, spanned = plan(tmp_path, None), plan(tmp_path, AT)
    a = [clean.prompt(q) for q in clean.requests]
    b = [spanned.prompt(q) for q in spanned.requests]
    assert [len(p) for p in a] == [len(p) for p in b] == list(LENGTHS)
    for x, y in zip(a, b, strict=True):
        assert x[:AT] == y[:AT]
        assert x[AT + 8:] == y[AT + 8:]
    assert len({tuple(p[AT:AT + 8]) for p in b}) == 4  # one span per request
    assert all(p[AT] != q[AT] for i, p in enumerate(b) for q in b[:i])
    short = plan(tmp_path, 300)  # past the first turn: it is sent as the trace has it
    assert short.prompt(short.requests[0]) == a[0]


def test_a_span_inside_shared_text_is_prefix_drift(tmp_path):
    r = plan(tmp_path, AT)
    summary, (v,) = replay.analyse(TraceReplayConfig(), r, records(r), samples(3 * 32), IdsAsText())
    assert summary["predicted_hit_ratio"] == summary["read_predicted_hit_ratio"] == round(PREDICTED, 4)
    assert summary["ideal_hit_rate"] == summary["measured_hit_ratio"] == round(WITH_SPAN, 4)
    assert summary["could_be_hit_rate"] == round(COULD_BE, 4)
    assert (summary["drift_at"], summary["requests_read_for_drift"]) == (AT, 4)
    assert (v.problem, v.cause) == ("prefix-miss", "prefix-drift")
    ev = v.evidence
    assert ev["inferred_from"] == "prompts"
    assert (ev["first_differing_token"], ev["prompts_in_group"], ev["reordered"]) == (AT, 4, False)
    first = r.prompt(r.requests[0])
    assert ev["varying_text"] == " ".join(map(str, first[AT:AT + 8]))
    assert ev["text_before"] == " ".join(map(str, first[AT - 12:AT]))
    assert (ev["shared_tokens"], ev["shared_after_drift_tokens"]) == (248, 256 - 48)
    assert f"could be {round(COULD_BE, 4)}" in v.next


def test_the_same_shortfall_without_a_span_is_the_cache(tmp_path):
    r = plan(tmp_path, None)
    summary, (v,) = replay.analyse(TraceReplayConfig(), r, records(r), samples(3 * 32), IdsAsText())
    assert summary["ideal_hit_rate"] == summary["could_be_hit_rate"] == round(PREDICTED, 4)
    assert (v.problem, v.cause) == ("prefix-miss", "eviction")
    assert "first_differing_token" not in v.evidence


def test_a_span_after_the_reused_part_costs_nothing(tmp_path):
    r = plan(tmp_path, 600)  # only the last turn is that long, and nothing follows it
    summary, (v,) = replay.analyse(TraceReplayConfig(), r, records(r), samples(256 + 384 + 512), IdsAsText())
    assert summary["ideal_hit_rate"] == summary["predicted_hit_ratio"] == round(PREDICTED, 4)
    assert v.problem == "healthy"


def _reference_clusters(prompts: list[list[int]]) -> list[list[int]]:
    """The definition, pairwise: join the first group whose first member shares at least half
    of the smaller of the two 8-token-run sets."""
    groups: list[list[int]] = []
    for i, p in enumerate(prompts):
        mine = drift.kgrams(p)
        for g in groups:
            rep = drift.kgrams(prompts[g[0]])
            if mine and rep and len(mine & rep) >= 0.5 * min(len(mine), len(rep)):
                g.append(i)
                break
        else:
            groups.append([i])
    return groups


@pytest.mark.parametrize("seed", range(5))
def test_indexed_grouping_equals_the_pairwise_definition(seed):
    rng = random.Random(seed)
    bases = [[rng.randrange(50) for _ in range(rng.randrange(4, 40))] for _ in range(8)]
    prompts = []
    for _ in range(40):  # near-duplicates of a few bases, cut, extended and edited at random
        p = list(rng.choice(bases))[: rng.randrange(2, 40)] + [rng.randrange(50) for _ in range(rng.randrange(6))]
        if p and rng.random() < 0.5:
            p[rng.randrange(len(p))] = rng.randrange(50)
        prompts.append(p)
    assert drift.clusters(prompts) == _reference_clusters(prompts)


def test_conversations_past_the_boilerplate_index_still_group():
    # 40 tokens every conversation opens with (too few to join two conversations), then 100 of
    # its own; each conversation's second turn adds a token
    system = list(range(1000, 1040))
    firsts = [system + [5000 + 100 * c + t for t in range(100)] for c in range(drift.BOILERPLATE + 6)]
    prompts = [p for first in firsts for p in (first, [*first, 9])]
    assert drift.clusters(prompts) == [[2 * c, 2 * c + 1] for c in range(len(firsts))]
    assert drift.clusters(prompts) == _reference_clusters(prompts)


def _reference_ideal(items: list[prefix.PrefixTokens], block: int) -> list[int]:
    """The definition: another request's blocks count once its first token came at or before
    this one was sent; the last prompt token never hits."""
    out = []
    for item in items:
        seen = {h for o in items if o is not item and o.record.first_token_at is not None
                and o.record.first_token_at <= item.record.sent_at for h in drift.block_chain(o.tokens, block)}
        chain = drift.block_chain(item.tokens[: max(len(item.tokens) - 1, 0)], block)
        k = 0
        while k < len(chain) and chain[k] in seen:
            k += 1
        out.append(k * block)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_ideal_hits_in_send_order_equal_the_definition(seed):
    rng = random.Random(seed)
    heads = [[rng.randrange(9) for _ in range(12)] for _ in range(3)]
    items = []
    for i in range(30):
        tokens = rng.choice(heads)[: rng.randrange(13)] + [rng.randrange(9) for _ in range(rng.randrange(8))]
        first = rng.choice([None, 0.0, rng.random() * 3])
        items.append(prefix.PrefixTokens(RequestRecord(str(i), "completions", sent_at=rng.random() * 3,
                                                       first_event_s=first), tokens, 0))
    assert prefix.ideal_hits(items, 4) == _reference_ideal(items, 4)
