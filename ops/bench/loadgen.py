"""``kvops bench loadgen``: how fast one Locust process drives streaming load, and how close
its TTFT is to the server's own, next to ``vllm bench serve`` on the same server.

* ttft_error_ms_p50: our client's TTFT p50 minus the p50 of the increase of vLLM's
  ``vllm:time_to_first_token_seconds`` histogram over the same window (bucket-interpolated;
  the mean difference, which needs no interpolation, is reported too).
* vllm_bench_ttft_error_ms_p50: the same for ``vllm bench serve`` at the same rate and shape.
* max_rate_rps: the highest Poisson rate one Locust process sustains against a minimal SSE
  server (so that the load generator, not vLLM on these 2 cores, is the limit): arrivals within
  10 % of the target, median send lateness and TTFT under 10 ms.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvops.loadtest.metrics import MetricsSample, bucket_quantile, hist_mean, scrape
from kvops.loadtest.records import read_jsonl
from kvops.loadtest.runner import LoadtestRequest
from kvops.loadtest.runner import run as run_loadtest
from kvops.ops.launch import ManagedServer, free_port, log_tail, vllm_executable, vllm_server

RATE_RPS = 1.0
DURATION_S = 20.0
INPUT_WORDS, OUTPUT_TOKENS = 120, 64
FAKE_RATES = (50.0, 100.0, 200.0, 400.0)


def _scenario(path: Path, users: int = 32) -> Path:
    # one /metrics scrape at each end only: vllm bench serve does not scrape during its run,
    # and each scrape takes the server's API process (which writes the SSE) a few ms
    path.write_text(f"workload: {{prompt_words: {INPUT_WORDS}, max_tokens: {OUTPUT_TOKENS}}}\n"
                    f"users: {users}\nscrape_interval_s: 600\n")
    return path


def ours(url: str, work: Path) -> dict[str, Any]:
    result = run_loadtest(LoadtestRequest(
        "ttft-regression", url, work / "ours", duration_s=DURATION_S, rate=RATE_RPS,
        scenario_file=_scenario(work / "ours.yaml")))
    samples = [MetricsSample.from_dict(r) for r in read_jsonl(Path(result["files"]["metrics"]))]
    client = result["client"]
    server_p50 = bucket_quantile(samples[0], samples[-1], 0.5)
    p50 = client["ttft_p50_s"]
    return {"requests": client["ok"], "errors": client["errors"], "ttft_p50_ms": _ms(p50),
            "server_ttft_p50_ms": _ms(server_p50),
            "ttft_error_ms_p50": _ms(p50 - server_p50) if p50 is not None and server_p50 else None,
            "ttft_error_ms_mean": client["ttft_client_minus_server_ms"]}


def vllm_bench(url: str, model: Path, work: Path) -> dict[str, Any]:
    out = work / "vllm-bench"
    argv = [vllm_executable(), "bench", "serve", "--backend", "vllm", "--base-url", url,
            "--model", str(model), "--tokenizer", str(model), "--dataset-name", "random",
            "--random-input-len", str(INPUT_WORDS), "--random-output-len", str(OUTPUT_TOKENS),
            "--random-range-ratio", "0", "--ignore-eos", "--seed", "1", "--temperature", "0",
            "--request-rate", str(RATE_RPS), "--num-prompts", str(int(RATE_RPS * DURATION_S)),
            "--percentile-metrics", "ttft", "--metric-percentiles", "50", "--save-result",
            "--result-dir", str(out), "--disable-tqdm"]
    before = scrape(url)
    log = work / "vllm-bench.log"
    with open(log, "wb") as handle:
        code = subprocess.run(argv, stdout=handle, stderr=subprocess.STDOUT, timeout=600,  # noqa: S603
                              env={**_env(), "HF_HUB_OFFLINE": "1"}).returncode
    after = scrape(url)
    files = sorted(out.glob("*.json")) if out.exists() else []
    if code != 0 or not files:
        return {"available": False, "error": log_tail(log, 5)}
    data = json.loads(files[-1].read_text())
    # its warm-up request is counted by the server too; the mean error is diluted by 1/N
    server_p50, server_mean = bucket_quantile(before, after, 0.5), hist_mean(before, after, "ttft")
    return {"available": True, "requests": data.get("completed"),
            "ttft_p50_ms": data.get("median_ttft_ms"), "server_ttft_p50_ms": _ms(server_p50),
            "vllm_bench_ttft_error_ms_p50": _diff_ms(data.get("median_ttft_ms"), server_p50),
            "vllm_bench_ttft_error_ms_mean": _diff_ms(data.get("mean_ttft_ms"), server_mean)}


def _diff_ms(client_ms: float | None, server_s: float | None) -> float | None:
    return None if client_ms is None or not server_s else round(client_ms - server_s * 1000, 2)


def max_rate(work: Path) -> dict[str, Any]:
    port = free_port()
    fake = ManagedServer(name="fake-sse", port=port, log_path=work / "fake.log", env=_env(),
                         argv=[sys.executable, "-m", "kvops.ops.bench.fake_sse", str(port)])
    fake.start(health_path="/v1/models", timeout_s=60)
    steps, best = [], 0.0
    try:
        for rate in FAKE_RATES:
            result = run_loadtest(LoadtestRequest(
                "ttft-regression", fake.url, work / f"fake-{int(rate)}", duration_s=8.0, rate=rate,
                scenario_file=_scenario(work / "fake.yaml", users=128)))
            summary = result["ttft"]["summary"]
            ok = ((summary["arrival_rate_rps"] or 0.0) >= 0.9 * rate
                  and (summary["lateness_p50_s"] or 0.0) < 0.010
                  and (summary["ttft_p50_s"] or 1.0) < 0.010)
            steps.append({"rate_rps": rate, "arrival_rate_rps": summary["arrival_rate_rps"],
                          "lateness_p50_ms": _ms(summary["lateness_p50_s"]),
                          "ttft_p50_ms": _ms(summary["ttft_p50_s"]), "sustained": ok})
            if not ok:
                break
            best = rate
    finally:
        fake.stop()
    return {"max_rate_rps": best, "steps": steps}


def run() -> dict[str, Any]:
    from kvops.ops.models.tiny import TinyModelSpec, build_tiny_model

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvops-bench-loadgen-") as tmp:
        work = Path(tmp)
        model = build_tiny_model(work / "tiny", TinyModelSpec())
        server = vllm_server(model, ["--max-model-len", "2048"], log_path=work / "vllm.log")
        server.start()
        try:
            ours_result = ours(server.url, work)
            bench_result = vllm_bench(server.url, model, work)
        finally:
            server.stop()
        rate = max_rate(work)
    return {
        "max_rate_rps": rate["max_rate_rps"],
        "ttft_error_ms_p50": ours_result["ttft_error_ms_p50"],
        "vllm_bench_ttft_error_ms_p50": bench_result.get("vllm_bench_ttft_error_ms_p50"),
        "ttft_error_ms_mean": ours_result["ttft_error_ms_mean"],
        "vllm_bench_ttft_error_ms_mean": bench_result.get("vllm_bench_ttft_error_ms_mean"),
        "rate_rps": RATE_RPS, "duration_s": DURATION_S,
        "ours": ours_result, "vllm_bench": bench_result, "max_rate_steps": rate["steps"],
        "bench_seconds": round(time.monotonic() - started, 1),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 2)


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)
