"""``kvops fp8 check``: is fp8 KV safe for THIS model on THESE prompts?

The A/B runs offline (kvops.ops.fp8.offline: a transformers forward with vLLM's fp8 round trip
on the cached K/V; fp8 servers do not run on every CPU and the figures must not depend on the
machine): bf16 KV as the reference, fp8 at scale 1.0 (what vLLM runs a bf16 checkpoint with),
fp8 with calibrated scales, and, when those miss the threshold, calibrated fp8 with the advised
``--kv-cache-dtype-skip-layers``. The verdict holds the threshold against the perplexity ratio
to bf16 KV on the text AND exp(mean KL), the same ratio against bf16's own predictions
(sensitivity.Figures.worst_ratio).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvops.core.errors import BadInputError
from kvops.core.files import read_text
from kvops.core.fp8.scales import (
    ScaleMethod,
    ScalesFile,
    fingerprint_of_config,
    read_model_config,
    scale_from_absmax,
    scales_mismatch,
)
from kvops.ops.fp8.calibrate import _layer_order
from kvops.ops.fp8.offline import OfflineModel, fp8_plan, load_offline_model
from kvops.ops.fp8.sensitivity import (
    DEFAULT_THRESHOLD,
    Figures,
    Reference,
    advise_skip_layers,
    layer_costs,
    measure,
    reference,
    reference_greedy,
    skip_flag,
    skip_limit,
    with_greedy,
)

SAFE, SAFE_WITH_SKIP, NOT_SAFE = "safe", "safe with skip layers", "not safe"


@dataclass(frozen=True)
class CheckRequest:
    model_dir: Path
    prompts: tuple[str, ...]
    scales: ScalesFile | None = None
    threshold: float = DEFAULT_THRESHOLD
    max_tokens: int = 256
    greedy_tokens: int = 0
    dtype: str = "fp8_e4m3"
    compare: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = ()
    """More (name, per-layer scales) variants to measure beside scale 1.0 and calibrated (the
    bench's absmax scales); the verdict does not read them."""


@dataclass(frozen=True)
class CheckResult:
    verdict: str
    threshold: float
    sequences: int
    tokens: int
    bf16_perplexity: float
    variants: dict[str, Figures]
    skip_layers: tuple[int, ...]
    scales_source: str
    layers: int = 0
    """The model's attention layers: the skip-layer advice spares at most skip_limit(layers)."""

    @property
    def safe(self) -> bool:
        return self.verdict != NOT_SAFE

    @property
    def skip_capped(self) -> bool:
        """Not safe with as many layers spared as the advice allows (spare more and fp8 saves little)."""
        return self.verdict == NOT_SAFE and self.layers > 0 and len(self.skip_layers) >= skip_limit(self.layers)

    def as_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "threshold": self.threshold, "sequences": self.sequences,
                "tokens": self.tokens, "bf16_perplexity": round(self.bf16_perplexity, 6),
                "skip_layers": list(self.skip_layers), "scales_source": self.scales_source,
                "skip_layers_limit": skip_limit(self.layers) if self.layers else None,
                "skip_layers_capped": self.skip_capped,
                "variants": {name: f.as_json() for name, f in self.variants.items()}}


def load_check_prompts(path: Path) -> tuple[str, ...]:
    """One prompt per line: plain text, or OpenAI request bodies (JSON objects with "prompt",
    or "messages" that the model's chat template renders); a file is JSON lines when its
    first non-empty line is a JSON object."""
    if not path.is_file():
        raise BadInputError(f"--prompts {path}: no such file")
    lines = [(n, ln) for n, ln in enumerate(read_text(path, f"--prompts {path}").splitlines(), 1) if ln.strip()]
    if not lines:
        raise BadInputError(f"--prompts {path}: no prompts (one per line)")
    if not lines[0][1].lstrip().startswith("{"):
        return tuple(ln for _, ln in lines)
    return tuple(_prompt_of_body(path, n, ln) for n, ln in lines)


def _prompt_of_body(path: Path, number: int, line: str) -> str:
    try:
        body = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        body = None
    if isinstance(body, dict) and isinstance(body.get("prompt"), str):
        return str(body["prompt"])
    messages = body.get("messages") if isinstance(body, dict) else None
    if isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
        return json.dumps(messages)  # rendered with the model's chat template in _texts
    raise BadInputError(f'--prompts {path}:{number}: expected {{"prompt": "..."}} or '
                        '{"messages": [{"role": ..., "content": "..."}]} (one request body per line)')


def _texts(model: OfflineModel, prompts: tuple[str, ...]) -> list[str]:
    """Chat requests rendered as vLLM's chat endpoint renders them (the model's template)."""
    out = []
    for prompt in prompts:
        if prompt.startswith("[{"):
            out.append(str(model.tokenizer.apply_chat_template(json.loads(prompt), tokenize=False,
                                                               add_generation_prompt=True)))
        else:
            out.append(prompt)
    return out


def layer_scales(scales: ScalesFile) -> list[tuple[float, float]]:
    """(k_scale, v_scale) in layer order, from a scales file's vLLM layer names."""
    ordered = sorted(scales.layers.items(), key=lambda kv: _layer_order(kv[0]))
    return [(s.k_scale, s.v_scale) for _, s in ordered]


def absmax_scales(model: OfflineModel, sequences: list[Any], dtype: str) -> list[tuple[float, float]]:
    """Scales from the absmax these sequences put in each layer's cache (scale_from_absmax)."""
    return [(scale_from_absmax(k, dtype), scale_from_absmax(v, dtype)) for k, v in model.absmax(sequences)]


def searched_scales(model: OfflineModel, sequences: list[Any], dtype: str) -> tuple[list[tuple[float, float]], ScaleMethod]:
    """kvops calibrate's offline rule on these sequences: the per-layer output-error search,
    guarded against scale 1.0 (kvops.ops.fp8.scale_search), and which of the two it kept."""
    from kvops.ops.fp8.scale_search import choose_by_model_kl, search_scales

    found = search_scales(model, sequences, dtype)
    return choose_by_model_kl(model, sequences, [(f.k.scale, f.v.scale) for f in found], dtype)


def offline_scales(model: OfflineModel, sequences: list[Any], dtype: str) -> list[tuple[float, float]]:
    """The scales searched_scales chooses."""
    return searched_scales(model, sequences, dtype)[0]


def run_check(req: CheckRequest, say: Callable[[str], None] = lambda _line: None) -> CheckResult:
    """The four-way A/B and its verdict."""
    _check_scales(req)
    model = load_offline_model(req.model_dir)
    sequences = model.encode(_texts(model, req.prompts), req.max_tokens)
    if not sequences:
        raise BadInputError("--prompts: every prompt is under 2 tokens: nothing to score")
    if req.scales is not None:
        scales, source = layer_scales(req.scales), f"the scales file ({req.scales.scale_method})"
    else:
        say("no --scales: calibrating on these prompts (held-out prompts give the fairer figure)")
        scales, method = searched_scales(model, sequences, req.dtype)
        source = f"these prompts (no --scales; {method})"
    ref = reference(model, sequences)
    ref_greedy = reference_greedy(model, ref, req.greedy_tokens) if req.greedy_tokens else []

    def figures(plan: Any) -> Figures:
        found = measure(model, ref, plan)
        return with_greedy(model, ref, plan, found, req.greedy_tokens, ref_greedy) if ref_greedy else found

    variants = {"fp8 scale 1.0": figures(fp8_plan([(1.0, 1.0)] * len(scales), req.dtype)),
                "fp8 calibrated": figures(fp8_plan(scales, req.dtype))}
    for name, other in req.compare:
        variants[name] = figures(fp8_plan(other, req.dtype))
    skip: tuple[int, ...] = ()
    if variants["fp8 calibrated"].worst_ratio > req.threshold:
        skip = _advised_skip(req, model, ref, scales, say)
        if skip:
            variants[f"fp8 calibrated, bf16 layers {' '.join(map(str, skip))}"] = figures(
                fp8_plan(scales, req.dtype, skip))
    return CheckResult(_verdict(variants, req.threshold, skip), req.threshold, len(sequences), ref.tokens,
                       ref.perplexity, variants, skip, source, len(scales))


def _check_scales(req: CheckRequest) -> None:
    if req.scales is None:
        return
    why = scales_mismatch(req.scales, fingerprint_of_config(read_model_config(req.model_dir)))
    if why:
        raise BadInputError(f"--scales: not this model's: {why}; run `kvops calibrate --model {req.model_dir}`")


def _advised_skip(req: CheckRequest, model: OfflineModel, ref: Reference,
                  scales: list[tuple[float, float]], say: Callable[[str], None]) -> tuple[int, ...]:
    """The scales file's advice when it has one, else a per-layer sweep on these prompts."""
    if req.scales is not None and req.scales.accuracy is not None:
        return tuple(req.scales.accuracy.skip_layers)
    say(f"measuring each of {len(scales)} layers' fp8 cost on these prompts")
    costs = layer_costs(model, ref, scales, req.dtype)
    return advise_skip_layers(model, ref, scales, req.dtype, costs, req.threshold).skip_layers


def _verdict(variants: dict[str, Figures], threshold: float, skip: tuple[int, ...]) -> str:
    if variants["fp8 calibrated"].worst_ratio <= threshold:
        return SAFE
    if skip and list(variants.values())[-1].worst_ratio <= threshold:
        return f"{SAFE_WITH_SKIP} {' '.join(map(str, skip))}"
    return NOT_SAFE


def render(result: CheckResult) -> list[str]:
    """The table and the verdict, one line each."""
    lines = [f"bf16 KV: perplexity {result.bf16_perplexity:.3f} over {result.tokens} tokens "
             f"of {result.sequences} prompts (scales from {result.scales_source})"]
    for name, f in result.variants.items():
        greedy = (f", greedy equal {f.greedy_equal}/{f.greedy_total} (median first divergence "
                  f"{f.greedy_median_first_divergence:g})" if f.greedy_total else "")
        lines.append(f"{name}: perplexity ratio {f.perplexity_ratio:.4f}, mean KL {f.mean_kl:.5f} "
                     f"(exp {f.kl_ratio:.4f}), "
                     f"top-1 agreement {f.top1_agreement:.3f}{greedy}")
    lines.append(f"{result.verdict} (threshold: perplexity ratio and exp(mean KL) <= {result.threshold:g})")
    if result.verdict.startswith(SAFE_WITH_SKIP):
        lines.append(f"serve with: --kv-cache-dtype fp8 {skip_flag(result.skip_layers)}")
    elif result.skip_capped:
        lines.append(f"not safe even with {len(result.skip_layers)} of {result.layers} layers' KV in bf16, the most the "
                     "advice spares (a quarter: beyond that fp8 saves little); serve this model with bf16 KV, or "
                     "raise --threshold if its figures above are acceptable for your use")
    return lines


def capacity_line(model_dir: Path, skip: tuple[int, ...]) -> list[str]:
    """What the advised skip layers cost in KV capacity, sized as vLLM's allocator sizes a cache
    whose skipped layers keep bf16 pages (kvops.ops.capacity.skip_layers), per GiB on CUDA."""
    if not skip:
        return []
    from kvops.core.errors import KvopsError
    from kvops.ops.capacity.allocator import SizingFlags
    from kvops.ops.capacity.skip_layers import skip_layer_cost

    config = read_model_config(model_dir)
    length = int(str(config.get("max_position_embeddings") or 2048))
    try:
        cost = skip_layer_cost(config, "fp8", tuple(map(str, skip)), 1 << 30,
                               SizingFlags(max_model_len=min(length, 2048)))
    except KvopsError:
        return []
    if cost.tokens_ratio is None:
        return []
    return [f"capacity: fp8 KV with {len(skip)} layer(s) in bf16 holds {cost.tokens_with:,} tokens per GiB "
            f"where all-fp8 holds {cost.tokens_without:,} ({cost.tokens_ratio - 1:+.1%}; "
            f"{cost.kv_bytes_per_token_with:,} vs {cost.kv_bytes_per_token_without:,} bytes per token)"]
