"""``kvops alerts k8s``: a PrometheusRule and a ServiceMonitor from runbooks/alerts.yaml."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvops.core.errors import BadInputError


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="The alert rules in other forms.", no_args_is_help=True)
    group.command("k8s", help="Write a PrometheusRule and a ServiceMonitor (Prometheus Operator).")(k8s)
    app.add_typer(group, name="alerts")


def k8s(
    out_dir: Annotated[Path, typer.Option("--out-dir", help="Folder for prometheusrule.yaml and servicemonitor.yaml.")],
    alerts: Annotated[Path, typer.Option(help="The Prometheus rule file to convert.")] = Path("runbooks/alerts.yaml"),
    namespace: Annotated[str, typer.Option(help="Namespace of both objects.")] = "monitoring",
    release: Annotated[str, typer.Option(
        help="Value of the 'release' label kube-prometheus-stack's rule and monitor selectors match.")] = "kube-prometheus-stack",
    selector: Annotated[list[str] | None, typer.Option(
        help="Label of the vLLM Services to scrape, KEY=VALUE (repeatable).")] = None,
) -> None:
    """Both generated from the same rule file, so alerts.yaml and the cluster cannot drift."""
    from kvops.ops.k8s import write_manifests

    pairs = selector or ["app=vllm"]
    if any("=" not in p for p in pairs):
        raise BadInputError(f"--selector {pairs}: write each as KEY=VALUE, e.g. --selector app=vllm")
    labels = dict(p.split("=", 1) for p in pairs)
    for path in write_manifests(alerts, out_dir, namespace, release, labels):
        typer.echo(f"wrote {path}")
