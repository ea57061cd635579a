"""``make demo`` / ``kvops demo``: the main job end to end on this machine's CPU.

Builds a tiny model on the spot, starts the real `vllm serve` with the kvops plugin, sends a
short burst of requests and prints what vLLM and the plugin report. Each step prints as it
goes so a newcomer sees where time is spent; the server is always stopped at the end.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import requests
from kvops.ops.errors import KvopsError
from kvops.ops.launch import ManagedServer, vllm_server
from kvops.ops.models.tiny import TinyModelSpec, build_tiny_model
from prometheus_client.parser import text_string_to_metric_families

KV_LINE = re.compile(r"(?:CPU|GPU) KV cache size: [\d,]+ tokens, Maximum concurrency for .*")
SHOWN_METRICS = (
    "kvops_info", "kvops_feature_enabled", "vllm:cache_config_info",
    "vllm:request_success", "vllm:prompt_tokens", "vllm:generation_tokens",
    "vllm:num_preemptions", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits",
    "vllm:prefix_cache_queries",
)
CACHE_INFO_LABELS = ("block_size", "cache_dtype", "num_gpu_blocks", "kv_cache_size_tokens",
                     "kv_cache_max_concurrency")


@dataclass(frozen=True)
class DemoOptions:
    work_dir: Path
    requests: int = 8
    max_tokens: int = 32
    max_model_len: int = 2048
    kv_cache_bytes: int = 256 << 20


def run_demo(options: DemoOptions, say: Callable[[str], None]) -> dict[str, object]:
    work = options.work_dir
    say(f"[1/4] building a tiny random-weight Llama in {work / 'model'}")
    model = build_tiny_model(work / "model", TinyModelSpec())
    settings = work / "kvops.yaml"
    settings.write_text("# kvops settings for the demo server (see README)\n{}\n")
    server = vllm_server(
        model,
        ["--max-model-len", str(options.max_model_len),
         "--additional-config", json.dumps({"kvops": {"config": str(settings)}})],
        kv_cache_bytes=options.kv_cache_bytes, log_path=work / "vllm.log", name="vllm (demo)",
    )
    say(f"[2/4] starting vllm serve with the kvops plugin on {server.url} (log: {server.log_path})")
    try:
        server.start()
        say(f"[3/4] sending {options.requests} concurrent completions")
        answers = _burst(server, str(model), options)
        for i, (text, usage) in enumerate(answers):
            say(f"      #{i}: {usage['prompt_tokens']} prompt + {usage['completion_tokens']} "
                f"generated tokens: {text[:48]!r}")
        say("[4/4] what vLLM and the plugin report")
        capacity = _kv_line(server)
        say(f"      {capacity}")
        metrics = _metrics(server)
        for line in metrics:
            say(f"      {line}")
        return {"url": server.url, "answers": len(answers), "capacity": capacity, "metrics": metrics}
    finally:
        server.stop()
        say("      server stopped")


def _burst(server: ManagedServer, model: str, options: DemoOptions) -> list[tuple[str, dict[str, int]]]:
    def one(i: int) -> tuple[str, dict[str, int]]:
        body = {
            "model": model, "max_tokens": options.max_tokens, "temperature": 0,
            "prompt": f"you are a helpful assistant answer the question briefly request {i}",
        }
        resp = requests.post(server.url + "/v1/completions", json=body, timeout=300)
        if resp.status_code != 200:
            raise KvopsError(f"demo request {i} failed with HTTP {resp.status_code}: {resp.text[:200]}")
        data = resp.json()
        return data["choices"][0]["text"], data["usage"]

    with ThreadPoolExecutor(max_workers=options.requests) as pool:
        return list(pool.map(one, range(options.requests)))


def _kv_line(server: ManagedServer) -> str:
    match = KV_LINE.search(server.log_path.read_text(errors="replace"))
    return match.group(0) if match else "(no KV cache size line in the log)"


def _metrics(server: ManagedServer) -> list[str]:
    text = requests.get(server.url + "/metrics", timeout=30).text
    lines = []
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(SHOWN_METRICS):
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = sample.labels
            if sample.name == "vllm:cache_config_info":
                labels = {k: v for k, v in labels.items() if k in CACHE_INFO_LABELS}
            else:
                labels = {k: v for k, v in labels.items() if k not in ("model_name", "engine")}
            shown = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            lines.append(f"{sample.name}{{{shown}}} {sample.value:g}")
    return lines
