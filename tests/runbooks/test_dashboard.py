"""grafana-dashboard.json: importable as is (Grafana's import contract: __inputs for the data
source, unique panel ids, a 24-column grid), every query valid PromQL (promtool parses it as a
recording rule), only real metric names, and a panel for each signal the runbooks use."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from .markup import RUNBOOK_DIR
from .names import known_names, unknown_names

DASHBOARD = json.loads((RUNBOOK_DIR / "grafana-dashboard.json").read_text())
DS_UID = "${DS_PROMETHEUS}"
SIGNALS = {
    "KV usage": "vllm:kv_cache_usage_perc",
    "preemptions": "vllm:num_preemptions_total",
    "prefix hit rate": "vllm:prefix_cache_hits_total",
    "TTFT queue part": "vllm:request_queue_time_seconds_sum",
    "TTFT prefill part": "vllm:request_prefill_time_seconds_sum",
    "offload tiers": "kvops_offload_server_usage_bytes",
    "admission decisions": "kvops_admission_decisions_total",
}


def _panels() -> list[dict[str, Any]]:
    return [p for p in DASHBOARD["panels"] if p["type"] != "row"]


def _exprs() -> list[str]:
    return [t["expr"] for p in _panels() for t in p["targets"]]


def test_import_contract() -> None:
    assert DASHBOARD["title"]
    assert DASHBOARD["uid"]
    assert DASHBOARD["id"] is None, "an exported dashboard must not carry a database id"
    assert isinstance(DASHBOARD["schemaVersion"], int)
    [ds_input] = DASHBOARD["__inputs"]
    assert (ds_input["name"], ds_input["type"], ds_input["pluginId"]) == (
        "DS_PROMETHEUS", "datasource", "prometheus")
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))


def test_panels_fit_the_grid_without_overlap() -> None:
    taken: set[tuple[int, int]] = set()
    for panel in DASHBOARD["panels"]:
        g = panel["gridPos"]
        assert 0 <= g["x"] < g["x"] + g["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


def test_every_panel_queries_the_imported_data_source() -> None:
    for panel in _panels():
        assert panel["type"] in {"timeseries", "stat"}, panel["title"]
        assert panel["datasource"]["uid"] == DS_UID
        assert panel["description"]
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids))
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == DS_UID
            assert target["expr"].strip()


def test_every_runbook_signal_has_a_panel() -> None:
    exprs = "\n".join(_exprs())
    missing = {signal for signal, metric in SIGNALS.items() if metric not in exprs}
    assert not missing


def test_queries_use_only_metrics_vllm_and_kvops_define() -> None:
    assert unknown_names("\n".join(_exprs()), known_names()) == set()


def test_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query, with Grafana's variables replaced as Grafana would."""
    rules = [
        {"record": f"dashboard:query_{i}",
         "expr": e.replace("$__rate_interval", "5m").replace("$instance", ".*")}
        for i, e in enumerate(_exprs())
    ]
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    exe = shutil.which("promtool")
    assert exe, "promtool is missing: run `make setup` (Debian package prometheus)"
    proc = subprocess.run([exe, "check", "rules", str(path)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
