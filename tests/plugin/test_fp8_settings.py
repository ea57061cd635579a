"""The kv_scales settings section (pure pydantic; no server)."""

from __future__ import annotations

import pytest

from kvops.core.errors import KvopsPluginError
from kvops.core.settings import load_settings


def test_a_path_string_is_short_for_a_scales_file():
    settings = load_settings({"kvops": {"kv_scales": "scales.json"}})
    assert settings is not None
    assert settings.kv_scales is not None
    assert settings.kv_scales.path == "scales.json"
    assert settings.kv_scales.override_checkpoint is False
    assert "fp8_scales" in settings.features()


def test_recording_mode_and_override_flag():
    settings = load_settings({"kvops": {"kv_scales": {"record": "/tmp/rec"}}})
    assert settings is not None
    assert settings.kv_scales is not None
    assert settings.kv_scales.record == "/tmp/rec"
    forced = load_settings({"kvops": {"kv_scales": {"path": "s.json", "override_checkpoint": True}}})
    assert forced is not None
    assert forced.kv_scales is not None
    assert forced.kv_scales.override_checkpoint is True


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"path": "s.json", "record": "/tmp/r"}, "exactly one of 'path'"),
        ({}, "exactly one of 'path'"),
        ({"path": "s.json", "scale": 2}, "kv_scales.scale"),
    ],
)
def test_bad_sections_name_the_problem(section, message):
    with pytest.raises(KvopsPluginError, match=message):
        load_settings({"kvops": {"kv_scales": section}})
