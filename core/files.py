"""Reading a YAML or JSON mapping from a file, with one set of messages for what can go wrong.

Settings, scenario files, offload configs and model configs are all "a file holding a mapping";
a bad one must exit 2 with a line naming the file and what is wrong, never a traceback.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from kvops.core.errors import BadInputError

MAX_INPUT_BYTES = 1 << 30
"""Larger than any config, log, plan or trace we read (the real Mooncake trace is 3 MB): a file
past it is a mistake, and reading it whole would take the machine's memory."""


def read_text(path: Path, label: str, *, replace_bad_bytes: bool = False) -> str:
    """The UTF-8 text of a regular file, or a one-line refusal naming ``label`` (e.g. "--log
    /x"). A FIFO or device would block or never end, a directory cannot be read: all refused
    before opening. ``replace_bad_bytes``: for logs, whose lines may carry any bytes."""
    try:
        info = path.stat()
    except OSError as exc:
        raise BadInputError(f"{label}: cannot read it ({exc.strerror or exc})") from None
    if stat.S_ISDIR(info.st_mode):
        raise BadInputError(f"{label}: cannot read it (a directory): give a file")
    if not stat.S_ISREG(info.st_mode):
        raise BadInputError(f"{label}: cannot read it (a FIFO, socket or device, not a file): give a file")
    if info.st_size > MAX_INPUT_BYTES:
        raise BadInputError(f"{label}: {info.st_size:,} bytes is over the {MAX_INPUT_BYTES:,}-byte "
                            "limit for an input file: give the right file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BadInputError(f"{label}: cannot read it ({exc.strerror or exc})") from None
    try:
        return data.decode(errors="replace" if replace_bad_bytes else "strict")
    except UnicodeDecodeError as exc:
        raise BadInputError(f"{label}: cannot read it (not UTF-8 text at byte {exc.start}): give a text file") from None


def parse_json(text: str, label: str) -> object:
    """``json.loads`` with one-line refusals, deep nesting (RecursionError) included."""
    return _parse(json.loads, text, label, "JSON")


def parse_yaml(text: str, label: str) -> object:
    """``yaml.safe_load`` with one-line refusals, deep nesting (RecursionError) included."""
    return _parse(yaml.safe_load, text, label, "YAML")


def _parse(load: Callable[[str], object], text: str, label: str, kind: str) -> object:
    try:
        return load(text)
    except RecursionError:
        raise BadInputError(f"{label}: nested too deeply to be valid {kind}") from None
    except json.JSONDecodeError as exc:
        raise BadInputError(f"{label}: not valid JSON ({exc})") from None
    except yaml.YAMLError as exc:
        raise BadInputError(f"{label}: not valid YAML ({' '.join(str(exc).split())})") from None
    except ValueError as exc:  # an integer of more than sys.get_int_max_str_digits() digits
        raise BadInputError(f"{label}: not valid {kind} ({str(exc).split(';')[0]})") from None


def read_mapping(path: Path, what: str = "") -> dict[str, Any]:
    """The mapping at the top of ``path``: JSON when it ends in ``.json``, YAML otherwise (an
    empty YAML file is an empty mapping). ``what`` ("--config", "scenario file") prefixes the
    path in messages. Raises BadInputError for an unreadable file, bad syntax or a non-mapping."""
    label = f"{what} {path}" if what else str(path)
    text = read_text(path, label)
    if path.suffix == ".json":
        data = parse_json(text, label)
    else:
        data = parse_yaml(text, label)
        data = {} if data is None else data
    if not isinstance(data, dict):
        kind = "JSON object" if path.suffix == ".json" else "mapping"
        raise BadInputError(f"{label}: expected a {kind} at the top level, got {type(data).__name__}")
    return data
