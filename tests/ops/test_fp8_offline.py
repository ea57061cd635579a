"""The offline fp8 KV emulation: the round trip against torch's own cast and vLLM's own fp8
quantizer, and the attention hook against transformers' stock attention (no server)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvops.core.fp8.scales import FORMAT_MAX, FORMAT_MIN_NORMAL
from kvops.ops.fp8.calibrate import range_shares
from kvops.ops.fp8.offline import LayerQuant, fp8_round_trip, load_offline_model, unquantized
from kvops.ops.models.tiny import TinyModelSpec, build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("offline") / "tiny", TinyModelSpec(layers=2))


def test_round_trip_in_range_is_torchs_own_cast() -> None:
    x = torch.randn(4096) * 100
    assert torch.equal(fp8_round_trip(x, 1.0, "fp8_e4m3"), x.to(torch.float8_e4m3fn).float())
    assert torch.equal(fp8_round_trip(x, 1.0, "fp8_e5m2"), x.to(torch.float8_e5m2).float())


def test_round_trip_saturates_where_torchs_cast_does_not() -> None:
    """torch casts 1e6 to inf in e5m2; vLLM's cache kernels saturate (``__NV_SATFINITE``,
    tl.clamp): the round trip clips to the format's max in both formats, never inf or NaN."""
    x = torch.tensor([1e6, -1e6, 5000.0])
    assert torch.isinf(x.to(torch.float8_e5m2).float()[:2]).all()
    assert fp8_round_trip(x, 1.0, "fp8_e5m2").tolist() == [57344.0, -57344.0, 5120.0]
    assert fp8_round_trip(x, 1.0, "fp8_e4m3").tolist() == [448.0, -448.0, 448.0]
    assert fp8_round_trip(x, 10.0, "fp8_e4m3").tolist() == [4480.0, -4480.0, 4480.0]


def test_round_trip_equals_vllms_fp8_quantizer() -> None:
    """vLLM's per-tensor fp8 quantize/dequantize (quant_utils.scaled_quantize, which clamps to
    get_fp8_min_max and casts) on a tensor whose absmax makes the scale a power of two, where
    its multiply-by-reciprocal and our division round alike."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        GroupShape,
        get_fp8_min_max,
        scaled_dequantize,
        scaled_quantize,
    )

    assert get_fp8_min_max() == (-FORMAT_MAX["fp8_e4m3"], FORMAT_MAX["fp8_e4m3"])
    x = torch.randn(64, 128) * 3
    x[0, 0] = 448.0 / 16  # absmax: scale = absmax / 448 = 1/16
    quantized, scale = scaled_quantize(x, GroupShape.PER_TENSOR, torch.float8_e4m3fn, torch.float32)
    theirs = scaled_dequantize(quantized, scale)
    assert float(scale) == 1 / 16
    assert torch.equal(fp8_round_trip(x, float(scale), "fp8_e4m3"), theirs)


def test_range_shares_count_saturated_and_subnormal_values() -> None:
    """Values placed by hand: 2 of 8 beyond the max at scale 1, 3 nonzero below the smallest
    normal, one exact zero (representable, not counted)."""
    tiny_value = FORMAT_MIN_NORMAL["fp8_e4m3"] / 4
    x = torch.tensor([500.0, -600.0, tiny_value, -tiny_value, tiny_value, 0.0, 1.0, 2.0])
    assert range_shares(x, 1.0, "fp8_e4m3") == (2 / 8, 3 / 8)
    assert range_shares(x, 2.0, "fp8_e4m3") == (0.0, 3 / 8)
    assert range_shares(None, 1.0, "fp8_e4m3") == (None, None)


def test_unquantized_plan_at_float32_is_transformers_own_attention(tiny: Path) -> None:
    """The hook changes nothing but what the cache stores: with a float32 'cache' the logits are
    those of the same checkpoint under transformers' stock sdpa attention."""
    from transformers import AutoModelForCausalLM

    ours = load_offline_model(tiny)
    ours.cache_dtype = torch.float32
    ours.set_plan(unquantized(ours.num_layers))
    stock = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32, attn_implementation="sdpa")
    ids = ours.encode(["the cache holds keys and values for every token of the request"], 64)[0]
    with torch.inference_mode():
        want = torch.log_softmax(stock(ids[None]).logits[0].float(), dim=-1)
    assert torch.allclose(ours.log_probs(ids), want, atol=1e-5)


def test_fp8_plan_changes_only_the_quantized_layers_output(tiny: Path) -> None:
    model = load_offline_model(tiny)
    ids = model.encode(["prefix caching reuses blocks whose hashes match an earlier prompt"], 64)[0]
    base = model.log_probs(ids)
    model.set_plan((LayerQuant("fp8_e4m3", 1.0, 1.0), LayerQuant()))
    quantized = model.log_probs(ids)
    model.set_plan(unquantized(2))
    assert torch.equal(model.log_probs(ids), base)
    assert not torch.equal(quantized, base)


def test_absmax_is_what_the_keys_hold_after_rotary(tiny: Path) -> None:
    """Oracle: transformers' own Llama attention, its key states captured after
    apply_rotary_pos_emb by wrapping that function."""
    import transformers.models.llama.modeling_llama as llama

    model = load_offline_model(tiny)
    ids = model.encode(["offload moves blocks to host memory and disk"], 64)[0]
    seen: list[float] = []
    original = llama.apply_rotary_pos_emb

    def capture(q, k, cos, sin, *args, **kwargs):  # type: ignore[no-untyped-def]
        q2, k2 = original(q, k, cos, sin, *args, **kwargs)
        seen.append(float(k2.to(torch.bfloat16).abs().max()))
        return q2, k2

    llama.apply_rotary_pos_emb = capture
    try:
        absmax = model.absmax([ids])
    finally:
        llama.apply_rotary_pos_emb = original
    assert [k for k, _ in absmax] == seen
