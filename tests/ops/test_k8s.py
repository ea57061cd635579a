"""`kvops alerts k8s`: the PrometheusRule carries exactly runbooks/alerts.yaml's groups (promtool
accepts them as a rule file), the ServiceMonitor names the job the rules select."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml
from typer.testing import CliRunner

from kvops.ops.cli.main import app

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "runbooks" / "alerts.yaml"
runner = CliRunner()


def _generate(tmp_path: Path, *extra: str) -> tuple[dict, dict]:
    result = runner.invoke(app, ["alerts", "k8s", "--alerts", str(ALERTS), "--out-dir", str(tmp_path), *extra])
    assert result.exit_code == 0, result.output
    rule = yaml.safe_load((tmp_path / "prometheusrule.yaml").read_text())
    monitor = yaml.safe_load((tmp_path / "servicemonitor.yaml").read_text())
    return rule, monitor


def test_prometheus_rule_carries_the_alert_groups_unchanged(tmp_path: Path) -> None:
    rule, _ = _generate(tmp_path)
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]
    as_rules = tmp_path / "spec.yaml"
    as_rules.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    exe = shutil.which("promtool")
    assert exe, "promtool is missing: run `make setup`"
    proc = subprocess.run([exe, "check", "rules", str(as_rules)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_service_monitor_scrapes_under_the_job_the_rules_select(tmp_path: Path) -> None:
    rule, monitor = _generate(tmp_path, "--selector", "app=vllm", "--selector", "tier=serving",
                              "--release", "prom")
    [job] = set(re.findall(r'up\{job="([^"]+)"\}', ALERTS.read_text()))
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert {"targetLabel": "job", "replacement": job, "action": "replace"} in endpoint["relabelings"]
    assert monitor["spec"]["selector"]["matchLabels"] == {"app": "vllm", "tier": "serving"}
    assert rule["metadata"]["labels"]["release"] == monitor["metadata"]["labels"]["release"] == "prom"


def test_bad_inputs_are_one_line_exit_2(tmp_path: Path) -> None:
    missing = runner.invoke(app, ["alerts", "k8s", "--alerts", str(tmp_path / "no.yaml"), "--out-dir", str(tmp_path)])
    assert missing.exit_code == 2
    assert "--alerts" in missing.stderr
    bad = runner.invoke(app, ["alerts", "k8s", "--alerts", str(ALERTS), "--out-dir", str(tmp_path),
                              "--selector", "app"])
    assert bad.exit_code == 2
    assert "KEY=VALUE" in bad.stderr
