"""Self-contained measurements behind `kvops bench NAME --json`."""
