"""`kvops bench trace` on a small trace: the curve and the plain LRU simulation agree."""

from __future__ import annotations

import json
import random

import pytest

from kvops.core.errors import BadInputError
from kvops.ops.bench import trace


def test_bench_agrees_with_the_simulation(tmp_path, monkeypatch):
    rng = random.Random(3)
    rows = [{"timestamp": i, "input_length": rng.randrange(1, 5000), "output_length": 1,
             "hash_ids": [rng.randrange(400) for _ in range(rng.randrange(1, 9))]} for i in range(300)]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv(trace.TRACE_ENV, str(path))
    result = trace.run()
    assert result["requests"] == 300
    assert result["curve_points"] >= 3  # 64, 128, 256 blocks and up
    assert result["agree"] is True
    assert result["max_hit_ratio_difference"] == 0.0


def test_bench_without_a_trace_is_bad_input(tmp_path, monkeypatch):
    monkeypatch.setenv(trace.TRACE_ENV, str(tmp_path / "missing.jsonl"))
    with pytest.raises(BadInputError, match="KVOPS_TRACE"):
        trace.run()
