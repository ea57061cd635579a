"""What `kvops loadtest` prints when a run ends: one JSON object (--json) or a few lines a
person reads in a terminal: the verdicts, the client's totals, where the reports are."""

from __future__ import annotations

from typing import Any

from kvops.core.verdict import Verdict, describe


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The --json object: the verdicts, client totals, the report files and the exit code."""
    client = result.get("client", {})
    return {"scenario": result["scenario"], "verdicts": result["verdicts"],
            "model": result.get("model"), "duration_s": result.get("duration_s"),
            "client": {k: client.get(k) for k in ("requests", "ok", "errors", "ttft_p50_s",
                                                  "ttft_p99_s", "e2e_p50_s")},
            "report_json": result["files"]["json"], "report_html": result["files"]["html"],
            "report_png": result["files"]["png"], "exit_code": result["exit_code"]}


def render(brief: dict[str, Any]) -> str:
    c = brief["client"]
    lines = [f"{brief['scenario']} on {brief['model']}: {c['requests']} requests in "
             f"{brief['duration_s']} s, {c['ok']} ok, {c['errors']} errors; TTFT p50 "
             f"{_s(c['ttft_p50_s'])}, p99 {_s(c['ttft_p99_s'])}", ""]
    for verdict in brief["verdicts"]:
        lines += describe(Verdict.from_dict(verdict))
    lines += ["", f"report: {brief['report_html']}", f"result: {brief['report_json']}"]
    return "\n".join(lines)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"
