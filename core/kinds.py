"""What kind of kvops input a file is, so a file handed to the wrong flag is named, not misread.

A model config passed as ``--expect`` once validated as an empty plan (every figure optional) and
"equalled the plan"; a plan passed as ``--model`` was read as a model with missing fields. Each
reader says which kind it expects; ``refuse_other_kind`` recognises the kinds kvops reads or
writes by the keys only that kind carries, and refuses one of another kind in one line:
``--expect X: this is a model config (config.json), not a plan (kvops plan --json)``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import yaml

from kvops.core.errors import BadInputError
from kvops.core.files import parse_json, read_mapping, read_text

MODEL_CONFIG: Final = "a model config (config.json)"
PLAN: Final = "a plan (kvops plan --json)"
KV_CAPACITY: Final = "a capacity result (kvops kv-capacity --json)"
CALIBRATION: Final = "a calibration file (kvops verify --calibration-out)"
SCALES: Final = "an fp8 scales file (kvops calibrate)"
BENCH: Final = "a bench result (kvops bench NAME --json)"
LOADTEST_RESULT: Final = "a load-test result (result.json of kvops loadtest)"
TRACE: Final = "a request trace (Mooncake JSONL or BurstGPT CSV)"
SETTINGS: Final = "kvops settings (kvops.yaml)"
SCENARIO: Final = "a load-test scenario file"
ALERTS: Final = "a Prometheus rule file (alerts.yaml)"

_SETTINGS_KEYS = frozenset({"config", "kv_scales", "offload", "admission"})  # core/settings.py KvopsSettings
_CONFIG_KEYS = ("architectures", "model_type", "num_hidden_layers", "text_config", "hidden_size")


def recognise(doc: object) -> str | None:
    """The kind of a decoded document, from the keys only that kind has; None: not one we know."""
    if not isinstance(doc, Mapping):
        return None
    keys = set(doc)
    if doc.get("format") == "kvops-calibration/1":
        return CALIBRATION
    if {"format_version", "layers", "model"} <= keys and isinstance(doc.get("layers"), Mapping):
        return SCALES
    if str(doc.get("schema", "")).startswith("kvops.loadtest.result") or {"verdicts", "scenario"} <= keys:
        return LOADTEST_RESULT
    if isinstance(doc.get("capacity"), Mapping) and keys & {"serve", "kvops_yaml", "non_kv"}:
        return PLAN
    if {"num_blocks", "kv_cache_size_tokens", "bytes_per_block"} <= keys:
        return KV_CAPACITY
    return _recognise_more(doc, keys)


def _recognise_more(doc: Mapping[object, object], keys: set[object]) -> str | None:
    if isinstance(doc.get("bench"), str):
        return BENCH
    if {"timestamp", "input_length"} <= keys:
        return TRACE  # one Mooncake line read as a whole file
    if isinstance(doc.get("groups"), list):
        return ALERTS
    if any(key in keys for key in _CONFIG_KEYS):
        return MODEL_CONFIG
    if isinstance(doc.get("scenario"), str):
        return SCENARIO
    if keys and keys <= _SETTINGS_KEYS | {"kvops"}:
        return SETTINGS
    return None


def recognise_text(text: str) -> str | None:
    """The kind of a text that is not one JSON document: a JSONL trace, a BurstGPT CSV, or a YAML
    file kvops reads (kvops.yaml, alerts.yaml, a scenario) handed to a JSON or CSV reader."""
    first = text.lstrip().split("\n", 1)[0]
    if "Request tokens" in first and "Timestamp" in first:
        return TRACE
    try:
        return recognise(json.loads(first))
    except (ValueError, RecursionError):
        pass
    try:
        return recognise(yaml.safe_load(text))
    except (yaml.YAMLError, ValueError, RecursionError):
        return None


def refuse_other_kind(doc: object, label: str, expected: str, accepted: tuple[str, ...] = ()) -> None:
    """Raise when ``doc`` is recognisably a kind other than ``expected`` (or ``accepted``)."""
    kind = recognise(doc)
    if kind is not None and kind != expected and kind not in accepted:
        raise _wrong_kind(label, kind, expected)


def _wrong_kind(label: str, kind: str, expected: str) -> BadInputError:
    """The one line: what the file is and what the flag takes (whose command makes it)."""
    return BadInputError(f"{label}: this is {kind}, not {expected}")


def read_json_of_kind(path: Path, label: str, expected: str, accepted: tuple[str, ...] = ()) -> object:
    """The decoded JSON of ``path``, refused in one line when it is not JSON or of another kind.

    A JSONL trace is not one JSON document: its parse error is replaced by its name."""
    text = read_text(path, label)
    try:
        doc = parse_json(text, label)
    except BadInputError:
        kind = recognise_text(text)
        if kind is not None and kind != expected:
            raise _wrong_kind(label, kind, expected) from None
        raise
    refuse_other_kind(doc, label, expected, accepted)
    return doc


def read_mapping_of_kind(path: Path, what: str, expected: str) -> dict[str, Any]:
    """``read_mapping`` (JSON or YAML) that names a file of another kind, a CSV or JSONL trace
    included (neither is a mapping, so their own parse error would not say what they are)."""
    label = f"{what} {path}" if what else str(path)
    try:
        doc = read_mapping(path, what)
    except BadInputError:
        kind = recognise_text(read_text(path, label))
        if kind is not None and kind != expected:
            raise _wrong_kind(label, kind, expected) from None
        raise
    refuse_other_kind(doc, label, expected)
    return doc
