"""alerts.yaml: valid for Prometheus, unit-tested with promtool, and tied to the pages both ways.

promtool is Debian's `prometheus` package (installed by `make setup`); its own parser and rule
evaluator are the oracle here, not ours.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from .markup import RUNBOOK_DIR, pages
from .names import known_names, unknown_names

ALERTS = RUNBOOK_DIR / "alerts.yaml"
RUNBOOK_BASE = "https://github.com/vllm-kvops/vllm-kvops/blob/main/runbooks/"


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    assert exe, "promtool is missing: run `make setup` (Debian package prometheus)"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, check=False)


def _rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(ALERTS.read_text())
    return [rule for group in data["groups"] for rule in group["rules"]]


def test_promtool_accepts_the_rules() -> None:
    proc = _promtool("check", "rules", str(ALERTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in proc.stdout


def test_promtool_unit_tests_pass() -> None:
    proc = _promtool("test", "rules", str(RUNBOOK_DIR / "alerts_test.yaml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_alert_is_unit_tested_firing() -> None:
    tests = yaml.safe_load((RUNBOOK_DIR / "alerts_test.yaml").read_text())["tests"]
    fired = {
        case["alertname"]
        for test in tests for case in test.get("alert_rule_test", []) if case.get("exp_alerts")
    }
    assert {r["alert"] for r in _rules()} - fired == set()


def test_promtool_unit_tests_can_fail(tmp_path: Path) -> None:
    """A rule that never fires must make promtool's test fail: the tests have teeth."""
    rules = ALERTS.read_text().replace("> 0.1\n", "> 1000\n", 1)
    (tmp_path / "alerts.yaml").write_text(rules)
    (tmp_path / "alerts_test.yaml").write_text((RUNBOOK_DIR / "alerts_test.yaml").read_text())
    proc = _promtool("test", "rules", str(tmp_path / "alerts_test.yaml"))
    assert proc.returncode != 0
    assert "KvopsPreemptionStorm" in proc.stdout + proc.stderr


@pytest.mark.parametrize("rule", _rules(), ids=lambda r: r["alert"])
def test_alert_links_to_a_page_that_names_it(rule: dict[str, Any]) -> None:
    url = rule["annotations"]["runbook_url"]
    assert url.startswith(RUNBOOK_BASE), url
    page = RUNBOOK_DIR / url.removeprefix(RUNBOOK_BASE)
    assert page.is_file(), f"{rule['alert']}: runbook_url points at a missing page {page.name}"
    by_name = {p.name: p for p in pages()}
    assert rule["alert"] in by_name[page.name].alerts, f"{page.name} does not list {rule['alert']}"
    assert {"summary", "description"} <= set(rule["annotations"])
    assert rule["labels"]["severity"] in {"info", "warning", "critical"}


def test_every_page_is_the_runbook_of_its_alerts() -> None:
    urls = {r["alert"]: r["annotations"]["runbook_url"] for r in _rules()}
    for page in pages():
        assert page.alerts, f"{page.name} names no alert (**Alerts:** line)"
        for alert in page.alerts:
            assert alert in urls, f"{page.name} lists {alert}, which alerts.yaml does not define"
            assert urls[alert] == RUNBOOK_BASE + page.name, f"{alert} links elsewhere"


def test_alerts_use_only_metrics_vllm_and_kvops_define() -> None:
    exprs = "\n".join(r["expr"] for r in _rules())
    assert unknown_names(exprs, known_names()) == set()


@pytest.mark.parametrize("rule", [r for r in _rules() if "kvops_" in r["expr"]], ids=lambda r: r["alert"])
def test_alerts_on_kvops_series_keep_the_model_like_vllms(rule: dict[str, Any]) -> None:
    """The plugin labels its series with vLLM's model_name, so its alerts name the model too:
    every aggregation keeps job, instance and model_name, and the promtool unit test of the
    alert expects them (runbooks/alerts_test.yaml)."""
    groupings = re.findall(r"\bby \(([^)]*)\)", rule["expr"])
    assert groupings, rule["expr"]
    for grouping in groupings:
        assert {"job", "instance", "model_name"} <= {g.strip() for g in grouping.split(",")}
    tests = yaml.safe_load((RUNBOOK_DIR / "alerts_test.yaml").read_text())["tests"]
    expected = [alert["exp_labels"] for t in tests for case in t.get("alert_rule_test", [])
                if case["alertname"] == rule["alert"] for alert in case.get("exp_alerts", [])]
    assert expected
    assert all("model_name" in labels for labels in expected)
