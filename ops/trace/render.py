"""The readable ``kvops trace stats`` summary and its hit-ratio-versus-cache-size PNG."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvops.core.errors import BadInputError
from kvops.core.trace.summary import Lengths, LruPoint, TraceStats

BAR_WIDTH = 40


def _lengths(name: str, value: Lengths) -> str:
    return (f"{name:<14} mean {value.mean:9.1f}  p50 {value.p50:9.1f}  p90 {value.p90:9.1f}  "
            f"p99 {value.p99:9.1f}  max {value.max:9d}")


def summary_text(stats: TraceStats) -> str:
    rate = f"{stats.arrival_rate_rps:.3f} req/s" if stats.arrival_rate_rps is not None else "n/a"
    lines = [
        f"trace          {stats.path} ({stats.format})",
        f"requests       {stats.requests} over {stats.duration_s:.1f} s, {rate}",
        _lengths("input tokens", stats.input_tokens),
        _lengths("output tokens", stats.output_tokens),
    ]
    if not stats.has_block_ids:
        lines.append("prefix reuse   none: this format carries no prompt block ids")
        return "\n".join(lines)
    lines += [
        f"prefix reuse   {stats.prefix_reuse_ratio:.1%} of input tokens with an unbounded cache "
        f"(reached at {stats.saturation_blocks} blocks of {stats.block_tokens} tokens)",
        "LRU hit ratio by cache size:",
        *curve_lines(stats.lru, stats.block_tokens),
    ]
    return "\n".join(lines)


def curve_lines(points: Sequence[LruPoint], block_tokens: int) -> list[str]:
    out = []
    for p in points:
        bar = "#" * round(p.hit_ratio * BAR_WIDTH)
        tokens = p.cache_blocks * block_tokens
        out.append(f"  {p.cache_blocks:>9} blocks ({tokens:>12,} tokens)  {p.hit_ratio:6.1%}  {bar}")
    return out


def write_plot(stats: TraceStats, path: Path) -> None:
    """Hit ratio against cache size (log x), the unbounded reuse as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [p.cache_blocks for p in stats.lru]
    ax.plot(xs, [p.hit_ratio for p in stats.lru], marker="o", label="LRU hit ratio")
    ax.axhline(stats.prefix_reuse_ratio, linestyle="--", color="grey", label="unbounded cache")
    if xs and min(xs) > 0:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(f"cache size (blocks of {stats.block_tokens} tokens)")
    ax.set_ylabel("prefix hit ratio (tokens)")
    ax.set_ylim(0, 1)
    ax.set_title(f"{Path(stats.path).name}: {stats.requests} requests")
    ax.legend(loc="upper left")
    fig.tight_layout()
    try:
        fig.savefig(path, format="png")
    except OSError as exc:
        raise BadInputError(f"cannot write the plot {path}: {exc.strerror}") from exc
    finally:
        plt.close(fig)
