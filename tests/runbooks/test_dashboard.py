"""grafana-dashboard.json: loads imported or provisioned from a file (every panel and variable
reads the one data-source variable, no __inputs placeholder a provisioned file would leave
unresolved), unique panel ids on a 24-column grid, job/instance/model_name variables (every
metric filtered by all three), a runbook
link on every panel, one unit per axis, every query valid PromQL (promtool parses it as a
recording rule), only real metric names, and a panel for each signal the runbooks use. The
queries run against a live Prometheus in tests/e2e/test_staging_e2e.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from .markup import RUNBOOK_DIR
from .names import known_names, unknown_names

DASHBOARD = json.loads((RUNBOOK_DIR / "grafana-dashboard.json").read_text())
DS_UID = "${datasource}"
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range"}
VARIABLE = re.compile(r"\$\{?(\w+)")
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
    assert "__inputs" not in DASHBOARD, "an import placeholder breaks file provisioning"
    [ds_var] = [v for v in DASHBOARD["templating"]["list"] if v["type"] == "datasource"]
    assert (ds_var["name"], ds_var["query"]) == ("datasource", "prometheus")
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


def test_variables_for_job_instance_and_model_read_the_data_source_variable() -> None:
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert {"datasource", "job", "instance", "model_name"} <= set(variables)
    for name in ("job", "instance", "model_name"):
        assert variables[name]["datasource"]["uid"] == DS_UID
        assert f", {name})" in variables[name]["definition"]


def test_every_variable_a_panel_uses_is_declared() -> None:
    declared = {v["name"] for v in DASHBOARD["templating"]["list"]} | GRAFANA_BUILTINS
    used = set(VARIABLE.findall(json.dumps(DASHBOARD["panels"])))
    assert used - declared == set()
    assert {"job", "instance"} <= used


def test_every_panel_links_to_an_existing_runbook_page() -> None:
    base = "https://github.com/vllm-kvops/vllm-kvops/blob/main/runbooks/"
    for panel in _panels():
        [link] = panel["links"]
        assert link["url"].startswith(base), panel["title"]
        assert (RUNBOOK_DIR / link["url"].removeprefix(base)).is_file(), link["url"]


def _unit_of(panel: dict[str, Any], ref_id: str) -> tuple[str, str]:
    """(axis, unit) a target's series are drawn with: the panel default or its override."""
    axis, unit = "left", panel["fieldConfig"]["defaults"].get("unit", "short")
    for override in panel["fieldConfig"].get("overrides", []):
        if override["matcher"] == {"id": "byFrameRefID", "options": ref_id}:
            props = {p["id"]: p["value"] for p in override["properties"]}
            unit = props.get("unit", unit)
            axis = props.get("custom.axisPlacement", axis)
    return axis, unit


def test_one_unit_per_axis_and_seconds_drawn_as_seconds() -> None:
    for panel in _panels():
        units: dict[str, set[str]] = {}
        for target in panel["targets"]:
            axis, unit = _unit_of(panel, target["refId"])
            units.setdefault(axis, set()).add(unit)
            assert (unit == "s") == ("_seconds" in target["expr"]), (panel["title"], target["refId"])
        assert all(len(u) == 1 for u in units.values()), (panel["title"], units)


def test_every_runbook_signal_has_a_panel() -> None:
    exprs = "\n".join(_exprs())
    missing = {signal for signal, metric in SIGNALS.items() if metric not in exprs}
    assert not missing


def test_every_metric_in_a_query_follows_the_job_instance_and_model_pickers() -> None:
    """kvops series carry model_name as vLLM's do, so each panel honours the model picker too."""
    selector = re.compile(r"\b(vllm:[a-z0-9_:]+|kvops_[a-z0-9_]+)(\{[^}]*\})?")
    for expr in _exprs():
        for name, labels in selector.findall(expr):
            for variable in ("job", "instance", "model_name"):
                assert f'{variable}=~"${variable}"' in labels, f"{name} in {expr}"


def test_queries_use_only_metrics_vllm_and_kvops_define() -> None:
    assert unknown_names("\n".join(_exprs()), known_names()) == set()


def test_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query, with Grafana's variables replaced as Grafana would."""
    rules = [
        {"record": f"dashboard:query_{i}",
         "expr": re.sub(r"\$(job|instance|model_name)", ".*", e.replace("$__rate_interval", "5m"))}
        for i, e in enumerate(_exprs())
    ]
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    exe = shutil.which("promtool")
    assert exe, "promtool is missing: run `make setup` (Debian package prometheus)"
    proc = subprocess.run([exe, "check", "rules", str(path)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
