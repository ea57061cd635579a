"""Every KV dtype vLLM 0.32 accepts reaches the CLI, the planner, the plugin's validation and
calibrate from one table (kvops.core.kv_dtypes), and a dtype a device cannot run is refused there
with one line.

The CLI's choices are compared with vLLM's own ``CacheDType`` read in a subprocess that imports
vLLM; the capacities are compared with vLLM's spec code in test_capacity_oracle_kv_dtypes.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from kvops.core.errors import KvopsPluginError
from kvops.core.fp8.settings import KvScalesSettings
from kvops.core.kv_dtypes import KV_DTYPES, KvDtype, calibratable_names, device_names
from kvops.ops.capacity.allocator import SizingFlags
from kvops.ops.capacity.model import load_config
from kvops.ops.capacity.skip_layers import skip_layer_cost
from kvops.ops.cli.capacity import KvCacheDtype
from kvops.ops.cli.main import app
from kvops.plugin.fp8.validate import plan_fp8

FIXTURES = Path(__file__).parents[2] / "../shared/fixtures/model-configs"
LLAMA_8B = FIXTURES / "meta-llama--Meta-Llama-3.1-8B.json"
runner = CliRunner()


def invoke(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output


def capacity(*args: str) -> tuple[int, str]:
    return invoke("kv-capacity", "--model", str(LLAMA_8B), "--kv-cache-memory-bytes", "8GiB", "--max-model-len",
                  "8192", *args)


def test_cli_choices_are_vllms_cache_dtypes() -> None:
    code = "import json, typing; from vllm.config.cache import CacheDType; print(json.dumps(typing.get_args(CacheDType)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=300)
    assert [member.value for member in KvCacheDtype] == json.loads(out.stdout.strip().splitlines()[-1])


def test_an_unknown_dtype_lists_every_choice() -> None:
    code, out = capacity("--kv-cache-dtype", "fp4")
    assert code == 2
    assert all(row.name in out for row in KV_DTYPES)


@pytest.mark.parametrize("row", KV_DTYPES, ids=lambda row: row.name)
def test_every_dtype_is_planned_or_refused_in_one_line(row: KvDtype) -> None:
    for device in ("cuda", "cpu"):
        code, out = capacity("--kv-cache-dtype", row.name, "--device", device, "--json")
        if row.runs_on(device):
            assert code == 0, out
            assert json.loads(out)["kv_cache_size_tokens"] > 0
        else:
            assert code == 2, out
            line = out.strip()
            assert "\n" not in line
            assert "Traceback" not in line
            if row.mla_only:  # Llama has no MLA latent to store in it
                assert "only for MLA models" in line
            else:
                assert f"--device {device}" in line
                assert ", ".join(device_names(device)) in line


def test_plan_refuses_turboquant_on_cpu() -> None:
    code, out = invoke("plan", "--model", str(LLAMA_8B), "--device", "cpu", "--memory-gib", "64", "--max-model-len",
                       "8192", "--kv-cache-dtype", "turboquant_k8v4")
    assert code == 2
    assert "--device cpu" in out
    assert ", ".join(device_names("cpu")) in out


def test_plan_serve_line_carries_the_dtype_and_the_skip_layers() -> None:
    code, out = invoke("plan", "--model", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192",
                       "--kv-cache-dtype", "turboquant_4bit_nc", "--kv-cache-dtype-skip-layers", "5", "--json")
    assert code == 0, out
    plan = json.loads(out)
    # vLLM adds TurboQuant's first and last 2 layers (Llama-3.1-8B: 32) and sorts the list as strings
    assert plan["kv_cache_dtype_skip_layers"] == ["0", "1", "30", "31", "5"]
    assert "--kv-cache-dtype turboquant_4bit_nc --kv-cache-dtype-skip-layers 0 1 30 31 5" in plan["serve"]


def test_bad_skip_layers_exit_2() -> None:
    code, out = capacity("--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "first")
    assert code == 2
    assert "--kv-cache-dtype-skip-layers" in out


def test_skip_layer_cost_with_and_without() -> None:
    cost = skip_layer_cost(load_config(LLAMA_8B), "fp8", ("0", "31"), 8 << 30, SizingFlags(max_model_len=8192))
    assert cost.skip_layers == ("0", "31")
    # two of 32 layers at bf16: 2 extra layers' worth of fp8 bytes
    assert cost.kv_bytes_per_token_with == cost.kv_bytes_per_token_without * 34 // 32
    assert cost.tokens_with is not None
    assert cost.tokens_without is not None
    assert cost.tokens_with < cost.tokens_without
    assert cost.tokens_ratio is not None
    assert cost.tokens_ratio < 1


def _vllm_config(cache_dtype: str) -> SimpleNamespace:
    model = SimpleNamespace(use_mla=False, get_head_size=lambda: 64, model="/nonexistent/model")
    return SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=cache_dtype), model_config=model)


@pytest.mark.parametrize("row", [row for row in KV_DTYPES if row.quantized and not row.runs_on("cpu")],
                         ids=lambda row: row.name)
def test_plugin_refuses_on_cpu_what_the_cpu_cannot_run(row: KvDtype) -> None:
    with pytest.raises(KvopsPluginError, match="CPU runs " + ", ".join(device_names("cpu"))):
        plan_fp8(_vllm_config(row.name), None, on_cpu=True)


def test_plugin_kv_scales_need_a_calibratable_dtype() -> None:
    with pytest.raises(KvopsPluginError, match=", ".join(calibratable_names())):
        plan_fp8(_vllm_config("fp8_per_token_head"), KvScalesSettings(path="/nonexistent.json"), on_cpu=False)


@pytest.mark.parametrize("row", [row for row in KV_DTYPES if not row.calibratable], ids=lambda row: row.name)
def test_calibrate_refuses_the_other_rows(row: KvDtype, tmp_path: Path) -> None:
    code, out = invoke("calibrate", "--model", str(tmp_path), "--out", str(tmp_path / "s.json"), "--dtype", row.name)
    assert code == 2
    assert ", ".join(calibratable_names()) in out


def test_calibrate_accepts_fp8_and_goes_on_to_the_next_check(tmp_path: Path) -> None:
    for name in calibratable_names():
        code, out = invoke("calibrate", "--model", str(tmp_path), "--out", str(tmp_path / "no" / "s.json"),
                           "--dtype", name)
        assert code == 2
        assert "does not exist" in out  # passed the dtype check, stopped at --out
