"""``kvops bench admission``: the same overload against stock vLLM and against kvops admission.

One tiny model, one deliberately small KV cache (16 usable blocks of 128 tokens), two servers
alive side by side with identical flags except the kvops settings (stock runs with
VLLM_PLUGINS=none). Normal load (short closed-loop rounds inside capacity in ABBA blocks, and the
gate's cost per step measured directly: kvops.ops.bench.admission_normal) gives the policy's cost
on throughput; then each server gets the same overload: arrivals well above what the cache can
decode at once, distinct 240-token prompts
(a preempted request recomputes a real prefill), fixed-length outputs, and a few requests that can
never fit. Reported: preemptions from vLLM's own counter, every request's fate as the client saw
it, TTFT of the successes, and goodput = successes within the TTFT SLO per second of the run.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvops.ops.bench import admission_normal
from kvops.ops.bench.admission_cost import front_door_scaling
from kvops.ops.bench.admission_leak import leak_check
from kvops.ops.bench.admission_load import Outcome, open_loop, scrape_counter
from kvops.ops.launch import ManagedServer, vllm_server
from kvops.ops.models.tiny import TinyModelSpec, build_tiny_model

BLOCK_TOKENS = 128  # the CPU platform's block size (vllm/platforms/cpu.py:292-293)
KV_BLOCKS = 17  # 16 usable + vLLM's null block
BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 2  # K+V x layers x kv heads x head_dim x bf16 (tiny default)
MAX_MODEL_LEN = 1024
SERVER_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "32")
# 241 tokens with the tiny model's tokenizer: a preempted request recomputes a real prefill.
PROMPT = "the cache holds keys and values for every token it has seen so far " * 12


@dataclass(frozen=True)
class Load:
    requests: int
    rate_rps: float
    max_tokens: int
    never_fits_every: int = 0
    """Every k-th request asks for n=3 x max_model_len: more KV than the whole cache."""

    def bodies(self, model: str) -> list[dict[str, Any]]:
        out = []
        for i in range(self.requests):
            body: dict[str, Any] = {
                "model": model, "prompt": f"request {i}: {PROMPT}", "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True,
            }
            if self.never_fits_every and i % self.never_fits_every == self.never_fits_every - 1:
                body.update(prompt="hello", n=3, max_tokens=MAX_MODEL_LEN - 24)
            out.append(body)
        return out

    def arrivals(self) -> list[float]:
        return [i / self.rate_rps for i in range(self.requests)]


OVERLOAD_MAX_TOKENS = 100
OVERLOAD_FACTOR = 4.0  # offered request rate / the rate stock sustains at normal load
OVERLOAD_DURATION_S = 25.0
OVERLOAD_MAX_REQUESTS = 240


def overload_for(stock_tokens_per_s: float) -> Load:
    """The overload is sized from the stock server's measured capacity, so that it overloads
    on a slow shared machine and on a fast one alike."""
    capacity_rps = stock_tokens_per_s / OVERLOAD_MAX_TOKENS
    rate = max(OVERLOAD_FACTOR * capacity_rps, 1.0)
    requests = int(min(OVERLOAD_MAX_REQUESTS, max(20, rate * OVERLOAD_DURATION_S)))
    return Load(requests=requests, rate_rps=rate, max_tokens=OVERLOAD_MAX_TOKENS,
                never_fits_every=max(requests // 2, 2))
TTFT_SLO_S = 10.0
# The queue budget is sized from the SLO: at most ~half a cache of worst-case work waiting, and
# no predicted wait beyond half the SLO.
KVOPS_SETTINGS = {
    "admission": {"policy": "strict", "max_queued_kv_fraction": 0.5, "max_queue_wait_s": TTFT_SLO_S / 2}
}


def summarize(outcomes: Sequence[Outcome], span_s: float, preemptions: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.status == 200 and o.finished]
    ttfts = sorted(o.ttft_s for o in ok if o.ttft_s is not None)
    good = [t for t in ttfts if t <= TTFT_SLO_S]
    return {
        "preemptions": int(preemptions),
        "answered": sum(1 for o in outcomes if not o.lost),
        "lost": sum(1 for o in outcomes if o.lost),
        "ok": len(ok),
        "rejected_429": sum(1 for o in outcomes if o.status == 429),
        "rejected_400": sum(1 for o in outcomes if o.status == 400),
        "other_status": sorted({o.status for o in outcomes} - {0, 200, 400, 429}),
        "ttft_p50_s": _quantile(ttfts, 0.5),
        "ttft_p99_s": _quantile(ttfts, 0.99),
        "goodput_rps": len(good) / span_s if span_s > 0 else 0.0,
        "tokens_per_s": sum(o.output_tokens for o in ok) / span_s if span_s > 0 else 0.0,
        "span_s": span_s,
    }


def _quantile(sorted_values: Sequence[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def measure(url: str, model: str, load: Load) -> dict[str, Any]:
    before = scrape_counter(url, "vllm:num_preemptions_total")
    start = time.perf_counter()
    outcomes = open_loop(url, load.bodies(model), load.arrivals())
    span = time.perf_counter() - start
    after = scrape_counter(url, "vllm:num_preemptions_total")
    return summarize(outcomes, span, after - before)


def normal_body(model: str) -> Callable[[int], dict[str, Any]]:
    """Request k of the normal load: a distinct prompt, fixed-length greedy output."""

    def body(k: int) -> dict[str, Any]:
        return {"model": model, "prompt": f"request {k}: {PROMPT}",
                "max_tokens": admission_normal.MAX_TOKENS, "temperature": 0, "ignore_eos": True}

    return body


def start_server(name: str, model: Path, workdir: Path, settings: dict[str, Any] | None) -> ManagedServer:
    args = list(SERVER_ARGS)
    env = {"VLLM_PLUGINS": "none"}  # stock: vLLM alone, no kvops plugin at all
    if settings is not None:
        args += ["--additional-config", json.dumps({"kvops": settings})]
        env = {}
    return vllm_server(
        model, args, log_path=workdir / f"{name}.log",
        kv_cache_bytes=KV_BLOCKS * BLOCK_TOKENS * BYTES_PER_TOKEN, env=env, name=f"vllm-{name}",
    )


def start_both(servers: Sequence[ManagedServer]) -> None:
    """Start the servers concurrently (each start is mostly waiting on imports)."""
    errors: list[BaseException] = []

    def start(server: ManagedServer) -> None:
        try:
            server.start(timeout_s=600)
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def measure_side_by_side(model: str, stock: ManagedServer, kvops: ManagedServer) -> dict[str, Any]:
    for server in (stock, kvops):
        measure(server.url, model, Load(requests=2, rate_rps=2.0, max_tokens=8))  # warm-up
    normal = admission_normal.paired_rounds({"stock": stock.url, "kvops": kvops.url}, normal_body(model))
    overload = overload_for(statistics.median(normal["tokens_per_s"]["stock"]))
    return {
        "normal": normal,
        "overload": overload.__dict__,
        "stock": measure(stock.url, model, overload),
        "kvops": measure(kvops.url, model, overload),
    }


DISCONNECTS_PER_PHASE = 1000
DISCONNECT_RSS_GOAL_MIB = 20.0


def disconnects(model: str, stock: ManagedServer, kvops: ManagedServer) -> dict[str, Any]:
    """DISCONNECTS_PER_PHASE clients hanging up at each phase, on each server in turn: the API
    server's RSS growth and what is still counted busy. Stock's growth is the reference for
    what vLLM itself keeps; the goal is on kvops' (issue 15: under 20 MB)."""
    out: dict[str, Any] = {}
    for name, server in (("stock", stock), ("kvops", kvops)):
        assert server.process is not None
        out[name] = leak_check(server.url, model, server.process.pid, DISCONNECTS_PER_PHASE)
    out["goal_rss_growth_mib"] = DISCONNECT_RSS_GOAL_MIB
    out["goal_met"] = out["kvops"]["rss_growth_mib"] < DISCONNECT_RSS_GOAL_MIB and out["kvops"]["still_busy"] == 0
    return out


def run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvops-bench-admission-") as tmp:
        workdir = Path(tmp)
        model = build_tiny_model(workdir / "tiny", TinyModelSpec())
        stock = start_server("stock", model, workdir, None)
        kvops = start_server("kvops", model, workdir, KVOPS_SETTINGS)
        try:
            start_both((stock, kvops))
            result = measure_side_by_side(str(model), stock, kvops)
            result["disconnects"] = disconnects(str(model), stock, kvops)
        finally:
            for server in (stock, kvops):
                server.stop()
        # After the servers stopped: the in-process measurement needs the cores to itself.
        cost = admission_normal.gate_cost(model, result["normal"]["engine"]["kvops"]["step_s"])
        scaling = front_door_scaling()
    stock_goodput = result["stock"]["goodput_rps"]
    return {
        "stock": result["stock"],
        "kvops": result["kvops"],
        "goodput_ratio": result["kvops"]["goodput_rps"] / stock_goodput if stock_goodput else None,
        **admission_normal.normal_load_result(result["normal"], cost),
        "policy_cost_us_per_step_256_running": cost["scheduler_256_running"]["added_us_per_step"],
        **scaling,
        "disconnects": result["disconnects"],
        "disconnect_rss_growth_mib": result["disconnects"]["kvops"]["rss_growth_mib"],
        "disconnect_still_busy": result["disconnects"]["kvops"]["still_busy"],
        "setup": {
            "kv_blocks": KV_BLOCKS, "block_tokens": BLOCK_TOKENS, "max_model_len": MAX_MODEL_LEN,
            "ttft_slo_s": TTFT_SLO_S, "overload": result["overload"],
            "overload_factor": OVERLOAD_FACTOR,
            "normal": {"concurrency": admission_normal.CONCURRENCY,
                       "per_worker": admission_normal.PER_WORKER,
                       "abba_blocks": admission_normal.BLOCKS,
                       "max_tokens": admission_normal.MAX_TOKENS,
                       "threshold": admission_normal.THRESHOLD},
            "kvops_settings": KVOPS_SETTINGS,
        },
    }
