"""Diagnoses of finished runs: records + /metrics samples in, verdicts out. No Locust here."""
