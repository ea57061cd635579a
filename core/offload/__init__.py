"""Offload: the settings schema and the preflight checks that need no LMCache."""
