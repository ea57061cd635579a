"""``kvops alerts rules|dashboard|k8s``: the alert rules, the Grafana dashboard and the Prometheus
Operator objects, from the copy installed with kvops (``kvops.runbooks``), printed or written."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvops.core import runbooks
from kvops.core.errors import BadInputError

OutFile = Annotated[Path | None, typer.Option("--out", help="Write it to this file instead of printing it.")]


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="The alert rules, the Grafana dashboard and the Prometheus Operator "
                             "objects, as installed with kvops.", no_args_is_help=True)
    group.command("rules", help="Print alerts.yaml (Prometheus rules, each with its runbook), or write it.")(rules)
    group.command("dashboard", help="Print the Grafana dashboard (JSON to import), or write it.")(dashboard)
    group.command("k8s", help="Print or write a PrometheusRule and a ServiceMonitor (Prometheus Operator).")(k8s)
    app.add_typer(group, name="alerts")


def rules(out: OutFile = None) -> None:
    """Load it with `rule_files: [alerts.yaml]`; they assume vLLM's scrape job is named vllm."""
    _print_or_write(runbooks.data_path(runbooks.RULES_FILE), out)


def dashboard(out: OutFile = None) -> None:
    """Import it in Grafana (Dashboards → New → Import) or provision it from a file/ConfigMap."""
    _print_or_write(runbooks.data_path(runbooks.DASHBOARD_FILE), out)


def k8s(
    out_dir: Annotated[Path | None, typer.Option(
        "--out-dir", help="Write prometheusrule.yaml and servicemonitor.yaml here (default: print both).")] = None,
    alerts: Annotated[Path | None, typer.Option(
        help="A Prometheus rule file to convert (default: the alerts.yaml installed with kvops).")] = None,
    namespace: Annotated[str, typer.Option(help="Namespace of both objects.")] = "monitoring",
    release: Annotated[str, typer.Option(
        help="Value of the 'release' label kube-prometheus-stack's rule and monitor selectors match.")] = "kube-prometheus-stack",
    selector: Annotated[list[str] | None, typer.Option(
        help="Label of the vLLM Services to scrape, KEY=VALUE (repeatable).")] = None,
) -> None:
    """Both generated from the same rule file, so alerts.yaml and the cluster cannot drift."""
    from kvops.ops.k8s import manifests, write_manifests

    pairs = selector or ["app=vllm"]
    if any("=" not in p for p in pairs):
        raise BadInputError(f"--selector {pairs}: write each as KEY=VALUE, e.g. --selector app=vllm")
    labels = dict(p.split("=", 1) for p in pairs)
    source = alerts or runbooks.data_path(runbooks.RULES_FILE)
    if out_dir is None:  # one YAML stream, ready for `kubectl apply -f -`
        typer.echo("---\n".join(manifests(source, namespace, release, labels).values()), nl=False)
        return
    for path in write_manifests(source, out_dir, namespace, release, labels):
        typer.echo(f"wrote {path}")


def _print_or_write(source: Path, out: Path | None) -> None:
    text = source.read_text()
    if out is None:
        typer.echo(text, nl=False)
        return
    try:
        out.write_text(text)
    except OSError as exc:
        raise BadInputError(f"--out {out}: cannot write it ({exc.strerror or exc})") from None
    typer.echo(f"wrote {out}")
