"""The HTML report page from its jinja2 template: every section of a result, values escaped."""

from __future__ import annotations

from html.parser import HTMLParser
from typing import Any

from kvops.loadtest.report import render_html

RESULT: dict[str, Any] = {
    "scenario": "kv-exhaustion", "host": "http://h:8000", "model": "tiny<script>alert(1)</script>",
    "duration_s": 12.5, "schema": "kvops.loadtest/1",
    "verdicts": [{"problem": "kv-exhaustion", "cause": "preemption", "next": "lower max_num_seqs & retry",
                  "evidence": {"preemptions": 7, "kv_usage_max": 0.987654, "rows": [1, 2]}}],
    "client": {"requests": 10, "ttft_p50_s": 0.123456},
    "prefix": {"hit_ratio": 0.5},
    "ttft": {"summary": {"ttft_p50_s": 0.2},
             "comparison": {"ttft_p50": {"baseline": 0.1, "candidate": 0.2, "change": 1.0}}},
}


class _Text(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        self.tags.append(tag)

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _parse(page: str) -> _Text:
    parser = _Text()
    parser.feed(page)
    return parser


def test_values_are_text_not_markup():
    page = render_html(RESULT, "AAAA")
    parsed = _parse(page)
    assert "script" not in parsed.tags
    assert "model tiny<script>alert(1)</script>," in "".join(parsed.text)
    assert "lower max_num_seqs & retry" in parsed.text


def test_every_section_and_table_of_the_result_is_shown():
    parsed = _parse(render_html(RESULT, "AAAA"))
    text = parsed.text
    for heading in ("Verdicts", "Timeline", "Client", "Prefix cache", "TTFT"):
        assert heading in text
    assert "Steps" not in text  # no steps in this result
    assert parsed.tags.count("table") == 5  # evidence, client, prefix, ttft summary, comparison
    assert "0.9877" in text  # floats to four significant digits
    assert "0.1235" in text
    assert "rows" not in text  # lists stay out of the field/value tables
    assert "data:image/png;base64,AAAA" in render_html(RESULT, "AAAA")
