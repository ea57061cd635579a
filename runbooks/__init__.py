"""The runbook pages, the Prometheus rules (alerts.yaml) and the Grafana dashboard, installed
with kvops as package data (``kvops.runbooks``; ``kvops runbook``, ``kvops alerts``). No code."""
