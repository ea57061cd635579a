"""kv-exhaustion's knee beside the planner: a `kvops kv-capacity --json` document read back by
the load test must give the per-request blocks the planner itself counts
(kvops.ops.capacity.plan.request_blocks), for a full-attention and a sliding-window model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvops.core.errors import BadInputError
from kvops.loadtest.analysis import kv
from kvops.ops.capacity.allocator import SizingFlags, kv_capacity
from kvops.ops.capacity.model import load_config, read_model
from kvops.ops.capacity.plan import request_blocks
from kvops.ops.cli.main import app

FIXTURES = Path(__file__).parents[2] / "../shared/fixtures/model-configs"
KV_BYTES = 8 << 30
MAX_LEN = 32768


@pytest.mark.parametrize("name", ["meta-llama--Meta-Llama-3.1-8B.json", "openai--gpt-oss-20b.json"])
@pytest.mark.parametrize("tokens", [1, 127, 129, 600, 5000, 32768])
def test_plan_blocks_per_request_match_the_planner(tmp_path, name, tokens):
    res = CliRunner().invoke(app, ["kv-capacity", "--config", str(FIXTURES / name),
                                   "--kv-cache-memory-bytes", str(KV_BYTES),
                                   "--max-model-len", str(MAX_LEN), "--json"])
    assert res.exit_code == 0, res.output
    doc = tmp_path / "cap.json"
    doc.write_text(res.output)
    expected = kv.load_expectation(doc)
    flags = SizingFlags(max_model_len=MAX_LEN)
    cap = kv_capacity(read_model(load_config(FIXTURES / name)), KV_BYTES, flags)
    got = kv.planned_concurrency(expected, float(tokens))
    assert got["plan_blocks_per_request"] == request_blocks(cap, flags, tokens)
    assert got["plan_predicted_max_concurrency"] == (cap.num_blocks - 1) // request_blocks(cap, flags, tokens)


def test_plan_json_brings_max_num_seqs(tmp_path):
    doc = tmp_path / "plan.json"
    doc.write_text(json.dumps({"max_num_seqs": 48, "capacity": {"num_blocks": 101, "block_size": 16}}))
    got = kv.planned_concurrency(kv.load_expectation(doc), 100.0)  # 7 blocks of 16
    assert got == {"plan_num_blocks": 101, "plan_block_size": 16, "plan_blocks_per_request": 7,
                   "plan_predicted_max_concurrency": 14, "plan_max_num_seqs": 48}


@pytest.mark.parametrize("text", ["[1, 2]", '{"capacity": {"num_blocks": 0, "block_size": 16}}', "nope"])
def test_expectation_that_is_not_a_plan(tmp_path, text):
    doc = tmp_path / "x.json"
    doc.write_text(text)
    with pytest.raises(BadInputError, match="--expect"):
        kv.load_expectation(doc)
