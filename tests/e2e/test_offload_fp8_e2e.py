"""Every kvops feature on one server, fp8 KV included (issue 41, item 5), and fp8 chunks that
LMCache must not hand to a server whose KV means something else.

One real `lmcache server` (`kvops offload serve`) shared, in turn, by: an fp8 server with a
scales file, admission and offload (`promtool check metrics` on its live /metrics); then, as an
operator restarts after recalibrating, an fp8 server at vLLM's scale 1.0 on the same LMCache,
which still holds the first server's chunks. Same model, same tokens, same byte size: before
kvops keyed chunks by KV layout (plugin/offload/layout.py), the second server loaded them and
answered unlike a plugin-free fp8 server (measured: 3 of 3 prompts).

Oracles are external: promtool, vLLM's own cached-token counts and the greedy output of an fp8
server without the plugin. fp8 KV needs a CPU with AVX-512 or AMX (tests/fp8_cpu.py).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from fp8_cpu import needs_fp8_cpu

from kvops.core.fp8.scales import fingerprint_of_config, read_model_config
from kvops.ops.launch import ManagedServer

from .conftest import Want
from .test_offload_e2e import (
    CHUNK_TOKENS,
    Lmcache,
    cached_tokens,
    complete,
    metric,
    reset_vllm_prefix_cache,
    token_prompt,
    wait_for,
)

pytestmark = [pytest.mark.e2e, needs_fp8_cpu]

LEN = ("--max-model-len", "2048", "--enable-prompt-tokens-details")
FP8 = ("--kv-cache-dtype", "fp8")
PROMTOOL_SEED = 30
SEEDS = (31, 32, 33)
SCALE = 0.03125
"""Every layer's k/v scale in the scales file: 2^-5, exact in fp8's exponent, far enough from
1.0 that the tiny model's K/V (absmax about 1-4) land on other fp8 codes than at scale 1.0."""


@pytest.fixture(scope="module")
def lmcache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lmcache]:
    server = Lmcache(tmp_path_factory.mktemp("offload-fp8"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def config_with_scales(tiny_model: Path, lmcache: Lmcache) -> str:
    """A kvops.yaml with offload on ``lmcache``, admission and a scales file for the tiny model."""
    scales = lmcache.root / "scales.json"
    scales.write_text(json.dumps({
        "dtype": "fp8_e4m3",
        "model": fingerprint_of_config(read_model_config(tiny_model)).model_dump(),
        "layers": {f"model.layers.{i}.self_attn.attn": {"k_scale": SCALE, "v_scale": SCALE}
                   for i in range(read_model_config(tiny_model)["num_hidden_layers"])},
    }))
    config = lmcache.root / "kvops-all.yaml"
    config.write_text(json.dumps({
        "offload": lmcache.settings, "kv_scales": str(scales),
        "admission": {"policy": "strict", "max_queued_requests": 8},
    }))
    return json.dumps({"kvops": {"config": str(config)}})


@pytest.fixture(scope="module")
def all_on(vllm, tiny_model: Path, config_with_scales: str) -> ManagedServer:
    return vllm(tiny_model, *LEN, *FP8, "--additional-config", config_with_scales,
                env={"VLLM_SERVER_DEV_MODE": "1"})


def test_every_feature_on_with_fp8_passes_promtool(all_on: ManagedServer, tiny_model: Path) -> None:
    """fp8 scales, offload and admission on one server: promtool finds nothing in kvops' series,
    and each feature publishes its own."""
    complete(all_on.url, tiny_model, token_prompt(PROMTOOL_SEED))
    text = requests.get(all_on.url + "/metrics", timeout=10).text
    for feature in ("fp8_scales", "offload", "admission"):
        assert f'kvops_feature_enabled{{feature="{feature}"' in text, feature
    assert 'source="file"} 1.0' in text  # kvops_fp8_scale_source: the scales file's
    assert "kvops_offload_server_up" in text
    assert "kvops_admission_settings_info" in text
    proc = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode in (0, 3), proc.stdout + proc.stderr  # 3: lint findings only (vLLM's colons)
    ours = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("kvops_")]
    assert ours == [], ours


def test_chunks_of_other_fp8_scales_are_misses_never_loaded(
        vllm, tiny_model: Path, lmcache: Lmcache, all_on: ManagedServer) -> None:
    """The restart after a recalibration: an fp8 server at scale 1.0 on the LMCache that holds
    the scaled server's chunks of the same prompts loads none of them, answers as a plugin-free
    fp8 server does, and still loads its own chunks."""
    chunks = "lmcache_mp_l1_write_chunks_total"
    before = metric(lmcache.url, chunks)
    for seed in SEEDS:
        complete(all_on.url, tiny_model, token_prompt(seed))
    wait_for("LMCache to hold the scaled server's chunks of every prompt",
             lambda: metric(lmcache.url, chunks) >= before + 2 * len(SEEDS))
    scale1, stock = vllm.many(
        Want(tiny_model, (*LEN, *FP8, "--additional-config", lmcache.vllm_settings()),
             env={"VLLM_SERVER_DEV_MODE": "1"}),
        Want(tiny_model, (*LEN, *FP8), env={"VLLM_PLUGINS": "none"}))
    for seed in SEEDS:
        prompt = token_prompt(seed)
        want = complete(stock.url, tiny_model, prompt)["choices"][0]["text"]
        stored = metric(lmcache.url, chunks)
        first = complete(scale1.url, tiny_model, prompt)
        assert cached_tokens(first) == 0, f"seed {seed}: loaded another layout's KV {first['usage']}"
        assert first["choices"][0]["text"] == want, seed
        # its own chunks, once vLLM's prefix cache is gone: a hit from LMCache, the same answer
        wait_for(f"seed {seed}: LMCache to store the scale-1.0 server's chunks",
                 lambda stored=stored: metric(lmcache.url, chunks) >= stored + 2)
        reset_vllm_prefix_cache(scale1)
        again = complete(scale1.url, tiny_model, prompt)
        assert cached_tokens(again) == CHUNK_TOKENS, again["usage"]
        assert again["choices"][0]["text"] == want, seed
