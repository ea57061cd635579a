"""The scales file, the fingerprint and the fp8 support rules (no server)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from kvops.core.errors import BadInputError
from kvops.core.fp8.scales import (
    checkpoint_kv_scale_names,
    choose_scale_source,
    fingerprint_of_config,
    fp8_kv_support,
    load_scales_file,
    normalize_fp8_dtype,
    scale_from_absmax,
    scales_mismatch,
)

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 2,
    "transformers_version": "4.0",
}
AVX512 = frozenset({"sse4_2", "avx512f", "avx512_bf16"})


def _scales(**overrides: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "dtype": "fp8_e4m3",
        "model": fingerprint_of_config(LLAMA).model_dump(),
        "layers": {
            f"model.layers.{i}.self_attn.attn": {"k_scale": 0.5, "v_scale": 0.25} for i in range(2)
        },
    }
    doc.update(overrides)
    return doc


def test_fp8_alias_is_e4m3_and_others_are_not_fp8():
    assert normalize_fp8_dtype("fp8") == "fp8_e4m3"
    assert normalize_fp8_dtype("fp8_e5m2") == "fp8_e5m2"
    assert normalize_fp8_dtype("auto") is None
    assert normalize_fp8_dtype("fp8_per_token_head") is None


@pytest.mark.parametrize(
    ("arch", "flags", "head_dim", "mla", "ok", "reason"),
    [
        ("x86_64", AVX512, 64, False, True, ""),
        ("x86_64", frozenset({"amx_tile"}), 128, False, True, ""),
        ("x86_64", frozenset({"avx2"}), 64, False, False, "AVX-512 or AMX"),
        ("aarch64", frozenset({"asimd", "avx512f"}), 64, False, False, "AVX-512 or AMX"),
        ("x86_64", AVX512, 80, False, False, "head_dim is 80"),
        ("x86_64", AVX512, 64, True, False, "MLA"),
    ],
)
def test_fp8_kv_support_follows_the_cpu_backend_rules(arch, flags, head_dim, mla, ok, reason):
    got_ok, got_reason = fp8_kv_support(arch, flags, head_dim, mla)
    assert got_ok is ok
    assert reason in got_reason


def test_scale_puts_absmax_times_margin_at_the_format_max():
    assert scale_from_absmax(448.0, "fp8_e4m3", margin=1.0) == 1.0
    assert scale_from_absmax(896.0, "fp8_e4m3", margin=1.25) == pytest.approx(2.5)
    assert scale_from_absmax(57344.0, "fp8_e5m2", margin=1.0) == 1.0
    assert scale_from_absmax(0.0, "fp8_e4m3") == 1.0


def test_fingerprint_ignores_tooling_keys_but_not_shape():
    base = fingerprint_of_config(LLAMA)
    assert fingerprint_of_config({**LLAMA, "transformers_version": "5.1"}) == base
    other = fingerprint_of_config({**LLAMA, "num_hidden_layers": 3})
    assert other.num_layers == 3
    assert other.config_sha256 != base.config_sha256
    derived = fingerprint_of_config({k: v for k, v in LLAMA.items() if k != "head_dim"})
    assert derived.head_dim == 64


def test_scales_file_round_trip_and_match(tmp_path: Path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(_scales()))
    scales = load_scales_file(path)
    assert scales.layers["model.layers.1.self_attn.attn"].v_scale == 0.25
    assert scales_mismatch(scales, fingerprint_of_config(LLAMA)) is None
    mismatch = scales_mismatch(scales, fingerprint_of_config({**LLAMA, "num_hidden_layers": 4}))
    assert mismatch is not None
    assert "num_layers" in mismatch


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_non_positive_or_non_finite_scale_is_refused(tmp_path: Path, bad: float):
    doc = _scales()
    doc["layers"]["model.layers.0.self_attn.attn"]["k_scale"] = bad  # type: ignore[index]
    path = tmp_path / "s.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(BadInputError, match=r"layers\.model\.layers\.0\.self_attn\.attn\.k_scale"):
        load_scales_file(path)


def test_unknown_key_and_missing_file_are_bad_input(tmp_path: Path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(_scales(extra=1)))
    with pytest.raises(BadInputError, match="extra"):
        load_scales_file(path)
    with pytest.raises(BadInputError, match="not found"):
        load_scales_file(tmp_path / "missing.json")


def test_checkpoint_scales_win_unless_overridden():
    assert choose_scale_source(True, True, False) == "checkpoint"
    assert choose_scale_source(True, True, True) == "file"
    assert choose_scale_source(False, True, False) == "file"
    assert choose_scale_source(True, False, False) == "checkpoint"
    assert choose_scale_source(False, False, True) == "default"


def test_checkpoint_scale_names_come_from_safetensors_headers(tmp_path: Path):
    header = json.dumps({
        "model.layers.0.self_attn.k_scale": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]},
        "model.layers.0.self_attn.q_proj.weight": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
        "model.layers.1.self_attn.v_proj.output_scale": {"dtype": "F32", "shape": [], "data_offsets": [8, 12]},
    }).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 12)
    assert checkpoint_kv_scale_names(tmp_path) == [
        "model.layers.0.self_attn.k_scale", "model.layers.1.self_attn.v_proj.output_scale",
    ]



_VALID_SCALES = {"format_version": 1, "dtype": "fp8_e4m3", "layers": {"model.layers.0.self_attn.attn": {
    "k_scale": 0.1, "v_scale": 0.1}}, "model": {"architecture": "LlamaForCausalLM", "num_layers": 2,
                                                "num_kv_heads": 2, "head_dim": 64, "config_sha256": "0" * 64}}


@pytest.mark.parametrize(("path", "value"), [
    (("model", "head_dim"), 0), (("model", "num_kv_heads"), 0), (("model", "num_layers"), 10**9),
    (("margin",), -1.0), (("margin",), 0.0), (("tokens_seen",), -5), (("format_version",), 0),
])
def test_scales_file_sizes_out_of_bounds_are_one_line(tmp_path: Path, path: tuple[str, ...], value: object) -> None:
    doc = json.loads(json.dumps(_VALID_SCALES))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    file = tmp_path / "scales.json"
    file.write_text(json.dumps(doc))
    with pytest.raises(BadInputError, match=".".join(path)) as caught:
        load_scales_file(file)
    assert "\n" not in str(caught.value)


def test_the_valid_scales_file_of_the_bounds_test_loads(tmp_path: Path) -> None:
    file = tmp_path / "scales.json"
    file.write_text(json.dumps(_VALID_SCALES))
    assert load_scales_file(file).model.head_dim == 64
