"""A tiny random-weight Llama that vLLM serves, built on the spot.

Tests, benches and the demo need a real model but no hub is reachable, so we write one:
safetensors weights with Llama tensor names, a byte-level BPE tokenizer trained with
``tokenizers`` on a fixed corpus, and a chat template. The same arguments and seed give the
same files byte for byte. torch and tokenizers are imported inside the function: ``kvops.ops``
stays importable without them.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvops.core.errors import BadInputError, KvopsError

CHAT_TEMPLATE = (
    # tools (an OpenAI body's `tools` array) open the prompt, one JSON line each, as real
    # templates put them in the system turn: their order is part of the prefix
    "{% if tools %}<|system|>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</s>\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ("<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")

_CORPUS_WORDS = (
    "the cache holds keys and values for every token of every request so that decoding "
    "reads them instead of recomputing attention over the prompt a block stores sixteen "
    "or one hundred twenty eight tokens the scheduler admits requests while blocks are free "
    "and preempts the newest one when decode growth runs out of memory prefix caching reuses "
    "blocks whose hashes match an earlier prompt system prompts documents and earlier turns "
    "of a conversation are shared offload moves blocks to host memory and disk time to first "
    "token is queueing plus prefill plus the first decode step quantised fp8 values halve "
    "the bytes per token when scales fit the range of keys and values hello world you are a "
    "helpful assistant answer the question briefly and cite the document 0 1 2 3 4 5 6 7 8 9"
).split()


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the model; head_dim × num_attention_heads is the hidden size."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 512
    vocab: int = 1024
    max_position_embeddings: int = 8192
    seed: int = 0
    kv_proj_scale: float = 1.0

    def validate(self) -> None:
        checks = (
            (self.layers >= 1, "--layers must be >= 1"),
            (self.kv_heads >= 1, "--kv-heads must be >= 1"),
            (self.heads >= self.kv_heads, "--heads must be >= --kv-heads"),
            (self.heads % self.kv_heads == 0, "--heads must be a multiple of --kv-heads"),
            (self.head_dim >= 8 and self.head_dim % 8 == 0, "--head-dim must be a multiple of 8"),
            (self.hidden >= 8, "--hidden must be >= 8"),
            (self.intermediate >= 8, "--intermediate must be >= 8"),
            (self.vocab >= 300, "--vocab must be >= 300 (256 byte tokens + specials)"),
            (self.max_position_embeddings >= 64, "--max-position-embeddings must be >= 64"),
            (self.kv_proj_scale > 0, "--kv-proj-scale must be > 0"),
        )
        for ok, message in checks + self._upper_bounds():
            if not ok:
                raise BadInputError(message)

    def _upper_bounds(self) -> tuple[tuple[bool, str], ...]:
        """A tiny model is tiny: past these, building it would take minutes and gigabytes."""
        bounds = {"--layers": (self.layers, 64), "--hidden": (self.hidden, 8192), "--heads": (self.heads, 256),
                  "--kv-heads": (self.kv_heads, 256), "--head-dim": (self.head_dim, 512),
                  "--intermediate": (self.intermediate, 32768), "--vocab": (self.vocab, 262144),
                  "--max-position-embeddings": (self.max_position_embeddings, 1 << 20)}
        return (*((value <= top, f"{option} {value} is past {top:,}, the most a tiny model takes")
                  for option, (value, top) in bounds.items()),
                (math.isfinite(self.kv_proj_scale), "--kv-proj-scale must be a finite number"))


def config_dict(spec: TinyModelSpec) -> dict[str, object]:
    """The config.json vLLM reads; plain Llama, bf16, untied embeddings."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": spec.vocab,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
    }


def build_tiny_model(out_dir: Path, spec: TinyModelSpec) -> Path:
    """Write config, weights, tokenizer and template into out_dir; return out_dir."""
    spec.validate()
    try:
        import torch
        from safetensors.torch import save_file
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise KvopsError(
            f"building a model needs torch and safetensors ({exc.name} is missing): "
            "pip install torch safetensors, or the [gpu] or [cpu] extra (in a kvops checkout: make setup)"
        ) from exc
    if out_dir.exists() and not out_dir.is_dir():
        raise BadInputError(f"{out_dir} exists and is not a directory: choose another OUT_DIR")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config_dict(spec), indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1}, indent=2) + "\n"
    )
    save_file(_weights(spec, torch), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer(out_dir, spec.vocab)
    (out_dir / "kvops-tiny.json").write_text(json.dumps(asdict(spec), indent=2) + "\n")
    return out_dir


def _weights(spec: TinyModelSpec, torch: Any) -> dict[str, Any]:
    import torch as t

    gen = t.Generator().manual_seed(spec.seed)
    std = 0.02

    def normal(*shape: int, scale: float = 1.0) -> t.Tensor:
        return (t.randn(*shape, generator=gen) * (std * scale)).to(t.bfloat16)

    q_dim = spec.heads * spec.head_dim
    kv_dim = spec.kv_heads * spec.head_dim
    tensors: dict[str, t.Tensor] = {
        "model.embed_tokens.weight": normal(spec.vocab, spec.hidden, scale=50.0),
        "model.norm.weight": t.ones(spec.hidden, dtype=t.bfloat16),
        "lm_head.weight": normal(spec.vocab, spec.hidden, scale=5.0),
    }
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(q_dim, spec.hidden, scale=5.0)
        tensors[p + "self_attn.k_proj.weight"] = normal(
            kv_dim, spec.hidden, scale=5.0 * spec.kv_proj_scale
        )
        tensors[p + "self_attn.v_proj.weight"] = normal(
            kv_dim, spec.hidden, scale=5.0 * spec.kv_proj_scale
        )
        tensors[p + "self_attn.o_proj.weight"] = normal(spec.hidden, q_dim)
        tensors[p + "mlp.gate_proj.weight"] = normal(spec.intermediate, spec.hidden)
        tensors[p + "mlp.up_proj.weight"] = normal(spec.intermediate, spec.hidden)
        tensors[p + "mlp.down_proj.weight"] = normal(spec.hidden, spec.intermediate)
        tensors[p + "input_layernorm.weight"] = t.ones(spec.hidden, dtype=t.bfloat16)
        tensors[p + "post_attention_layernorm.weight"] = t.ones(spec.hidden, dtype=t.bfloat16)
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


def _write_tokenizer(out_dir: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [" ".join(_CORPUS_WORDS[i:] + _CORPUS_WORDS[:i]) for i in range(len(_CORPUS_WORDS))]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "</s>",
        "unk_token": None,
        "add_bos_token": False,
        "model_max_length": 1_000_000,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>"}, indent=2) + "\n"
    )
