"""Self-contained HTML report (plots inlined as base64 PNG) and a PNG of the main plot.

The main plot overlays what the client saw (TTFT and ITL per request, at send time) on what the
server said at the same moment (KV usage, running/waiting, preemptions), which is the picture
an on-call engineer needs to see a knee or a queue build up.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from kvops.loadtest.metrics import MetricsSample
from kvops.loadtest.records import RequestRecord


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


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    keys = list(rows[0])
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(r.get(k))}</td>" for k in keys) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def _kv(mapping: dict[str, Any]) -> str:
    return _table([{"field": k, "value": v} for k, v in mapping.items() if not isinstance(v, (list, dict))])


def write_html(result: dict[str, Any], records: list[RequestRecord], samples: list[MetricsSample],
               html_path: Path, png_path: Path) -> None:
    png = main_plot_png(result, records, samples)
    png_path.write_bytes(png)
    image = base64.b64encode(png).decode("ascii")
    parts = [f"<h1>kvops loadtest: {html.escape(result['scenario'])}</h1>",
             f"<p>host {html.escape(result['host'])}, model {html.escape(result['model'])}, "
             f"{result['duration_s']} s, schema {html.escape(result['schema'])}</p>", "<h2>Verdicts</h2>"]
    for v in result["verdicts"]:
        parts.append(f"<div class='verdict'><b>{html.escape(v['problem'])} / {html.escape(v['cause'])}"
                     f"</b><p>{html.escape(v['next'])}</p>{_kv(v['evidence'])}</div>")
    parts += ["<h2>Timeline</h2>", f"<img alt='main plot' src='data:image/png;base64,{image}'>",
              "<h2>Client</h2>", _kv(result["client"])]
    if "steps" in result:
        cols = ("users", "requests", "errors", "ttft_p50_s", "ttft_p99_s", "tokens_per_s",
                "waiting_max", "waiting_fraction", "running_max", "kv_usage_max", "preemptions", "classification")
        parts += ["<h2>Steps</h2>", _table([{c: s[c] for c in cols} for s in result["steps"]])]
    if "prefix" in result:
        parts += ["<h2>Prefix cache</h2>", _kv(result["prefix"])]
    if "ttft" in result:
        parts += ["<h2>TTFT</h2>", _kv(result["ttft"]["summary"])]
        comparison = result["ttft"].get("comparison")
        if comparison:
            parts.append(_table([{"metric": k, **v} for k, v in comparison.items()]))
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}"
             ".verdict{border-left:4px solid #c33;padding-left:1em}img{max-width:100%}")
    html_path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>kvops "
                         f"{html.escape(result['scenario'])}</title><style>{style}</style></head>"
                         f"<body>{''.join(parts)}</body></html>\n")
