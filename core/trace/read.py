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
from kvops.core.kinds import TRACE, recognise_text, refuse_other_kind

MOONCAKE_BLOCK_TOKENS = 512
MAX_REQUEST_TOKENS = 2**31 - 1
"""Past any model's context (the longest is ~10M tokens), and small enough that a million
requests' lengths sum inside int64, where the statistics count them (a length of 10**30 once
ended in "OverflowError: Python int too large to convert to C long")."""
INT64_MAX = 2**63 - 1
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
        _refuse_other_kind(path, text)
        requests, fmt, has_ids = _mooncake(path, text), "mooncake", True
    elif start:
        _refuse_yaml_kind(path, text)
        requests, fmt, has_ids = _burstgpt(path, text), "burstgpt", False
    else:
        raise BadInputError(f"trace {path} is empty: give a Mooncake JSONL or BurstGPT CSV file")
    if not requests:
        raise BadInputError(f"trace {path} has no requests")
    ordered = tuple(sorted(requests, key=lambda r: r.timestamp_s))
    return Trace(path=path, format=fmt, requests=ordered, has_hash_ids=has_ids)


def _refuse_other_kind(path: Path, text: str) -> None:
    """A plan, config or calibration is one JSON document, not a trace: say which it is. A real
    JSONL trace stops the whole-text parse at its second line ("Extra data")."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return
    refuse_other_kind(doc, f"trace {path}", TRACE)


def _refuse_yaml_kind(path: Path, text: str) -> None:
    """kvops.yaml, alerts.yaml or a scenario is no CSV: name it rather than its missing columns."""
    kind = recognise_text(text)
    if kind is not None and kind != TRACE:
        raise BadInputError(f"trace {path}: this is {kind}, not {TRACE}")


def _bad(path: Path, line: int, what: str) -> BadInputError:
    return BadInputError(f"trace {path}, line {line}: {what}")


def _finite(value: float) -> bool:
    """math.isfinite, False for an integer too large for a float (it raises OverflowError)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _count(path: Path, line: int, row: dict[str, Any], key: str) -> int:
    value = row.get(key)
    if (isinstance(value, bool) or not isinstance(value, int | float) or not _finite(value)
            or value < 0 or value != int(value)):
        raise _bad(path, line, f"{key!r} must be a whole number >= 0, got {value!r:.40}")
    if value > MAX_REQUEST_TOKENS:
        raise _bad(path, line, f"{key!r} is beyond any model's context "
                               f"(at most {MAX_REQUEST_TOKENS:,}): give the right trace")
    return int(value)


def _mooncake(path: Path, text: str) -> list[TraceRequest]:
    lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    try:  # one parse for the whole file is 3x faster than one per line
        rows = json.loads("[" + ",".join(line for _, line in lines) + "]")
    except (ValueError, RecursionError):  # JSONDecodeError, or an integer of over 4,300 digits
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
    except ValueError as exc:  # an integer past sys.get_int_max_str_digits()
        raise _bad(path, number, f"not JSON ({str(exc).split(';')[0]})") from None


def _mooncake_row(path: Path, number: int, row: Any) -> TraceRequest:
    if not isinstance(row, dict):
        raise _bad(path, number, "expected a JSON object with timestamp, input_length, "
                                 "output_length, hash_ids")
    stamp = row.get("timestamp")
    if isinstance(stamp, bool) or not isinstance(stamp, int | float) or not _finite(stamp):
        raise _bad(path, number, f"'timestamp' (ms) must be a finite number, got {stamp!r:.40}")
    ids = row.get("hash_ids")
    if not isinstance(ids, list) or not all(type(i) is int and abs(i) <= INT64_MAX for i in ids):
        raise _bad(path, number, "'hash_ids' must be a list of integers that fit in int64")
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
        if any(not math.isfinite(t) or t < 0 or t != int(t) or t > MAX_REQUEST_TOKENS for t in tokens):
            raise _bad(path, number, "Request tokens and Response tokens must be whole numbers from 0 "
                                     f"to {MAX_REQUEST_TOKENS:,}")
        out.append(TraceRequest(stamp, int(tokens[0]), int(tokens[1])))
    return out
