"""The request-length distribution a plan sizes for: three quantiles, or a file of real lengths.

A plan needs "how long is a request at the preemption-risk quantile" (for ``max_num_seqs``) and
"how long is a typical one" (admission and mean-load figures). Quantiles given on the command
line answer both for p50/p95/p99 only; a file of real request lengths answers any quantile.

File format (CSV, ``#`` comments and blank lines ignored): one request length per line, or a
header naming the columns: ``tokens`` (prompt + output), or ``prompt_tokens,output_tokens``, and
optionally ``count`` (a histogram: that many requests of that length).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from kvops.core.errors import BadInputError
from kvops.core.files import read_text
from kvops.core.kinds import recognise, recognise_text
from kvops.core.stats import nearest_rank

NAMED_QUANTILES = {"p50": 0.50, "p90": 0.90, "p95": 0.95, "p99": 0.99}
_TOKENS = ("tokens", "total_tokens", "length")
_PROMPT = ("prompt_tokens", "prompt")
_OUTPUT = ("output_tokens", "output", "completion_tokens")


@dataclass(frozen=True)
class Workload:
    """Request lengths (prompt + output tokens); ``histogram`` holds (length, count) when known."""

    max_model_len: int
    p50: int
    p95: int
    p99: int
    histogram: tuple[tuple[int, int], ...] = ()
    source: str = "quantiles"

    @property
    def requests(self) -> int:
        return sum(count for _, count in self.histogram)

    def length_at(self, risk: str) -> int:
        """Length at the named (p95) or numeric (0.95) quantile, nearest-rank."""
        q = parse_quantile(risk)
        if not self.histogram:
            for name, value in NAMED_QUANTILES.items():
                if value == q and hasattr(self, name):
                    return int(getattr(self, name))
            raise BadInputError(f"--risk-quantile {risk}: with --p50/--p95/--p99 use p50, p95 or p99; "
                                "give --lengths-file for any other quantile")
        return nearest_rank(self.histogram, q)

    def mean(self) -> float:
        if not self.histogram:
            return float(self.p50)
        return sum(length * count for length, count in self.histogram) / self.requests


def parse_quantile(risk: str) -> float:
    if risk in NAMED_QUANTILES:
        return NAMED_QUANTILES[risk]
    try:
        q = float(risk)
    except ValueError:
        raise BadInputError(f"--risk-quantile {risk!r}: use p50/p95/p99 or a number in (0, 1]") from None
    if not 0 < q <= 1:
        raise BadInputError(f"--risk-quantile {risk}: must be in (0, 1]")
    return q


def from_quantiles(max_model_len: int, p50: int | None, p95: int | None, p99: int | None) -> Workload:
    """A missing quantile takes the next higher one given; p99 defaults to max_model_len (the
    worst case vLLM itself sizes for)."""
    q99 = p99 if p99 is not None else max_model_len
    q95 = p95 if p95 is not None else q99
    q50 = p50 if p50 is not None else q95
    for name, value in (("--p50", q50), ("--p95", q95), ("--p99", q99)):
        if value < 1 or value > max_model_len:
            raise BadInputError(f"{name} {value} must be in [1, --max-model-len {max_model_len}]")
    if not q50 <= q95 <= q99:
        raise BadInputError("quantiles must satisfy --p50 <= --p95 <= --p99")
    return Workload(max_model_len, q50, q95, q99)


def from_file(path: Path, max_model_len: int) -> Workload:
    """Read real request lengths; any malformed line exits 2 naming the file and line."""
    counts: dict[int, int] = {}
    for lineno, length, count in _rows(path):
        if length < 1 or count < 1:
            raise BadInputError(f"{path}:{lineno}: lengths and counts must be >= 1")
        counts[length] = counts.get(length, 0) + count
    if not counts:
        raise BadInputError(f"{path}: no request lengths found")
    histogram = tuple(sorted(counts.items()))
    too_long = sum(c for length, c in histogram if length > max_model_len)
    if too_long:
        raise BadInputError(f"{path}: {too_long} requests are longer than --max-model-len {max_model_len}; "
                            "raise --max-model-len or drop them (vLLM would reject them)")
    p50, p95, p99 = (nearest_rank(histogram, q) for q in (0.50, 0.95, 0.99))
    return Workload(max_model_len, p50, p95, p99, histogram, f"file {path.name} ({sum(counts.values())} requests)")


def _rows(path: Path) -> list[tuple[int, int, int]]:
    """(line number, prompt+output tokens, count) per data line."""
    text = read_text(path, f"--lengths-file {path}")
    _refuse_other_kind(path, text)
    lines = text.splitlines()
    try:
        return _parse_rows(path, lines)
    except csv.Error as exc:  # e.g. a field over csv's size limit
        raise BadInputError(f"--lengths-file {path}: not a CSV of lengths ({exc})") from None


def _refuse_other_kind(path: Path, text: str) -> None:
    """A plan, config or trace is no lengths file: say which it is (its first line would be
    printed whole as a header with no 'tokens' column)."""
    kind = recognise_text(text)
    if kind is None and text.lstrip().startswith("{"):
        try:
            kind = recognise(json.loads(text))
        except (ValueError, RecursionError):
            kind = None
    if kind is not None:
        raise BadInputError(f"--lengths-file {path}: this is {kind}, not a lengths file (one request's tokens "
                            "a line, or a CSV with a tokens or prompt_tokens,output_tokens header)")


def _parse_rows(path: Path, lines: list[str]) -> list[tuple[int, int, int]]:
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")]
    if not numbered:
        return []
    first = next(csv.reader([numbered[0][1]]))
    header = [cell.strip().lower() for cell in first] if not first[0].strip().isdigit() else None
    columns = _columns(path, header) if header else None
    out = []
    for lineno, line in numbered[1:] if header else numbered:
        cells = [c.strip() for c in next(csv.reader([line]))]
        try:
            values = [int(c) for c in cells]
        except ValueError:
            raise BadInputError(f"{path}:{lineno}: {line.strip()[:80]!r} is not integers") from None
        if columns is None:
            if len(values) != 1:
                raise BadInputError(f"{path}:{lineno}: several columns need a header line "
                                    "(tokens[,count] or prompt_tokens,output_tokens[,count])")
            out.append((lineno, values[0], 1))
            continue
        if len(values) != len(header or ()):
            raise BadInputError(f"{path}:{lineno}: expected {len(header or ())} columns, got {len(values)}")
        tokens = sum(values[i] for i in columns[0])
        out.append((lineno, tokens, values[columns[1]] if columns[1] is not None else 1))
    return out


def _columns(path: Path, header: list[str]) -> tuple[list[int], int | None]:
    """Indices of the length column(s) and of the count column."""
    def find(names: tuple[str, ...]) -> int | None:
        return next((i for i, h in enumerate(header) if h in names), None)

    count = find(("count",))
    tokens = find(_TOKENS)
    prompt, output = find(_PROMPT), find(_OUTPUT)
    if tokens is not None:
        return [tokens], count
    if prompt is not None and output is not None:
        return [prompt, output], count
    raise BadInputError(f"{path}: header {','.join(header)[:80]!r} needs a 'tokens' column or "
                        "'prompt_tokens' and 'output_tokens' (optionally 'count')")
