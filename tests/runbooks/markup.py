"""The runbook page markup the harness reads (documented for authors in runbooks/README.md).

A page is Markdown. ``<!-- check: state=NAME [exit=N] -->`` right before a ```shell block says
in which state of the stack the block is run and which exit code it must end with; a ```text
block after the command (before the next heading or check) is the output the page promises: each non-empty line must appear,
in order, in what the command prints, ``…`` standing for any text (prose may sit between the
command and its text block). Parsing is line-based and
strict: a shell block without a check comment, or a comment not followed by a shell block, is an
error, so that no command in a page goes untested by accident.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

RUNBOOK_DIR = Path(__file__).resolve().parents[2] / "runbooks"
SECTIONS = ("Meaning", "Impact", "Diagnosis", "Mitigation", "Escalation", "Related")
ELLIPSIS = "…"

_CHECK = re.compile(r"^<!--\s*check:\s*(?P<body>.*?)\s*-->\s*$")
_FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
_ALERTS = re.compile(r"^\*\*Alerts?:\*\*\s*(?P<names>.+)$")


class MarkupError(ValueError):
    """A page breaks the markup; the message names the page and line."""


@dataclass(frozen=True)
class Check:
    """One command block of a page and what it must print."""

    page: str
    line: int
    section: str
    state: str
    exit_code: int
    command: str
    expected: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}:{self.state}"


@dataclass(frozen=True)
class Page:
    name: str
    title: str
    alerts: tuple[str, ...]
    sections: tuple[str, ...]
    checks: tuple[Check, ...]
    links: tuple[str, ...]


def pages(directory: Path = RUNBOOK_DIR) -> list[Page]:
    """Every runbook page (README.md is the index, not a page)."""
    return [parse_page(p) for p in sorted(directory.glob("*.md")) if p.name != "README.md"]


def parse_page(path: Path) -> Page:
    lines = path.read_text().splitlines()
    title = next((ln[2:].strip() for ln in lines if ln.startswith("# ")), "")
    alerts: tuple[str, ...] = ()
    sections: list[str] = []
    for ln in lines:
        if m := _ALERTS.match(ln):
            alerts = tuple(a.strip(" `") for a in m["names"].split(",") if a.strip())
        if ln.startswith("## "):
            sections.append(ln[3:].strip())
    links = tuple(re.findall(r"\]\(([^)\s]+)\)", path.read_text()))
    return Page(path.name, title, alerts, tuple(sections), tuple(_checks(path.name, lines)), links)


def _checks(page: str, lines: list[str]) -> list[Check]:
    checks: list[Check] = []
    section = ""
    pending: tuple[int, dict[str, str]] | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        if m := _CHECK.match(line.strip()):
            if pending is not None:
                raise MarkupError(f"{page}:{pending[0] + 1}: check comment without a shell block")
            pending = (i, _attributes(page, i, m["body"]))
            i += 1
            continue
        fence = _FENCE.match(line.strip())
        if fence is None:
            if pending is not None and line.strip():
                raise MarkupError(f"{page}:{pending[0] + 1}: check comment not followed by ```shell")
            i += 1
            continue
        body, end = _block(page, lines, i)
        if fence["lang"] == "shell":
            if pending is None:
                raise MarkupError(f"{page}:{i + 1}: ```shell block without <!-- check: state=… -->")
            expected, end = _expected_after(page, lines, end)
            attrs = pending[1]
            checks.append(Check(page, i + 1, section, attrs["state"], int(attrs.get("exit", "0")),
                                "\n".join(body), expected))
            pending = None
        elif pending is not None:
            raise MarkupError(f"{page}:{pending[0] + 1}: check comment not followed by ```shell")
        i = end
    if pending is not None:
        raise MarkupError(f"{page}:{pending[0] + 1}: check comment at the end of the page")
    return checks


def _attributes(page: str, index: int, body: str) -> dict[str, str]:
    attrs = dict(re.findall(r"(\w+)=(\S+)", body))
    unknown = set(attrs) - {"state", "exit"}
    if "state" not in attrs or unknown:
        raise MarkupError(f"{page}:{index + 1}: check needs state=NAME [exit=N], got {body!r}")
    return attrs


def _block(page: str, lines: list[str], start: int) -> tuple[list[str], int]:
    """The lines inside the fence opening at ``start`` (dedented by the fence's own indent, as
    in a list item) and the index after its closing fence."""
    indent = len(lines[start]) - len(lines[start].lstrip())
    for j in range(start + 1, len(lines)):
        if lines[j].strip() == "```":
            return [ln[indent:] if ln[:indent].isspace() else ln.lstrip()
                    for ln in lines[start + 1:j]], j + 1
    raise MarkupError(f"{page}:{start + 1}: unclosed code fence")


def _expected_after(page: str, lines: list[str], index: int) -> tuple[tuple[str, ...], int]:
    """The first ```text block after a command, before the next heading, check comment or other
    code block, is its expected output (prose such as "Bad:" may sit in between)."""
    j = index
    while j < len(lines):
        stripped = lines[j].strip()
        if stripped == "```text":
            body, end = _block(page, lines, j)
            return tuple(ln for ln in body if ln.strip()), end
        if stripped.startswith(("#", "```")) or _CHECK.match(stripped):
            break
        j += 1
    return (), index


def pattern(expected_line: str) -> re.Pattern[str]:
    """``…`` matches any text; everything else literally."""
    parts = [re.escape(p) for p in expected_line.strip().split(ELLIPSIS)]
    return re.compile(".*?".join(parts))


def missing_lines(expected: tuple[str, ...], output: str) -> list[str]:
    """Expected lines not found in order in ``output`` (empty when all are there)."""
    out_lines = output.splitlines()
    pos = 0
    for k, exp in enumerate(expected):
        pat = pattern(exp)
        while pos < len(out_lines) and not pat.search(out_lines[pos]):
            pos += 1
        if pos == len(out_lines):
            return list(expected[k:])
        pos += 1
    return []
