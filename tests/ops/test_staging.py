"""The staging fleet's configuration files, checked by the daemons' own validators (promtool,
amtool, haproxy -c), and the fleet diagnosis' pure parts. The live fleet is
tests/e2e/test_staging_e2e.py."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvops.core.errors import BadInputError
from kvops.core.verdict import Verdict, healthy
from kvops.ops.fleet import FleetDiagnosis, check_selector
from kvops.ops.staging.configs import (
    FAST_FOR,
    FAST_WINDOW,
    INHIBIT_RULES,
    alertmanager_yml,
    fast_rules,
    haproxy_cfg,
    prometheus_yml,
)

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "runbooks" / "alerts.yaml"


def _tool(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")
    assert exe, f"{name} is missing: run `make setup`"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60, check=False)


def test_fast_rules_shorten_every_duration_and_keep_the_rest(tmp_path: Path) -> None:
    fast = tmp_path / "alerts.yaml"
    fast.write_text(fast_rules(ALERTS.read_text()))
    proc = _tool("promtool", "check", "rules", str(fast))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    original = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    staged = [r for g in yaml.safe_load(fast.read_text())["groups"] for r in g["rules"]]
    assert [r["alert"] for r in staged] == [r["alert"] for r in original]
    for before, after in zip(original, staged, strict=True):
        assert after["for"] == FAST_FOR
        # rate windows shortened; a day-long window is a label lookback and stays a day
        assert set(re.findall(r"\[(\w+)\]", after["expr"])) <= {FAST_WINDOW, "1d"}
        assert after["expr"].count("[1d") == before["expr"].count("[1d")
        strip = re.compile(r"\[\w+\]|offset \w+|\s+")
        assert strip.sub("", after["expr"]) == strip.sub("", before["expr"])
        assert after["labels"] == before["labels"]
        assert after["annotations"] == before["annotations"]


def test_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    rules = tmp_path / "alerts.yaml"
    rules.write_text(fast_rules(ALERTS.read_text()))
    config = tmp_path / "prometheus.yml"
    config.write_text(prometheus_yml(["127.0.0.1:8001", "127.0.0.1:8002"], str(rules), "127.0.0.1:9093"))
    proc = _tool("promtool", "check", "config", str(config))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_alertmanager_config_passes_amtool(tmp_path: Path) -> None:
    config = tmp_path / "alertmanager.yml"
    config.write_text(alertmanager_yml("http://127.0.0.1:5001/alerts"))
    proc = _tool("amtool", "check-config", str(config))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 inhibit rules" in proc.stdout


def test_haproxy_config_passes_haproxy(tmp_path: Path) -> None:
    config = tmp_path / "haproxy.cfg"
    config.write_text(haproxy_cfg(8080, [("replica-0", "127.0.0.1:8001"), ("replica-1", "127.0.0.1:8002")]))
    proc = _tool("haproxy", "-c", "-f", str(config))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_runbook_readme_shows_the_inhibition_rules_staging_runs() -> None:
    text = (REPO / "runbooks" / "README.md").read_text()
    [block] = re.findall(r"```yaml\n(inhibit_rules:.*?)```", text, re.DOTALL)
    assert yaml.safe_load(block)["inhibit_rules"] == INHIBIT_RULES


@pytest.mark.parametrize("bad", ['job="vllm"', "vllm", '{job="vllm"'])
def test_selector_must_be_label_matchers_in_braces(bad: str) -> None:
    with pytest.raises(BadInputError, match="--selector"):
        check_selector(bad)


def test_fleet_line_names_the_unhealthy_replicas() -> None:
    kv = Verdict("kv-exhaustion", "kv-capacity", {"waiting": 3})
    fleet = FleetDiagnosis({"a:1": [healthy()], "b:2": [kv]}, verdicts=[kv])
    assert fleet.unhealthy() == ["b:2"]
    assert fleet.fleet_line() == "fleet: 2 replicas, unhealthy: b:2 (kv-exhaustion/kv-capacity)"
    doc = fleet.to_dict()
    assert set(doc) == {"verdicts", "replicas"}
    assert doc["replicas"]["b:2"][0]["cause"] == "kv-capacity"
