"""fp8 KV emulated offline: a transformers forward pass whose attention reads K/V that went
through the fp8 round trip vLLM's cache applies, layer by layer.

Why offline and not servers: vLLM refuses fp8 KV on a CPU without AVX-512/AMX
(vllm/v1/attention/backends/cpu_attn.py ``_get_attn_isa``), so an fp8 server cannot run on
every machine kvops runs on; a per-layer sweep is 30+ configurations of SmolLM2, one server start
each, where a forward pass over a few thousand tokens takes seconds on two cores; and the same
float32 forward gives the same figures on any CPU (a server's batching and kernels do not).

What is emulated: vLLM stores ``fp8(key / k_scale)`` and reads back ``fp8 × k_scale``, saturating
at the format's max (the Triton writer vllm/v1/attention/ops/triton_reshape_and_cache_flash.py
divides by ``k_scale`` and casts on store; the CUDA writer converts with ``__NV_SATFINITE``, whose
bytes equal this clamp-and-cast for 25 M values, see kvops.ops.fp8.calibrate.quantization_error).
Keys are cached after the rotary embedding, and so are they quantized here: the hook is an
attention function registered in transformers' AttentionInterface, which receives the key
states after ``apply_rotary_pos_emb`` and the cache update (transformers'
models/llama/modeling_llama.py ``LlamaAttention.forward``). The model computes in float32;
the reference keeps K/V at the checkpoint's dtype (bf16: what ``--kv-cache-dtype auto`` stores).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvops.core.errors import BadInputError
from kvops.core.fp8.scales import FORMAT_MAX, read_model_config

ATTENTION_NAME = "kvops_fp8_kv"
"""The name our attention function is registered under in transformers' AttentionInterface."""
PLAN_ATTRIBUTE = "kvops_kv_quant"
"""The attribute of each attention module that says how its K/V are stored (a LayerQuant)."""
ABSMAX_ATTRIBUTE = "kvops_kv_absmax"
"""The [k_absmax, v_absmax] a module has seen since ``OfflineModel.absmax`` reset it."""
CAPTURE_ATTRIBUTE = "kvops_kv_capture"
"""The (query, key, value) calls a module has seen since ``OfflineModel.attention_inputs`` set it."""


@dataclass(frozen=True)
class LayerQuant:
    """How one layer's KV cache stores K and V: fp8 with these scales, or (fmt None) unquantized."""

    fmt: str | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0


@dataclass(frozen=True)
class AttentionInputs:
    """One attention call's query (after rotary) and the K/V its cache gives back, float32,
    shaped (batch, heads, tokens, head_dim), with the mask and arguments it was called with."""

    query: Any
    key: Any
    value: Any
    mask: Any
    kwargs: dict[str, Any]


KvPlan = tuple[LayerQuant, ...]
"""One LayerQuant per decoder layer, in layer order."""


def fp8_round_trip(x: Any, scale: float, fmt: str) -> Any:
    """``fp8(x / scale) × scale`` as vLLM's cache writes and reads it, saturating at ±max.

    torch's own cast does not saturate in every format (e5m2 overflows to inf; e4m3fn's
    behaviour has changed between torch versions), so the clamp is what makes it vLLM's
    saturating conversion."""
    import torch

    fp8 = torch.float8_e4m3fn if fmt == "fp8_e4m3" else torch.float8_e5m2
    limit = FORMAT_MAX[fmt]
    scaled = (x.float() / scale).clamp(-limit, limit)
    return (scaled.to(fp8).float() * scale).to(x.dtype)


def store(x: Any, quant: LayerQuant, cache_dtype: Any, scale: float) -> Any:
    """x as the KV cache gives it back: the checkpoint's dtype, then fp8 when the layer is."""
    stored = x.to(cache_dtype).to(x.dtype)
    return fp8_round_trip(stored, scale, quant.fmt) if quant.fmt else stored


def _attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
               **kwargs: Any) -> Any:
    """sdpa attention over K/V as the layer's cache stores them (PLAN_ATTRIBUTE)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    quant, cache_dtype = getattr(module, PLAN_ATTRIBUTE)
    seen = getattr(module, ABSMAX_ATTRIBUTE, None)
    if seen is not None:
        seen[0] = max(seen[0], float(key.to(cache_dtype).abs().max()))
        seen[1] = max(seen[1], float(value.to(cache_dtype).abs().max()))
    captured = getattr(module, CAPTURE_ATTRIBUTE, None)
    if captured is not None:
        captured.append(AttentionInputs(query.detach().clone(), store(key, quant, cache_dtype, quant.k_scale),
                                        store(value, quant, cache_dtype, quant.v_scale), attention_mask,
                                        dict(kwargs)))
    key = store(key, quant, cache_dtype, quant.k_scale)
    value = store(value, quant, cache_dtype, quant.v_scale)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register_attention() -> None:
    """Idempotent: registering the same name again replaces the same function."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, _attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


@dataclass
class OfflineModel:
    """A checkpoint loaded once in float32 with the fp8-emulating attention; ``set_plan``
    chooses, per layer, what its KV cache stores before each forward."""

    model: Any
    tokenizer: Any
    cache_dtype: Any
    num_layers: int

    def attention_modules(self) -> list[Any]:
        return [m for m in self.model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")]

    def set_plan(self, plan: KvPlan) -> None:
        if len(plan) != self.num_layers:
            raise ValueError(f"plan for {len(plan)} layers, model has {self.num_layers}")
        for module in self.attention_modules():
            setattr(module, PLAN_ATTRIBUTE, (plan[module.layer_idx], self.cache_dtype))

    def encode(self, texts: Sequence[str], max_tokens: int) -> list[Any]:
        """Token ids of each text (BOS as the tokenizer adds it), cut at max_tokens."""
        import torch

        ids = [self.tokenizer(t, return_tensors="pt").input_ids[0][:max_tokens] for t in texts]
        return [torch.as_tensor(i) for i in ids if len(i) >= 2]

    def log_probs(self, ids: Any) -> Any:
        """Next-token log-probabilities at every position of one sequence (float32)."""
        import torch

        with torch.inference_mode():
            logits = self.model(ids[None], use_cache=False).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)

    def absmax(self, sequences: Sequence[Any]) -> list[tuple[float, float]]:
        """Per layer, the largest |K| (after rotary) and |V| the cache would store for these
        sequences: what ``kvops calibrate``'s recording server measures, offline."""
        self.set_plan(unquantized(self.num_layers))
        modules = sorted(self.attention_modules(), key=lambda m: int(m.layer_idx))
        for module in modules:
            setattr(module, ABSMAX_ATTRIBUTE, [0.0, 0.0])
        try:
            for ids in sequences:
                self.log_probs(ids)
            return [(float(m.kvops_kv_absmax[0]), float(m.kvops_kv_absmax[1])) for m in modules]
        finally:
            for module in modules:
                delattr(module, ABSMAX_ATTRIBUTE)

    def attention_inputs(self, sequences: Sequence[Any]) -> list[list[AttentionInputs]]:
        """Per layer, what its attention received for each sequence with bf16 KV (one forward
        each): what a scale search needs to score candidates without another forward."""
        self.set_plan(unquantized(self.num_layers))
        modules = sorted(self.attention_modules(), key=lambda m: int(m.layer_idx))
        for module in modules:
            setattr(module, CAPTURE_ATTRIBUTE, [])
        try:
            for ids in sequences:
                self.log_probs(ids)
            return [list(getattr(m, CAPTURE_ATTRIBUTE)) for m in modules]
        finally:
            for module in modules:
                delattr(module, CAPTURE_ATTRIBUTE)

    def greedy(self, ids: Any, new_tokens: int) -> list[int]:
        """Greedy continuation with the KV cache (each step's attention re-reads the cached K/V
        through the round trip, which is what a served request's decode sees)."""
        import torch

        out: list[int] = []
        with torch.inference_mode():
            result = self.model(ids[None], use_cache=True)
            for _ in range(new_tokens):
                token = int(result.logits[0, -1].argmax())
                out.append(token)
                result = self.model(torch.tensor([[token]]), past_key_values=result.past_key_values,
                                    use_cache=True)
        return out


def load_offline_model(model_dir: Path) -> OfflineModel:
    """The model directory as ``vllm serve`` takes it, loaded for the offline emulation."""
    config = read_model_config(model_dir)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a weight-loading bar per load is noise in our output
    _register_attention()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, attn_implementation=ATTENTION_NAME)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BadInputError(f"--model {model_dir}: transformers cannot load it ({first})") from None
    model.eval()
    wrapper = OfflineModel(model, tokenizer, _cache_dtype(config), int(model.config.num_hidden_layers))
    if len(wrapper.attention_modules()) != wrapper.num_layers:
        raise BadInputError(f"--model {model_dir}: kvops emulates fp8 KV for decoder layers whose "
                            "attention has k_proj and layer_idx (Llama-like); this one has other modules")
    wrapper.set_plan(unquantized(wrapper.num_layers))
    return wrapper


def _cache_dtype(config: dict[str, object]) -> Any:
    """What ``--kv-cache-dtype auto`` stores: the checkpoint's dtype (bf16 when it names none)."""
    import torch

    name = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return {"float16": torch.float16, "float32": torch.float32}.get(name, torch.bfloat16)


def unquantized(num_layers: int) -> KvPlan:
    return tuple(LayerQuant() for _ in range(num_layers))


def fp8_plan(scales: Sequence[tuple[float, float]], fmt: str, skip: Sequence[int] = ()) -> KvPlan:
    """Every layer fp8 with its (k_scale, v_scale), but those in ``skip`` kept unquantized
    (``--kv-cache-dtype-skip-layers``)."""
    return tuple(LayerQuant() if i in skip else LayerQuant(fmt, k, v) for i, (k, v) in enumerate(scales))
