"""The runbook pages, alert rules and dashboard as installed with kvops (package
``kvops.runbooks``, the repo's runbooks/ folder shipped as package data).

Verdicts and errors name a page by the command that prints it (``kvops runbook NAME``), which
works wherever kvops is installed; a ``runbooks/NAME.md`` path exists only in a checkout.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from kvops.core.errors import BadInputError, KvopsError

PACKAGE = "kvops.runbooks"
RULES_FILE = "alerts.yaml"
DASHBOARD_FILE = "grafana-dashboard.json"
INDEX_PAGE = "README"


def folder() -> Path:
    """The installed folder: a real directory (a wheel installs files), so paths can be printed
    and handed to promtool or Prometheus as they are."""
    try:
        root = importlib.resources.files(PACKAGE)
    except ModuleNotFoundError:
        raise KvopsError(f"{PACKAGE} is not installed with this kvops: reinstall it "
                         "(`pip install vllm-kvops`, or `make setup` in a checkout)") from None
    if not isinstance(root, Path) or not root.is_dir():
        raise KvopsError(f"{PACKAGE} is not a folder on disk ({root}): reinstall kvops from its wheel")
    return root


def page_names() -> list[str]:
    """Every page (README is the index, not a page)."""
    return sorted(p.stem for p in folder().glob("*.md") if p.stem != INDEX_PAGE)


def page_path(name: str) -> Path:
    """The installed page ``name`` (``kv-exhaustion`` or ``kv-exhaustion.md``)."""
    stem = name.removesuffix(".md")
    if stem not in [*page_names(), INDEX_PAGE]:
        raise BadInputError(f"runbook {name!r}: no such page; pick one of {', '.join(page_names())} "
                            "(`kvops runbook` lists them)")
    return folder() / f"{stem}.md"


def data_path(filename: str) -> Path:
    """An installed data file beside the pages (``RULES_FILE``, ``DASHBOARD_FILE``)."""
    path = folder() / filename
    if not path.is_file():
        raise KvopsError(f"{path}: missing from the installed kvops: reinstall it")
    return path


def see(name: str) -> str:
    """How a message points at a page: the command that prints it."""
    return f"`kvops runbook {name}`"
