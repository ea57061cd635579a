"""kvops.core.files.read_mapping: each way a mapping file can be wrong is one BadInputError line
naming the file (exit 2 at the CLI boundary)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvops.core.errors import EXIT_BAD_INPUT, BadInputError
from kvops.core.files import read_mapping


def test_yaml_and_json_mappings_are_read(tmp_path: Path):
    (tmp_path / "a.yaml").write_text("x: 1\ny: [a, b]\n")
    (tmp_path / "b.json").write_text('{"x": 1}')
    (tmp_path / "empty.yaml").write_text("")
    assert read_mapping(tmp_path / "a.yaml") == {"x": 1, "y": ["a", "b"]}
    assert read_mapping(tmp_path / "b.json") == {"x": 1}
    assert read_mapping(tmp_path / "empty.yaml") == {}


@pytest.mark.parametrize(("name", "text", "message"), [
    ("bad.yaml", "x: [1\n", "not valid YAML"),
    ("bad.json", "{x: 1}", "not valid JSON"),
    ("list.yaml", "- 1\n- 2\n", "expected a mapping at the top level, got list"),
    ("list.json", "[1]", "expected a JSON object at the top level, got list"),
    ("empty.json", "", "not valid JSON"),
])
def test_malformed_files_name_the_file_and_the_fault(tmp_path: Path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(BadInputError, match=message) as info:
        read_mapping(path, "--config")
    assert str(info.value).startswith(f"--config {path}: ")
    assert "\n" not in str(info.value)
    assert info.value.exit_code == EXIT_BAD_INPUT


def test_missing_and_unreadable_files(tmp_path: Path):
    with pytest.raises(BadInputError, match=r"none\.yaml: cannot read it \(No such file or directory\)"):
        read_mapping(tmp_path / "none.yaml")
    with pytest.raises(BadInputError, match="cannot read it"):
        read_mapping(tmp_path)  # a directory
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(BadInputError, match="bin.yaml: cannot read it"):
        read_mapping(tmp_path / "bin.yaml")
