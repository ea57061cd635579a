"""`kvops plan` plans for the device it is told about (no silent H100), a CPU plan gives vLLM's
CPU worker the KV bytes themselves, and --out-dir writes a plan that runs as written."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from kvops.core.errors import BadInputError
from kvops.ops.capacity.memory import host_available_gib
from kvops.ops.cli.main import app

CONFIGS = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "model-configs"
LLAMA_8B = CONFIGS / "meta-llama--Meta-Llama-3.1-8B.json"


def _plan(*args: str):
    return CliRunner().invoke(app, ["plan", "--config", str(LLAMA_8B), "--max-model-len", "8192", *args])


def test_no_device_given_is_refused_naming_the_three_ways():
    res = _plan()
    assert res.exit_code == 2
    for way in ("--gpu NAME", "--gpu-memory-gib", "--device cpu"):
        assert way in res.output


def test_cpu_plan_divides_host_memory_and_gives_the_kv_bytes_not_a_utilization():
    res = _plan("--device", "cpu", "--memory-gib", "64", "--json")
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)
    assert plan["gpu_total_gib"] == 64
    assert plan["capacity"]["block_size"] == 128
    argv = shlex.split(plan["serve"])
    assert "--gpu-memory-utilization" not in argv
    kv_bytes = int(argv[argv.index("--kv-cache-memory-bytes") + 1])
    assert kv_bytes == plan["capacity"]["available_kv_bytes"]
    assert plan["capacity"]["num_blocks"] == kv_bytes // plan["capacity"]["bytes_per_block"]


@pytest.mark.parametrize(("args", "words"), [
    (("--device", "cpu", "--gpu", "H100"), "names a GPU"),
    (("--gpu", "H100", "--memory-gib", "8"), "host memory of --device cpu"),
    (("--device", "tpu"), "'tpu'"),
])
def test_device_options_that_contradict_each_other(args, words):
    res = _plan(*args)
    assert res.exit_code == 2
    assert words in res.output


def test_host_memory_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    8388608 kB\n")
    assert host_available_gib(meminfo) == 8.0
    meminfo.write_text("MemTotal: 1 kB\n")
    with pytest.raises(BadInputError, match="--memory-gib"):
        host_available_gib(meminfo)


def test_out_dir_writes_a_runnable_plan_with_every_argument_quoted(tmp_path):
    model = tmp_path / "my models" / "llama $(touch pwned)"
    model.mkdir(parents=True)
    (model / "config.json").write_text(LLAMA_8B.read_text())
    out = tmp_path / "plan out"
    res = CliRunner().invoke(app, ["plan", "--config", str(model), "--max-model-len", "8192", "--gpu", "H100",
                                   "--out-dir", str(out)])
    assert res.exit_code == 0, res.output
    plan = json.loads((out / "plan.json").read_text())
    serve = (out / "serve.sh").read_text()
    assert (out / "serve.sh").stat().st_mode & 0o111
    line = next(ln for ln in serve.splitlines() if ln.startswith("exec "))
    argv = shlex.split(line)
    assert argv[:4] == ["exec", "vllm", "serve", str(model)]
    config = json.loads(argv[argv.index("--additional-config") + 1])
    assert config == {"kvops": {"config": str((out / "kvops.yaml").resolve())}}
    assert yaml.safe_load((out / "kvops.yaml").read_text()) == plan["kvops_yaml"]
    assert plan["serve"] in serve


def test_without_out_dir_the_table_says_how_to_get_the_yaml():
    res = _plan("--gpu", "H100")
    assert res.exit_code == 0
    assert "--out-dir DIR" in res.output
    assert "--yaml > kvops.yaml" in res.output


def test_model_is_one_option_old_spellings_still_work_and_hf_ids_come_from_the_local_cache(tmp_path):
    import os
    import subprocess
    import sys

    plain = _plan("--gpu", "H100", "--json")  # --config: the old spelling, hidden
    assert plain.exit_code == 0, plain.output
    by_model = CliRunner().invoke(app, ["plan", "--model", str(LLAMA_8B), "--max-model-len", "8192",
                                        "--gpu", "H100", "--json"])
    assert json.loads(by_model.stdout)["capacity"] == json.loads(plain.stdout)["capacity"]
    # a Hugging Face cache as huggingface_hub lays it out; its own lookup finds the config
    snapshot = tmp_path / "hub" / "models--acme--llama" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(LLAMA_8B.read_text())
    (tmp_path / "hub" / "models--acme--llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--llama" / "refs" / "main").write_text("abc123")
    code = ("from typer.testing import CliRunner\nfrom kvops.ops.cli.main import app\n"
            "r = CliRunner().invoke(app, ['kv-capacity', '--model', '{}', '--max-model-len', '8192', "
            "'--kv-cache-memory-bytes', '8G'])\nprint(r.exit_code, r.output)")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    found = subprocess.run([sys.executable, "-c", code.format("acme/llama")], env=env, capture_output=True,
                           text=True, check=True).stdout
    assert found.startswith("0 KV cache size: 65,536 tokens"), found
    missing = subprocess.run([sys.executable, "-c", code.format("acme/other")], env=env, capture_output=True,
                             text=True, check=True).stdout
    assert missing.startswith("2 ")
    assert str(tmp_path / "hub") in missing
    assert "huggingface-cli download acme/other" in missing
