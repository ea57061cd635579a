"""Watch of the local disk tier while vLLM serves: full or read-only is loud, and recovery too.

LMCache keeps serving when its fs_native directory fills up or turns read-only, but says little:
lmcache 0.5.6 logs one WARNING per failed store that lists the keys without the reason (the
native adapter drops the OS error, l2_adapters/native_connector_l2_adapter.py ``_demux_loop``)
and no metric counts the failures. Requests still complete (L1 keeps the prefixes, misses
recompute), so nothing else would tell the operator that the disk tier stopped growing. The
front end therefore probes the directory with the same synced write as the preflight.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from kvops.core.offload.preflight import disk_write_problem

logger = logging.getLogger("vllm.plugins.kvops.offload")


class DiskWatch:
    """Remembers the last probe's verdict; logs and publishes only the transitions."""

    def __init__(self, directory: Path, degraded_gauge: Any) -> None:
        self.directory = directory
        self.degraded_gauge = degraded_gauge
        self.problem: str | None = None
        degraded_gauge.set(0)

    def check(self) -> str | None:
        problem = disk_write_problem(self.directory)
        if problem != self.problem:
            if problem is None:
                logger.warning("kvops offload: disk tier %s takes writes again; LMCache stores "
                               "to disk resumed (kvops_offload_disk_degraded=0)", self.directory)
            else:
                logger.error(
                    "kvops offload DISK DEGRADED: the disk tier %s refuses writes (%s); LMCache "
                    "cannot store new prefixes there, requests keep completing from L1 or by "
                    "recompute (kvops_offload_disk_degraded=1): free space or remount it "
                    "read-write", self.directory, problem,
                )
            self.problem = problem
        self.degraded_gauge.set(0 if problem is None else 1)
        return problem
