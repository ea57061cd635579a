"""Runbook pages: fixed sections, every command checked in a known state, links that resolve,
metric names that exist; and the markup parser itself on small pages."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from .markup import RUNBOOK_DIR, SECTIONS, MarkupError, missing_lines, pages, parse_page
from .names import METRIC, known_names, unknown_names
from .states import STATE_ORDER, STATES

PAGES = pages()
REQUIRED = {"kv-exhaustion.md", "startup-kv-oom.md", "prefix-miss.md", "ttft-regression.md",
            "offload.md", "fp8-accuracy.md", "admission-rejections.md"}


def test_the_required_pages_exist() -> None:
    assert REQUIRED <= {p.name for p in PAGES}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_has_the_fixed_sections_in_order(page) -> None:
    assert page.title, f"{page.name}: no H1"
    assert page.sections == SECTIONS, f"{page.name}: sections {page.sections}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_diagnosis_and_mitigation_have_checked_commands(page) -> None:
    sections = {c.section for c in page.checks}
    assert {"Diagnosis", "Mitigation"} <= sections, f"{page.name}: checked blocks in {sections}"
    for check in page.checks:
        assert check.state in STATE_ORDER, f"{check.id}: unknown state"
        assert check.expected or check.exit_code != 0, f"{check.id}: says nothing about its output"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_links_resolve(page) -> None:
    for link in page.links:
        if link.startswith(("http://", "https://")):
            continue
        target, _, anchor = link.partition("#")
        path = RUNBOOK_DIR / target if target else RUNBOOK_DIR / page.name
        assert path.is_file(), f"{page.name}: link {link} points at nothing"
        if anchor:
            headings = {_anchor(ln.lstrip("#").strip()) for ln in path.read_text().splitlines()
                        if ln.startswith("#")}
            assert anchor in headings, f"{page.name}: no heading for #{anchor} in {path.name}"


def test_readme_indexes_every_page() -> None:
    readme = (RUNBOOK_DIR / "README.md").read_text()
    for page in PAGES:
        assert f"]({page.name})" in readme, f"README.md does not link {page.name}"
        for alert in page.alerts:
            assert alert in readme


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_use_only_metrics_vllm_and_kvops_define(page) -> None:
    assert unknown_names((RUNBOOK_DIR / page.name).read_text(), known_names()) == set()


@pytest.mark.parametrize("state", [s for s in STATES if s.page_flags], ids=lambda s: s.name)
def test_states_use_the_flags_their_pages_name(state) -> None:
    """A state reproduces a page's problem with the flags the page tells the operator about."""
    using = [p for p in PAGES if any(c.state == state.name for c in p.checks)]
    text = "\n".join((RUNBOOK_DIR / p.name).read_text() for p in using)
    for flag in state.page_flags:
        assert flag in text, f"state {state.name}: no page using it mentions {flag}"


def _anchor(heading: str) -> str:
    keep = (ch for ch in heading.lower() if ch.isalnum() or ch in " -_")
    return "".join(keep).replace(" ", "-")


# --- the markup parser ---------------------------------------------------------------------------

GOOD = """# T

**Alerts:** A, B

## Meaning
<!-- check: state=offline exit=3 -->
```shell
echo hi
```

```text
h…
```
## Diagnosis
```text
not a command
```
"""


def test_parser_reads_state_exit_command_and_expected(tmp_path: Path) -> None:
    path = tmp_path / "p.md"
    path.write_text(GOOD)
    page = parse_page(path)
    assert page.alerts == ("A", "B")
    assert page.sections == ("Meaning", "Diagnosis")
    [check] = page.checks
    assert (check.state, check.exit_code, check.command, check.expected) == (
        "offline", 3, "echo hi", ("h…",))
    assert check.section == "Meaning"


@pytest.mark.parametrize("text", [
    "```shell\necho unchecked\n```\n",
    "<!-- check: state=offline -->\n\nsome prose\n```shell\necho\n```\n",
    "<!-- check: exit=1 -->\n```shell\necho\n```\n",
    "<!-- check: state=offline -->\n```text\nx\n```\n",
    "<!-- check: state=offline -->\n```shell\necho\n",
])
def test_parser_refuses_unchecked_or_broken_blocks(tmp_path: Path, text: str) -> None:
    path = tmp_path / "p.md"
    path.write_text(text)
    with pytest.raises(MarkupError):
        parse_page(path)


def test_expected_lines_match_in_order_with_ellipsis() -> None:
    out = "a: 1\nkv-exhaustion / kv-capacity\n  waiting: 4.0\n  kv_usage: 1.0\n"
    assert missing_lines(("kv-exhaustion / kv-capacity", "waiting: …", "kv_usage: 1…"), out) == []
    assert missing_lines(("kv_usage: …", "waiting: …"), out) == ["waiting: …"]
    assert missing_lines(("healthy / none",), out) == ["healthy / none"]
    assert missing_lines(("a(1)",), "a(1)") == []


# --- PromQL written inline in the pages ----------------------------------------------------------

def _inline_promql() -> list[tuple[str, str]]:
    """Inline code spans that are queries: they call a function or aggregate over a metric."""
    found = []
    for page in PAGES:
        text = (RUNBOOK_DIR / page.name).read_text()
        for span in re.findall(r"`([^`\n]+)`", text):
            if "(" in span and METRIC.search(span) and not span.startswith(("kvops ", "curl ")):
                found.append((page.name, span))
    return found


def test_pages_show_promql() -> None:
    assert len(_inline_promql()) >= 5


def test_inline_promql_parses(tmp_path: Path) -> None:
    rules = [{"record": f"page:query_{i}", "expr": q} for i, (_, q) in enumerate(_inline_promql())]
    path = tmp_path / "page_rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "pages", "rules": rules}]}))
    exe = shutil.which("promtool")
    assert exe, "promtool is missing: run `make setup` (Debian package prometheus)"
    proc = subprocess.run([exe, "check", "rules", str(path)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _message_strings(path: Path) -> list[str]:
    """The string constants of a module that are not docstrings (messages, verdicts' next)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def _product_modules() -> list[Path]:
    repo = RUNBOOK_DIR.parent
    return [path for folder in ("core", "ops", "loadtest", "plugin") for path in (repo / folder).rglob("*.py")]


def test_pages_named_by_verdicts_exist() -> None:
    """`kvops diagnose` / `kvops loadtest` verdicts and errors point operators at a page by the
    command that prints it from the installed kvops (`kvops runbook kv-exhaustion`)."""
    named = {match for path in _product_modules() for text in _message_strings(path)
             for match in re.findall(r"kvops runbook ([a-z0-9-]+)", text)}
    assert named, "no verdict names a runbook page any more"
    assert {f"{name}.md" for name in named} <= {p.name for p in PAGES}


def test_no_message_names_a_checkout_path_of_a_page() -> None:
    """runbooks/<page>.md exists in a checkout only; an installed kvops has `kvops runbook`."""
    offenders = [f"{path.relative_to(RUNBOOK_DIR.parent)}: {text!r}" for path in _product_modules()
                 for text in _message_strings(path) if re.search(r"runbooks/[A-Za-z0-9_-]+\.(md|yaml|json)", text)]
    assert offenders == []
