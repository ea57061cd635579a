"""Server-sent events of OpenAI-compatible streams, parsed line by line from bytes.

Lines are split on ``\\n`` *before* decoding: vLLM writes non-ASCII text raw, so a UTF-8
character can straddle two socket reads (research/loadgen_bench.md, trap 3). An event counts as
a token only if it carries content, reasoning or a tool call: a chat stream's first event may be
the role alone, and timing TTFT there under-reports it (vllm#3759).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StreamEvent:
    """One ``data:`` event: whether it carried output, and the usage block if it had one."""

    has_choices: bool
    has_output: bool
    usage: dict[str, Any] | None
    error: str | None = None
    done: bool = False


def parse_line(raw: bytes) -> StreamEvent | None:
    """Parse one raw SSE line; None for blank lines, comments and non-data fields."""
    line = raw.rstrip(b"\r\n")
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return StreamEvent(False, False, None, done=True)
    try:
        data = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return StreamEvent(False, False, None, error=f"unparsable event: {exc}")
    if not isinstance(data, dict):
        return StreamEvent(False, False, None, error="event is not an object")
    if "error" in data:
        err = data["error"]
        message = err.get("message") if isinstance(err, dict) else str(err)
        return StreamEvent(False, False, None, error=str(message))
    choices = data.get("choices") or []
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else None
    return StreamEvent(bool(choices), any(_carries_output(c) for c in choices), usage)


def _carries_output(choice: dict[str, Any]) -> bool:
    if choice.get("text"):
        return True
    delta = choice.get("delta") or {}
    return bool(
        delta.get("content")
        or delta.get("reasoning_content")
        or delta.get("reasoning")
        or delta.get("tool_calls")
    )


def usage_counts(usage: dict[str, Any]) -> tuple[int | None, int | None, int | None]:
    """(prompt_tokens, completion_tokens, cached_tokens) of a usage block.

    ``prompt_tokens_details.cached_tokens`` is only sent by vLLM with
    ``--enable-prompt-tokens-details``; it is block-granular.
    """
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return usage.get("prompt_tokens"), usage.get("completion_tokens"), cached
