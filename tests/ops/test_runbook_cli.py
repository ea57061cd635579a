"""`kvops runbook` and `kvops alerts rules|dashboard|k8s` read the copy installed with kvops
(package kvops.runbooks), not a path relative to the working directory: each is run from a
directory that has no runbooks/ and compared with the repo's files. That the wheel carries them
is tests/e2e/test_installed_e2e.py's part."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from kvops.ops.cli.main import app

RUNBOOKS = Path(__file__).resolve().parents[2] / "runbooks"
PAGES = sorted(p.stem for p in RUNBOOKS.glob("*.md") if p.name != "README.md")
runner = CliRunner()


@pytest.fixture(autouse=True)
def _elsewhere(tmp_path: Path):
    """cwd without a runbooks/ folder, as an operator's shell after `pip install`."""
    before = Path.cwd()
    os.chdir(tmp_path)
    yield
    os.chdir(before)


def _ok(*args: str) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def test_runbook_lists_every_page_with_its_heading() -> None:
    listed = [line.split()[0] for line in _ok("runbook").splitlines()]
    assert listed == PAGES
    heading = (RUNBOOKS / "kv-exhaustion.md").read_text().splitlines()[0].removeprefix("# ")
    assert heading in _ok("runbook")


@pytest.mark.parametrize("name", ["kv-exhaustion", "offload.md"])
def test_runbook_prints_a_page_and_its_path(name: str) -> None:
    page = RUNBOOKS / (name.removesuffix(".md") + ".md")
    assert _ok("runbook", name) == page.read_text()
    printed = Path(_ok("runbook", name, "--path").strip())
    assert printed.is_absolute()
    assert printed.read_text() == page.read_text()
    assert Path(_ok("runbook", "--path").strip()) == printed.parent


def test_an_unknown_page_is_one_line_exit_2() -> None:
    result = runner.invoke(app, ["runbook", "kv-exhaustionn"])
    assert result.exit_code == 2
    assert "kv-exhaustion" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_alerts_rules_and_dashboard_print_the_installed_files() -> None:
    assert _ok("alerts", "rules") == (RUNBOOKS / "alerts.yaml").read_text()
    dashboard = _ok("alerts", "dashboard")
    assert json.loads(dashboard) == json.loads((RUNBOOKS / "grafana-dashboard.json").read_text())


def test_alerts_rules_out_writes_the_file(tmp_path: Path) -> None:
    out = tmp_path / "rules.yaml"
    _ok("alerts", "rules", "--out", str(out))
    assert out.read_text() == (RUNBOOKS / "alerts.yaml").read_text()
    bad = runner.invoke(app, ["alerts", "rules", "--out", str(tmp_path / "no" / "such" / "x.yaml")])
    assert bad.exit_code == 2
    assert "--out" in bad.stderr


def test_alerts_k8s_defaults_to_the_installed_rules_and_prints_both_objects(tmp_path: Path) -> None:
    printed = list(yaml.safe_load_all(_ok("alerts", "k8s")))
    assert [doc["kind"] for doc in printed] == ["PrometheusRule", "ServiceMonitor"]
    assert printed[0]["spec"]["groups"] == yaml.safe_load((RUNBOOKS / "alerts.yaml").read_text())["groups"]
    _ok("alerts", "k8s", "--out-dir", str(tmp_path))
    written = [yaml.safe_load((tmp_path / f).read_text()) for f in ("prometheusrule.yaml", "servicemonitor.yaml")]
    assert written == printed
