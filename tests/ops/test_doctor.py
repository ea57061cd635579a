"""kvops doctor against this real environment and against inputs that must fail."""

from __future__ import annotations

import json
from pathlib import Path

from fp8_cpu import CPU_RUNS_FP8
from shm_mount import findmnt_huge_policy
from typer.testing import CliRunner

from kvops.ops.cli.main import app
from kvops.ops.doctor import DoctorInputs, check_fp8, check_offload_dir, check_shm

runner = CliRunner()


def test_this_environment_passes(tmp_path: Path):
    """make setup produced this venv; doctor must agree that it is complete. The one row it
    may fail is fp8 KV, exactly where vLLM itself refuses fp8 on this CPU."""
    result = runner.invoke(app, ["doctor", "--json", "--offload-dir", str(tmp_path)])
    rows = json.loads(result.stdout)["checks"]
    failing = [row["name"] for row in rows if row["status"] == "fail"]
    assert failing == ([] if CPU_RUNS_FP8 else ["fp8 KV"]), rows
    assert result.exit_code == (0 if CPU_RUNS_FP8 else 3)
    names = {row["name"] for row in rows}
    assert {"vllm", "vllm CLI", "torchvision trap", "fp8 KV", "lmcache", "/dev/shm", "offload dir"} <= names


def test_missing_offload_dir_fails_with_exit_3_and_a_fix(tmp_path: Path):
    missing = tmp_path / "nowhere"
    result = runner.invoke(app, ["doctor", "--offload-dir", str(missing)])
    assert result.exit_code == 3
    assert f"{missing} does not exist" in result.stdout
    assert f"fix: mkdir -p {missing}" in result.stdout


def test_offload_dir_without_room_fails(tmp_path: Path):
    row = check_offload_dir(DoctorInputs(offload_dir=tmp_path, disk_needed_gib=1e9))
    assert row.status == "fail"
    assert "GiB free" in row.found


def test_cpu_without_avx512_or_amx_cannot_run_fp8(tmp_path: Path):
    # A /proc/cpuinfo of an AVX2-only x86 machine (flags as the kernel prints them).
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma\n")
    row = check_fp8(DoctorInputs(offload_dir=tmp_path, cpuinfo=cpuinfo))
    assert row.status == "fail"
    assert "needs x86 with AVX-512 or AMX" in row.found
    assert "drop --kv-cache-dtype fp8" in row.fix


def test_fp8_row_matches_this_cpu(tmp_path: Path):
    """Doctor reads /proc/cpuinfo; vLLM asks torch (fp8_cpu.py). They must agree."""
    row = check_fp8(DoctorInputs(offload_dir=tmp_path))  # the row run_checks reports
    assert (row.status == "ok") == CPU_RUNS_FP8, row
    if not CPU_RUNS_FP8:
        assert row.status == "fail"
        assert "needs x86 with AVX-512 or AMX" in row.found
        assert row.fix == "drop --kv-cache-dtype fp8 or run on an AVX-512/AMX machine"


def test_shm_row_warns_without_huge_pages_as_findmnt_sees_the_mount(tmp_path: Path):
    """Oracle: util-linux's findmnt on /dev/shm, the kernel's shmem_enabled deny/force over it.
    No huge pages is a warning with what gives them, never a failure."""
    huge = findmnt_huge_policy()
    row = check_shm(DoctorInputs(offload_dir=tmp_path, shm_needed_gib=0.001))
    if huge in ("never", "advise", "deny"):
        assert (row.status, f"huge={huge}") == ("warn", row.found.split("(")[-1].rstrip(")"))
        assert ("shmem_enabled is deny" if huge == "deny" else
                "mount -o remount,huge=within_size /dev/shm") in row.fix
    else:
        assert row.status == "ok"
        assert row.found.endswith(f"huge pages {huge}")
