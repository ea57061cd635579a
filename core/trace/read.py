"""Readers for public request traces, into one shape: arrival time, lengths, prefix block ids.

Mooncake (kvcache-ai/Mooncake ``FAST25-release/traces``): one JSON object a line with
``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``, one id per 512-token
prompt block, chained, so equal leading ids mean an equal prompt prefix. BurstGPT
(HPMLL/BurstGPT): a CSV with ``Timestamp`` (s), ``Request tokens`` and ``Response tokens`` and
no block ids, so it carries lengths and arrivals but no reuse.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvops.core.errors import BadInputError
from kvops.core.files import read_text

MOONCAKE_BLOCK_TOKENS = 512
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")


@dataclass(frozen=True)
class TraceRequest:
    timestamp_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Trace:
    """Requests in arrival order (ties keep file order: the sort is stable)."""

    path: Path
    format: str
    requests: tuple[TraceRequest, ...]
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    has_hash_ids: bool = True


def read_trace(path: Path) -> Trace:
    """Mooncake JSONL or BurstGPT CSV, told apart by the first non-blank character."""
    text = read_text(path, f"trace {path}")
    start = text.lstrip()[:1]
    if start == "{":
        requests, fmt, has_ids = _mooncake(path, text), "mooncake", True
    elif start:
        requests, fmt, has_ids = _burstgpt(path, text), "burstgpt", False
    else:
        raise BadInputError(f"trace {path} is empty: give a Mooncake JSONL or BurstGPT CSV file")
    if not requests:
        raise BadInputError(f"trace {path} has no requests")
    ordered = tuple(sorted(requests, key=lambda r: r.timestamp_s))
    return Trace(path=path, format=fmt, requests=ordered, has_hash_ids=has_ids)


def _bad(path: Path, line: int, what: str) -> BadInputError:
    return BadInputError(f"trace {path}, line {line}: {what}")


def _count(path: Path, line: int, row: dict[str, Any], key: str) -> int:
    value = row.get(key)
    if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            or value < 0 or value != int(value)):
        raise _bad(path, line, f"{key!r} must be a whole number >= 0, got {value!r}")
    return int(value)


def _mooncake(path: Path, text: str) -> list[TraceRequest]:
    lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    try:  # one parse for the whole file is 3x faster than one per line
        rows = json.loads("[" + ",".join(line for _, line in lines) + "]")
    except (json.JSONDecodeError, RecursionError):
        rows = []
    if len(rows) != len(lines):  # a line with two values (`{...}, {...}`) or none: per line
        rows = [_json_line(path, number, line) for number, line in lines]
    return [_mooncake_row(path, number, row) for (number, _), row in zip(lines, rows, strict=True)]


def _json_line(path: Path, number: int, line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":
            raise _bad(path, number, "more than one JSON value on the line: one request "
                                     "object per line") from None
        raise _bad(path, number, f"not JSON ({exc.msg})") from exc
    except RecursionError:
        raise _bad(path, number, "nested too deeply to be a trace line") from None


def _mooncake_row(path: Path, number: int, row: Any) -> TraceRequest:
    if not isinstance(row, dict):
        raise _bad(path, number, "expected a JSON object with timestamp, input_length, "
                                 "output_length, hash_ids")
    stamp = row.get("timestamp")
    if isinstance(stamp, bool) or not isinstance(stamp, int | float) or not math.isfinite(stamp):
        raise _bad(path, number, f"'timestamp' (ms) must be a finite number, got {stamp!r}")
    ids = row.get("hash_ids")
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise _bad(path, number, "'hash_ids' must be a list of integers")
    return TraceRequest(float(stamp) / 1000.0, _count(path, number, row, "input_length"),
                        _count(path, number, row, "output_length"), tuple(ids))


def _burstgpt(path: Path, text: str) -> list[TraceRequest]:
    try:
        return _burstgpt_rows(path, text)
    except csv.Error as exc:  # e.g. a field over csv's size limit: not a CSV trace
        raise BadInputError(f"trace {path}: not a BurstGPT CSV ({exc})") from None


def _burstgpt_rows(path: Path, text: str) -> list[TraceRequest]:
    reader = csv.DictReader(text.splitlines())
    missing = [c for c in BURSTGPT_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise _bad(path, 1, f"not a Mooncake JSONL line and not a BurstGPT CSV header "
                            f"(missing columns {', '.join(missing)})")
    out = []
    for row in reader:
        number = reader.line_num
        try:
            stamp = float(row["Timestamp"])
            tokens = [float(row[c]) for c in BURSTGPT_COLUMNS[1:]]
        except (TypeError, ValueError) as exc:
            raise _bad(path, number, f"Timestamp, Request tokens and Response tokens must be "
                                     f"numbers ({exc})") from exc
        if not math.isfinite(stamp):
            raise _bad(path, number, f"Timestamp must be a finite number, got {stamp}")
        if any(not math.isfinite(t) or t < 0 or t != int(t) for t in tokens):
            raise _bad(path, number, "Request tokens and Response tokens must be whole numbers >= 0")
        out.append(TraceRequest(stamp, int(tokens[0]), int(tokens[1])))
    return out
