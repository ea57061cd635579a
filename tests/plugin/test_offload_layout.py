"""The KV layout kvops adds to LMCache's model name (plugin/offload/layout.py): servers whose KV
bytes mean different things get different names, servers whose bytes mean the same get one.
The live consequence (an fp8 server restarted at other scales loads none of the old chunks) is
tests/e2e/test_offload_fp8_e2e.py; this covers the cases no CPU here can serve (fp8_e5m2 beside
e4m3, checkpoint scales, skipped layers, float16)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from kvops.core.fp8.scales import fingerprint_of_config
from kvops.plugin.fp8.worker import checkpoint_has_scales, scales_file
from kvops.plugin.offload import layout
from kvops.plugin.offload.layout import LAYOUT_NAMESPACE, kv_layout, tag_adapters

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
CONFIG: dict[str, object] = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
                             "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(autouse=True)
def _fresh_caches() -> None:
    layout._file_digest.cache_clear()
    checkpoint_has_scales.cache_clear()
    scales_file.cache_clear()


def _scales(path: Path, k: float, v: float = 0.5, margin: float = 1.25) -> Path:
    path.write_text(json.dumps({
        "dtype": "fp8_e4m3", "margin": margin,
        "model": fingerprint_of_config(CONFIG).model_dump(),
        "layers": {name: {"k_scale": k, "v_scale": v} for name in LAYERS},
    }))
    return path


def _config(model: Path, kv: str = "auto", dtype: str = "torch.bfloat16", scales: Path | None = None,
            skips: tuple[str, ...] = (), override: bool = False) -> SimpleNamespace:
    kvops = {"kv_scales": {"path": str(scales), "override_checkpoint": override}} if scales else {}
    return SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype=kv, kv_cache_dtype_skip_layers=list(skips)),
        model_config=SimpleNamespace(dtype=dtype, model=str(model)),
        additional_config={"kvops": kvops} if kvops else {},
    )


def test_each_meaning_of_the_bytes_has_its_own_layout(tmp_path: Path) -> None:
    a, b = _scales(tmp_path / "a.json", 0.25), _scales(tmp_path / "b.json", 0.125)
    layouts = {
        "bf16": kv_layout(_config(tmp_path)),
        "fp16": kv_layout(_config(tmp_path, dtype="torch.float16")),
        "fp8 at 1.0": kv_layout(_config(tmp_path, "fp8")),
        "e5m2 at 1.0": kv_layout(_config(tmp_path, "fp8_e5m2")),
        "fp8 scales a": kv_layout(_config(tmp_path, "fp8", scales=a)),
        "fp8 scales b": kv_layout(_config(tmp_path, "fp8", scales=b)),
        "fp8 at 1.0, layer 0 bf16": kv_layout(_config(tmp_path, "fp8", skips=("0",))),
    }
    assert len(set(layouts.values())) == len(layouts), layouts
    assert layouts["bf16"] == "bfloat16-bfloat16"
    assert layouts["fp8 at 1.0"] == "bfloat16-fp8_e4m3-scales:1.0"


def test_the_same_bytes_keep_one_layout(tmp_path: Path) -> None:
    """fp8 is fp8_e4m3; a recalibration that lands on the same scales (another margin in the
    file, the same k/v per layer) keeps the chunks; skip-layer order does not matter."""
    a = _scales(tmp_path / "a.json", 0.25)
    same = _scales(tmp_path / "same.json", 0.25, margin=2.0)
    assert kv_layout(_config(tmp_path, "fp8", scales=a)) == kv_layout(_config(tmp_path, "fp8_e4m3", scales=same))
    assert (kv_layout(_config(tmp_path, "fp8", skips=("0", "1")))
            == kv_layout(_config(tmp_path, "fp8", skips=("1", "0"))))


def test_checkpoint_scales_win_unless_the_file_overrides_them(tmp_path: Path) -> None:
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.5)}, str(tmp_path / "model.safetensors"))
    a = _scales(tmp_path / "a.json", 0.25)
    assert kv_layout(_config(tmp_path, "fp8")).endswith("scales:checkpoint")
    assert kv_layout(_config(tmp_path, "fp8", scales=a)).endswith("scales:checkpoint")
    overridden = kv_layout(_config(tmp_path, "fp8", scales=a, override=True))
    assert "checkpoint" not in overridden
    assert overridden != kv_layout(_config(tmp_path, "fp8"))


def test_both_adapters_key_with_the_tagged_name() -> None:
    connector = SimpleNamespace(scheduler_adapter=SimpleNamespace(model_name="/m"), worker_adapter=None)
    assert tag_adapters(connector, "bfloat16-bfloat16") == f"/m{LAYOUT_NAMESPACE}bfloat16-bfloat16"
    assert connector.scheduler_adapter.model_name == f"/m{LAYOUT_NAMESPACE}bfloat16-bfloat16"
    with pytest.raises(RuntimeError, match="not the one kvops supports"):
        tag_adapters(SimpleNamespace(), "x")
