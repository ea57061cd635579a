"""Operator-facing output for request traces: the readable summary and the hit-ratio plot."""
