"""Metric names the runbooks may use: what vLLM 0.32 and the kvops plugin actually define.

vLLM's names are read from its own source (vllm/v1/metrics/, the version installed here), the
plugin's from plugin/ (literal names, plus the kvops_offload_* counters plugin/offload/prom.py
derives from the stats keys). A name in an alert, a dashboard or a page that is in neither is a
typo or an invention.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
METRIC = re.compile(r"\b(vllm:[a-z0-9_:]+|kvops_[a-z0-9_]+)")
SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")


def vllm_names() -> set[str]:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None, "vllm is not installed"
    assert spec.origin, "vllm is not installed"
    root = Path(spec.origin).parent
    names: set[str] = set()
    for path in [*root.joinpath("v1", "metrics").glob("*.py"), root / "v1/spec_decode/metrics.py"]:
        names.update(re.findall(r'"(vllm:[a-z0-9_]+)', path.read_text()))
    return names


def kvops_names() -> set[str]:
    names: set[str] = set()
    for path in (REPO / "plugin").rglob("*.py"):
        names.update(re.findall(r'"(kvops_[a-z0-9_]+)"', path.read_text()))
    stats = REPO / "plugin" / "offload" / "stats.py"
    if stats.exists():  # prom.py registers kvops_offload_<key without kvops_> for these keys
        keys = re.findall(r'"kvops_([a-z_]+)"', stats.read_text())
        names.update(f"kvops_offload_{k}" for k in keys)
    return names


def known_names() -> set[str]:
    return vllm_names() | kvops_names()


def unknown_names(text: str, known: set[str]) -> set[str]:
    """Metric names in ``text`` that neither vLLM nor the plugin define (a name ending in ``_``
    or ``:`` is a prefix of a grep pattern: some defined name must start with it)."""
    unknown = set()
    for raw in set(METRIC.findall(text)):
        name = raw.rstrip(":_")
        if raw != name:  # a grep prefix such as ^kvops_offload_(server_up|degraded)
            if not any(k.startswith(raw) for k in known):
                unknown.add(raw)
            continue
        base = name
        for suffix in SUFFIXES:
            if base.endswith(suffix) and base not in known:
                base = base.removesuffix(suffix)
        if name not in known and base not in known:
            unknown.add(name)
    return unknown
