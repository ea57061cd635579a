"""The tiny model builder: deterministic, and loadable by transformers' own classes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvops.ops.models.tiny import TinyModelSpec, build_tiny_model


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path):
    a = _digest(build_tiny_model(tmp_path / "a", TinyModelSpec(seed=3)))
    b = _digest(build_tiny_model(tmp_path / "b", TinyModelSpec(seed=3)))
    c = _digest(build_tiny_model(tmp_path / "c", TinyModelSpec(seed=4)))
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]


def test_transformers_reads_config_tokenizer_and_template(tmp_path: Path):
    from transformers import AutoConfig, AutoTokenizer

    spec = TinyModelSpec(layers=2, kv_heads=1, heads=4, head_dim=32, hidden=128, vocab=512)
    path = build_tiny_model(tmp_path / "m", spec)
    config = AutoConfig.from_pretrained(path)
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (2, 1, 32)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) <= spec.vocab
    ids = tok("the cache holds keys and values")["input_ids"]
    assert tok.decode(ids) == "the cache holds keys and values"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|user|>\nhi</s>\n<|assistant|>\n"
    saved = json.loads((path / "kvops-tiny.json").read_text())
    assert saved["layers"] == 2


def test_kv_proj_scale_multiplies_only_k_and_v(tmp_path: Path):
    from safetensors.torch import load_file

    base = load_file(str(build_tiny_model(tmp_path / "x1", TinyModelSpec()) / "model.safetensors"))
    big = load_file(str(build_tiny_model(tmp_path / "x8", TinyModelSpec(kv_proj_scale=8.0)) / "model.safetensors"))
    k = "model.layers.0.self_attn.k_proj.weight"
    q = "model.layers.0.self_attn.q_proj.weight"
    ratio = (big[k].float().abs().mean() / base[k].float().abs().mean()).item()
    assert abs(ratio - 8.0) < 0.05
    assert (big[q] == base[q]).all()
