"""`kvops trace stats` on traces small enough to count by hand, and the stack-distance curve
against a plain LRU simulation (an OrderedDict, written here) on random and real traces."""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvops.core.errors import BadInputError
from kvops.core.trace.read import TraceRequest, read_trace
from kvops.core.trace.reuse import HitRule, reuse_profile
from kvops.core.trace.summary import trace_stats
from kvops.ops.cli.main import app

REAL_TRACE = Path(__file__).resolve().parents[2].parent / "shared/fixtures/traces/mooncake_conversation_trace.jsonl"

# Written out of timestamp order; the two requests at 2000 ms must stay in file order (3 then 4).
HAND = [
    {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]},
    {"timestamp": 1000, "input_length": 1500, "output_length": 20, "hash_ids": [1, 2, 3]},
    {"timestamp": 3000, "input_length": 1200, "output_length": 50, "hash_ids": [1, 2, 3]},
    {"timestamp": 2000, "input_length": 600, "output_length": 30, "hash_ids": [1, 4]},
    {"timestamp": 2000, "input_length": 300, "output_length": 40, "hash_ids": [5]},
]
TOTAL_INPUT = 4600
# Worked by hand (LRU order oldest -> newest after each request):
#  C=2: r2 finds 1,2 (1024); cache [2,3]; r3 misses 1; r5 misses 1          -> 1024
#  C=3: r2 1024, cache [1,2,3]; r3 finds 1 (512), cache [3,1,4]; r4 -> [1,4,5];
#       r5 finds 1, misses 2 (512)                                           -> 2048
#  C=5: nothing evicted before r5, which finds 1,2,3: min(1536, 1200)        -> 2736
#  unbounded: 1024 + 512 + 1200                                              -> 2736
EXPECTED_LRU = {0: 0, 1: 0, 2: 1024, 3: 2048, 4: 2048, 5: 2736, 100: 2736}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def lru_oracle(requests: list[TraceRequest], capacity: int, block: int = 512,
               head_last: bool = False) -> int:
    """Hit tokens of an LRU cache of ``capacity`` blocks, simulated one id at a time; with
    ``head_last`` a request's ids are inserted last to first (its head is the most recent)."""
    cache: OrderedDict[int, None] = OrderedDict()
    hit = 0
    for req in requests:
        k = 0
        for block_id in req.hash_ids:
            if block_id not in cache:
                break
            k += 1
        hit += min(block * k, req.input_tokens)
        for block_id in (reversed(req.hash_ids) if head_last else req.hash_ids):
            cache[block_id] = None
            cache.move_to_end(block_id)
            while len(cache) > capacity:
                cache.popitem(last=False)
    return hit


def test_hand_counted_trace(tmp_path):
    stats = trace_stats(read_trace(write_jsonl(tmp_path / "t.jsonl", HAND)), list(EXPECTED_LRU))
    assert stats.requests == 5
    assert stats.duration_s == 3.0
    assert stats.arrival_rate_rps == pytest.approx(5 / 3)
    # inputs sorted: 300 600 1000 1200 1500; p90 at rank 3.6, p99 at 3.96 (linear)
    assert (stats.input_tokens.mean, stats.input_tokens.p50, stats.input_tokens.max) == (920, 1000, 1500)
    assert stats.input_tokens.p90 == pytest.approx(1380)
    assert stats.input_tokens.p99 == pytest.approx(1488)
    assert stats.output_tokens.p90 == pytest.approx(46)
    assert stats.block_tokens == 512
    assert stats.prefix_reuse_ratio == pytest.approx(2736 / TOTAL_INPUT)
    assert stats.saturation_blocks == 5
    assert {p.cache_blocks: round(p.hit_ratio * TOTAL_INPUT) for p in stats.lru} == EXPECTED_LRU


def test_ties_keep_file_order(tmp_path):
    swapped = HAND[:3] + [HAND[4], HAND[3]]  # 5 before 1,4 at the same instant
    stats = trace_stats(read_trace(write_jsonl(tmp_path / "t.jsonl", swapped)), [3])
    # C=3: r4 evicts 1 first, so r3 misses it; r5 then finds only 1 -> 1024 + 0 + 512
    assert round(stats.lru[0].hit_ratio * TOTAL_INPUT) == 1536


def test_random_traces_match_a_plain_lru_simulation():
    rng = random.Random(7)
    for _ in range(200):
        common = [rng.randrange(6) for _ in range(3)]
        reqs = [TraceRequest(i, rng.randrange(1, 3000), 1,
                             tuple(rng.choice([*common, rng.randrange(40)]) for _ in range(rng.randrange(7))))
                for i in range(rng.randrange(1, 25))]
        profile = reuse_profile(reqs, HitRule(512))
        for capacity in range(30):
            assert profile.hit_tokens(capacity) == lru_oracle(reqs, capacity), (reqs, capacity)


def test_real_trace_matches_a_plain_lru_simulation():
    assert REAL_TRACE.exists(), f"missing {REAL_TRACE}: ../shared must sit beside the repo"
    reqs = list(read_trace(REAL_TRACE).requests[:3000])
    profile = reuse_profile(reqs, HitRule(512))
    for capacity in (100, 2000, 20000):
        assert profile.hit_tokens(capacity) == lru_oracle(reqs, capacity)


def test_burstgpt_csv_has_lengths_and_no_reuse(tmp_path):
    path = tmp_path / "burst.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "5,ChatGPT,100,10,110,Conversation log\n"
                    "1,GPT-4,300,0,300,Conversation log\n"
                    "9,ChatGPT,200,20,220,API log\n")
    stats = trace_stats(read_trace(path), [1, 1000])
    assert (stats.format, stats.requests, stats.duration_s) == ("burstgpt", 3, 8.0)
    assert stats.input_tokens.p50 == 200
    assert stats.prefix_reuse_ratio == 0.0
    assert [p.hit_ratio for p in stats.lru] == [0.0, 0.0]
    assert not stats.has_block_ids


@pytest.mark.parametrize(("text", "line", "what"), [
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n\n{"timestamp": 1,\n',
     3, "not JSON"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}\n', 1, "hash_ids"),
    # two values on one line join into a valid whole-file array: the rows no longer match lines
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
     '{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [1]}, 7\n', 2,
     "more than one JSON value"),
    ('{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []}\n', 1, "input_length"),
    ("Timestamp,Request tokens,Response tokens\n1,10,5\n2,ten,5\n", 3, "must be numbers"),
    ("Timestamp,Request tokens,Response tokens\n1,10\n", 2, "must be numbers"),
    ("time,tokens\n1,2\n", 1, "missing columns Timestamp, Request tokens, Response tokens"),
])
def test_a_malformed_line_is_named(tmp_path, text, line, what):
    path = tmp_path / "bad.trace"
    path.write_text(text)
    with pytest.raises(BadInputError, match=rf"line {line}: .*{what}"):
        read_trace(path)


def test_cli_json_summary_and_plot(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", HAND)
    plot = tmp_path / "curve.png"
    res = CliRunner().invoke(app, ["trace", "stats", str(path), "--cache-blocks", "2,5", "--json",
                                   "--plot", str(plot)])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert {"requests", "duration_s", "arrival_rate_rps", "input_tokens", "output_tokens",
            "block_tokens", "prefix_reuse_ratio", "lru"} <= set(data)
    assert set(data["input_tokens"]) == {"mean", "p50", "p90", "p99", "max"}
    assert data["lru"] == [{"cache_blocks": 2, "hit_ratio": 1024 / TOTAL_INPUT},
                           {"cache_blocks": 5, "hit_ratio": 2736 / TOTAL_INPUT}]
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_cli_readable_summary_has_the_curve(tmp_path):
    res = CliRunner().invoke(app, ["trace", "stats", str(write_jsonl(tmp_path / "t.jsonl", HAND))])
    assert res.exit_code == 0, res.output
    assert "59.5% of input tokens with an unbounded cache (reached at 5 blocks" in res.stdout
    assert "64 blocks" in res.stdout  # the default curve starts at 64 blocks


@pytest.mark.parametrize("args", [["--cache-blocks", "1,x"], ["--cache-blocks", "-1"]])
def test_cli_bad_cache_blocks(tmp_path, args):
    res = CliRunner().invoke(app, ["trace", "stats", str(write_jsonl(tmp_path / "t.jsonl", HAND)), *args])
    assert res.exit_code == 2
    assert res.stderr.startswith("kvops: --cache-blocks")


def test_cli_malformed_trace_exits_2_naming_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(HAND[0]) + "\n{oops\n")
    res = CliRunner().invoke(app, ["trace", "stats", str(path)])
    assert res.exit_code == 2
    assert f"trace {path}, line 2: not JSON" in res.stderr
    assert "Traceback" not in res.output


def test_head_last_refresh_matches_a_simulation_that_refreshes_tail_first():
    rng = random.Random(11)
    for _ in range(200):
        common = [rng.randrange(6) for _ in range(3)]
        reqs = [TraceRequest(i, rng.randrange(1, 3000), 1,
                             tuple(rng.choice([*common, rng.randrange(40)]) for _ in range(rng.randrange(7))))
                for i in range(rng.randrange(1, 25))]
        profile = reuse_profile(reqs, HitRule(512), head_last=True)
        flipped = [TraceRequest(r.timestamp_s, r.input_tokens, 1, r.hash_ids) for r in reqs]
        for capacity in range(30):
            expected = lru_oracle(flipped, capacity, head_last=True)
            assert profile.hit_tokens(capacity) == expected
            assert int(profile.hit_tokens_per_request(capacity).sum()) == expected


def test_smallest_cache_for_a_fraction_of_the_reuse(tmp_path):
    from kvops.core.trace.sizing import cache_target

    profile = reuse_profile(read_trace(write_jsonl(tmp_path / "t.jsonl", HAND)).requests, HitRule(512))
    # by hand (EXPECTED_LRU): 2 blocks find 1024 of 2736 tokens, 3 find 2048, 5 find all
    assert cache_target(profile, 1.0).blocks_for_target == 5
    assert cache_target(profile, 2048 / 2736).blocks_for_target == 3
    assert cache_target(profile, 0.5).blocks_for_target == 3  # 1368 > 1024
    assert cache_target(profile, 1024 / 2736).blocks_for_target == 2
    target = cache_target(profile, 0.5)
    assert (target.blocks_for_all, target.target_hit_ratio) == (5, pytest.approx(0.5 * 2736 / TOTAL_INPUT))
