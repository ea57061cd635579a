"""The config.json fields the planner reads, typed and bounded before any formula sees them.

config.json is Hugging Face's format, not ours: unknown keys are allowed, but each field the
planner reads must have its JSON type (a list where a list is expected, a mapping where a
mapping is), be a size of at least 1 where zero means nothing fits (``head_dim: 0`` once planned
a cache of zero bytes a token), fit in int64 as vLLM's tensors need, and give whole derived sizes
(``hidden_size / num_attention_heads`` when ``head_dim`` is absent). Each refusal is one line naming
the file and the field path.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from kvops.core.errors import BadInputError

INT64_MAX = 2**63 - 1
Count = Annotated[StrictInt, Field(ge=1, le=INT64_MAX)]
"""A size or count of which zero means nothing at all (heads, layers, head_dim, vocab)."""
Size0 = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]
"""A size that may be 0 (sliding_window 0 is none in vLLM's config/model.py)."""
_REMEDY = "fix config.json or pass the model's own"


class TextFields(BaseModel):
    """A language model's fields (the top level, or a multimodal config's text_config)."""

    model_config = ConfigDict(extra="allow", frozen=True, allow_inf_nan=False)

    model_type: StrictStr | None = None
    architectures: list[StrictStr] | None = None
    torch_dtype: StrictStr | None = None
    dtype: StrictStr | None = None
    num_hidden_layers: Count | None = None
    hidden_size: Count | None = None
    intermediate_size: Size0 | None = None
    num_attention_heads: Count | None = None
    num_key_value_heads: Count | None = None
    num_kv_heads: Count | None = None
    n_head_kv: Count | None = None
    multi_query_group_num: Count | None = None
    num_attention_groups: Count | None = None
    head_dim: Count | None = None
    hidden_size_per_head: Count | None = None
    vocab_size: Count | None = None
    max_position_embeddings: Count | None = None
    sliding_window: Size0 | None = None
    attention_chunk_size: Count | None = None
    kv_lora_rank: Count | None = None
    q_lora_rank: Count | None = None
    qk_rope_head_dim: Count | None = None
    qk_nope_head_dim: Size0 | None = None
    v_head_dim: Count | None = None
    moe_intermediate_size: Size0 | None = None
    num_experts_per_tok: Count | None = None
    tie_word_embeddings: StrictBool | None = None
    layer_types: list[StrictStr] | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    quantization_config: dict[str, Any] | None = None


class ConfigFields(TextFields):
    """The whole config.json: a multimodal one nests its language model under text_config."""

    text_config: TextFields | None = None
    vision_config: dict[str, Any] | None = None


def check_config(raw: Mapping[str, Any], label: str | Path) -> None:
    """Refuse, naming the field path, what the planner cannot size from."""
    try:
        _check_numbers(raw, label, ())
    except RecursionError:
        raise BadInputError(f"{label}: nested too deeply to be a model config; {_REMEDY}") from None
    try:
        fields = ConfigFields.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(part) for part in err["loc"])
        got = err.get("input")
        raise BadInputError(f"{label}: config field {where!r}: {err['msg']}, got {got!r:.60}; {_REMEDY}") from None
    text = fields.text_config or fields
    _check_head_size(text, label, "text_config." if fields.text_config else "")


def _check_head_size(cfg: TextFields, label: str | Path, prefix: str) -> None:
    """vLLM's get_head_size falls back to hidden_size // num_attention_heads: it must be whole."""
    if cfg.head_dim or cfg.hidden_size_per_head or cfg.kv_lora_rank:
        return
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    if hidden is not None and heads is not None and hidden % heads:
        raise BadInputError(f"{label}: config fields '{prefix}hidden_size' {hidden} / '{prefix}num_attention_heads' "
                            f"{heads} is not a whole head size and there is no 'head_dim'; {_REMEDY}")


def _check_numbers(value: object, label: str | Path, path: tuple[str, ...]) -> None:
    """No integer past int64 anywhere: no tensor holds one. (Infinity is left alone: Nemotron-H's
    published time_step_limit is [0.0, Infinity].)"""
    if isinstance(value, Mapping):
        for key, item in value.items():
            _check_numbers(item, label, (*path, str(key)))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_numbers(item, label, (*path, str(index)))
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
        raise BadInputError(f"{label}: config field {'.'.join(path)!r}: an integer of {value.bit_length()} bits "
                            f"does not fit in int64; {_REMEDY}")
