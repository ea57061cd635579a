"""Self-contained HTML report (plots inlined as base64 PNG) and a PNG of the main plot.

The main plot overlays what the client saw (TTFT and ITL per request, at send time) on what the
server said at the same moment (KV usage, running/waiting, preemptions), which is the picture
an on-call engineer needs to see a knee or a queue build up.
"""

from __future__ import annotations

import base64
import io
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2

from kvops.core.prom import MetricsSample
from kvops.loadtest.records import RequestRecord

TEMPLATE = "report.html.jinja"  # beside this module, shipped as package data (*.jinja)


def main_plot_png(result: dict[str, Any], records: list[RequestRecord],
                  samples: list[MetricsSample]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = result["started_at"]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    ok = [r for r in records if r.ok and r.ttft_s is not None]
    ax1.scatter([r.sent_at - t0 for r in ok], [1000 * (r.ttft_s or 0) for r in ok], s=8,
                label="TTFT (ms)", color="tab:blue")
    itl = [(r.sent_at - t0, 1000 * sum(r.itl_s) / len(r.itl_s)) for r in ok if r.itl_s]
    ax1.scatter([x for x, _ in itl], [y for _, y in itl], s=8, label="ITL mean (ms)",
                color="tab:orange")
    failed = [r.sent_at - t0 for r in records if not r.ok]
    if failed:
        ax1.scatter(failed, [0] * len(failed), marker="x", color="red", label="failed")
    ax1.set_ylabel("client latency (ms)")
    ax1.legend(loc="upper left", fontsize=8)
    ts = [s.t - t0 for s in samples]
    ax2.plot(ts, [100 * s.get("kv_usage") for s in samples], color="tab:red", label="KV usage %")
    ax2.set_ylabel("KV usage %")
    twin = ax2.twinx()
    twin.plot(ts, [s.get("running") for s in samples], color="tab:green", label="running")
    twin.plot(ts, [s.get("waiting") for s in samples], color="tab:purple", label="waiting")
    twin.set_ylabel("requests")
    lines = ax2.get_lines() + twin.get_lines()
    ax2.legend(lines, [str(x.get_label()) for x in lines], loc="upper left", fontsize=8)
    base = samples[0].get("preemptions") if samples else 0.0
    ax3.step(ts, [s.get("preemptions") - base for s in samples], where="post", color="black")
    ax3.set_ylabel("preemptions (cum.)")
    ax3.set_xlabel("seconds since start")
    for step in result.get("steps", []):
        for ax in (ax1, ax2, ax3):
            ax.axvline(step["start"] - t0, color="grey", linewidth=0.5, linestyle=":")
    verdict = result["verdicts"][0] if result.get("verdicts") else {}
    fig.suptitle(f"{result['scenario']}: {verdict.get('problem')} / {verdict.get('cause')}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


Rows = list[dict[str, Any]]


def _fmt(value: Any) -> str:
    """A table cell: floats to four significant digits (escaping is the template's)."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _kv(mapping: dict[str, Any]) -> Rows:
    """A mapping's scalar fields as (field, value) rows."""
    return [{"field": k, "value": v} for k, v in mapping.items() if not isinstance(v, list | dict)]


def _sections(result: dict[str, Any]) -> list[tuple[str, list[Rows]]]:
    """(heading, tables) after the timeline, in the order the report shows them."""
    sections: list[tuple[str, list[Rows]]] = [("Client", [_kv(result["client"])])]
    if "steps" in result:
        cols = ("users", "requests", "errors", "ttft_p50_s", "ttft_p99_s", "tokens_per_s",
                "waiting_max", "waiting_fraction", "running_max", "kv_usage_max", "preemptions", "classification")
        sections.append(("Steps", [[{c: s[c] for c in cols} for s in result["steps"]]]))
    if "replay" in result:
        sections.append(("Trace replay: measured and predicted prefix hit ratio", [_kv(result["replay"])]))
    if "prefix" in result:
        sections.append(("Prefix cache", [_kv(result["prefix"])]))
    if "ttft" in result:
        comparison = result["ttft"].get("comparison") or {}
        sections.append(("TTFT", [_kv(result["ttft"]["summary"]),
                                  [{"metric": k, **v} for k, v in comparison.items()]]))
    return sections


@cache
def _template() -> jinja2.Template:
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    env.filters["fmt"] = _fmt
    return env.from_string(resources.files("kvops.loadtest").joinpath(TEMPLATE).read_text())


def render_html(result: dict[str, Any], image_b64: str) -> str:
    """The report page for a result, its main plot inlined as base64 PNG."""
    verdicts = [{**v, "evidence": _kv(v["evidence"])} for v in result["verdicts"]]
    return _template().render(result=result, verdicts=verdicts, image=image_b64,
                              sections=_sections(result)) + "\n"


def write_html(result: dict[str, Any], records: list[RequestRecord], samples: list[MetricsSample],
               html_path: Path, png_path: Path) -> None:
    png = main_plot_png(result, records, samples)
    png_path.write_bytes(png)
    html_path.write_text(render_html(result, base64.b64encode(png).decode("ascii")))
