"""Scenarios: a YAML file of data and a locustfile of glue per scenario (STYLE rule 7)."""
