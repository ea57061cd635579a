"""Self-contained measurements against real local servers (``kvops bench NAME --json``).

Each module here exposes ``run(**options) -> dict`` returning the JSON object whose keys
DESIGN.md fixes: ratios measured side by side in one run, plus the raw figures.
"""
