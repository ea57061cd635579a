"""The huge-page policy of this machine's /dev/shm as util-linux reads it: the oracle for the
preflight's and ``kvops doctor``'s own reading (kvops.core.offload.preflight.shm_huge_pages)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SHMEM_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")


def findmnt_huge_policy() -> str | None:
    """findmnt's ``huge=`` option of /dev/shm ("never" when absent), the kernel's shmem_enabled
    deny/force over it, None when /dev/shm is not a tmpfs. Skips the calling test where there is
    no findmnt or no transparent huge pages (not Linux)."""
    if not shutil.which("findmnt") or not SHMEM_ENABLED.exists():
        pytest.skip("needs findmnt and a kernel with transparent huge pages (Linux)")
    listed = subprocess.run(["findmnt", "-no", "FSTYPE,OPTIONS", "/dev/shm"], check=True,
                            capture_output=True, text=True).stdout.splitlines()
    fstype, options = listed[-1].split()  # mounted over: the last one is what /dev/shm is
    if fstype != "tmpfs":
        return None
    override = next((p.strip("[]") for p in SHMEM_ENABLED.read_text().split()
                     if p in ("[deny]", "[force]")), None)
    huge = next((o.split("=", 1)[1] for o in options.split(",") if o.startswith("huge=")), "never")
    return override or huge
