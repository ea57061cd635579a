"""KV-budget admission inside vLLM: the scheduler subclasses, the HTTP front door, the wiring.

``--scheduler-cls kvops.plugin.admission.KVBudgetScheduler`` (or ``KVBudgetAsyncScheduler``)
resolves here; the classes are imported on first use, since importing them imports vLLM's
scheduler, which the front door and the wiring do not need.
"""

from __future__ import annotations

from typing import Any

_SCHEDULERS = ("KVBudgetScheduler", "KVBudgetAsyncScheduler")


def __getattr__(name: str) -> Any:
    if name in _SCHEDULERS:
        from kvops.plugin.admission import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
