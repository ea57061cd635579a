"""What a person watching `kvops loadtest` reads: a progress line every few seconds on stderr,
and a summary at the end."""

from __future__ import annotations

from kvops.core.prom import MetricsSample
from kvops.loadtest.hooks.progress import PREFIX, progress_line
from kvops.loadtest.records import RequestRecord
from kvops.loadtest.summary import render, summary


def _record(ok: bool, ttft: float | None) -> RequestRecord:
    rec = RequestRecord(request_id="1", kind="completions", sent_at=0.0, worker="local",
                        scenario="kv-exhaustion", phase="measure", group=None, users=1,
                        scheduled_at=None, prompt="p", shared_text=None)
    rec.ok, rec.ttft_s = ok, ttft
    if not ok:
        rec.error = "HTTP 500"
    return rec


def test_progress_line_has_users_rate_ttft_kv_preemptions_errors():
    window = [_record(True, 0.1), _record(True, 0.3), _record(False, None)]
    first = MetricsSample(t=0, values={"preemptions": 2.0, "kv_usage": 0.1})
    last = MetricsSample(t=5, values={"preemptions": 5.0, "kv_usage": 0.875})
    line = progress_line(12.3, 4, window, 2.0, first, last)
    assert line.startswith(PREFIX)
    for part in ("t=12s", "users=4", "req/s=1.50", "ttft_p50=0.200s", "ttft_p99=0.298s",
                 "kv_usage=88%", "preemptions=3", "errors=1"):
        assert part in line, line


def test_progress_line_before_any_sample_or_answer():
    line = progress_line(0.0, 0, [], 5.0, None, None)
    for part in ("ttft_p50=- ", "kv_usage=? ", "preemptions=? "):
        assert part in line, line


def test_summary_puts_verdicts_first_and_exit_code_last_and_renders_them():
    result = {"scenario": "prefix-miss", "model": "m", "duration_s": 30.0,
              "client": {"requests": 10, "ok": 9, "errors": 1, "ttft_p50_s": 0.1,
                         "ttft_p99_s": 0.4, "e2e_p50_s": 0.5},
              "verdicts": [{"problem": "prefix-miss", "cause": "prefix-drift",
                            "evidence": {"first_differing_token": 12}, "next": "runbooks/prefix-miss.md"}],
              "files": {"json": "o/result.json", "html": "o/report.html", "png": "o/main.png"},
              "exit_code": 3}
    brief = summary(result)
    assert list(brief)[:2] == ["scenario", "verdicts"]
    assert list(brief)[-1] == "exit_code"
    text = render(brief)
    assert "prefix-miss on m: 10 requests in 30.0 s, 9 ok, 1 errors" in text
    assert "prefix-miss / prefix-drift\n  first_differing_token: 12\n  next: runbooks/prefix-miss.md" in text
    assert "report: o/report.html" in text
