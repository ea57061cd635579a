"""Byte units, one definition each (STYLE rule 14: GiB vs GB never mixed)."""

from __future__ import annotations

GIB = 1 << 30
MIB = 1 << 20
