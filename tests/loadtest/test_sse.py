"""SSE lines as vLLM writes them: the role-only chat chunk is not a token, usage is read."""

from __future__ import annotations

import json

from kvops.loadtest.sse import parse_line, usage_counts


def _line(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n"


def test_role_chunk_is_not_a_token():
    role = parse_line(_line({"choices": [{"delta": {"role": "assistant", "content": ""}}]}))
    assert role is not None
    assert role.has_choices
    assert not role.has_output
    reasoning = parse_line(_line({"choices": [{"delta": {"reasoning_content": "hm"}}]}))
    assert reasoning is not None
    assert reasoning.has_output


def test_raw_utf8_and_usage():
    event = parse_line(_line({"choices": [{"text": "日本"}]}))
    assert event is not None
    assert event.has_output
    usage = parse_line(_line({"choices": [], "usage": {
        "prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}}))
    assert usage is not None
    assert usage.usage is not None
    assert usage_counts(usage.usage) == (7, 3, 0)


def test_done_comments_and_errors():
    done = parse_line(b"data: [DONE]\n")
    assert done is not None
    assert done.done
    assert parse_line(b": ping\n") is None
    assert parse_line(b"\n") is None
    err = parse_line(_line({"error": {"message": "boom"}}))
    assert err is not None
    assert err.error == "boom"
