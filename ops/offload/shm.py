"""Stale LMCache KV segments in /dev/shm: the helpers live in kvops.core.offload.shm (the plugin
removes them at start-up and exit too); re-exported for the ops side."""

from __future__ import annotations

from kvops.core.offload.shm import SEGMENT, remove_stale_segments, stale_segments

__all__ = ["SEGMENT", "remove_stale_segments", "stale_segments"]
