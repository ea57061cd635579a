"""Sizes and token counts read as `vllm serve` reads them: every form vLLM's own parser
(vllm/utils/argparse_utils.py human_readable_int) accepts gives the same number here, and what it
refuses is refused; byte sizes also take the 'GiB' vLLM's log lines print."""

from __future__ import annotations

import pytest

from kvops.core.errors import BadInputError
from kvops.core.sizes import parse_bytes, parse_tokens, vllm_int

FORMS = ["8", "32768", "32k", "32K", "1.5k", "25.6k", "1.5m", "8g", "8G", "1T", "2t", "0.5g",
         " 4K ", "1.5M", "2.5G", "1.5K", "8GiB", "8 G", "k", "", "-3", "1e3", "abc", "0x10"]


def _vllm_reading(form: str) -> int | None:
    human_readable_int = pytest.importorskip("vllm.utils.argparse_utils").human_readable_int
    try:
        return int(human_readable_int(form))
    except Exception:  # noqa: BLE001 - vLLM refuses with ValueError or ArgumentTypeError
        return None


def _ours(form: str) -> int | None:
    try:
        return vllm_int(form)
    except ValueError:
        return None


@pytest.mark.parametrize("form", FORMS)
def test_same_reading_as_vllm_serve(form):
    assert _ours(form) == _vllm_reading(form)


@pytest.mark.parametrize(("text", "expected"), [
    ("8G", 8 << 30), ("8GiB", 8 << 30), ("8 GiB", 8 << 30), ("3.52GiB", int(3.52 * (1 << 30))),
    ("512MiB", 512 << 20), ("512K", 512 << 10), ("8GB", 8 * 10**9), ("8g", 8 * 10**9),
    ("1073741824", 1 << 30),
])
def test_byte_sizes_as_vllm_and_its_logs_write_them(text, expected):
    assert parse_bytes(text, "--kv-cache-memory-bytes") == expected


@pytest.mark.parametrize(("text", "expected"), [("32k", 32000), ("32K", 32768), ("8192", 8192)])
def test_token_counts(text, expected):
    assert parse_tokens(text, "--max-model-len") == expected


@pytest.mark.parametrize(("text", "words"), [
    ("1.5M", "did you mean 1.5m"), ("lots", "not a number"), ("0", "positive"), ("8GiB", "not a number"),
])
def test_refusals_name_the_flag_and_the_forms(text, words):
    with pytest.raises(BadInputError) as info:
        parse_tokens(text, "--max-model-len")
    assert str(info.value).startswith(f"--max-model-len {text!r}: ")
    assert words in str(info.value)
