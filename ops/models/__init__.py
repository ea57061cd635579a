"""Model artefacts kvops builds itself (no hub access exists on these machines)."""
