"""kvops settings: what `--additional-config '{"kvops": ...}'` and kvops.yaml accept."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvops.core.errors import KvopsPluginError
from kvops.core.settings import FEATURE_FIELDS, KvopsSettings, load_settings


def test_absent_kvops_key_means_not_configured():
    assert load_settings(None) is None
    assert load_settings({}) is None
    assert load_settings({"other_plugin": {"x": 1}}) is None


def test_empty_mapping_is_configured_with_no_features():
    settings = load_settings({"kvops": {}})
    assert settings is not None
    assert settings.features() == ()


def test_unknown_key_names_the_key_and_the_source():
    with pytest.raises(KvopsPluginError) as err:
        load_settings({"kvops": {"nope": 1}})
    message = str(err.value)
    assert "unknown key 'nope'" in message
    assert "--additional-config kvops" in message
    assert "\n" not in message


def test_not_a_mapping_is_rejected():
    with pytest.raises(KvopsPluginError, match="expected a mapping"):
        load_settings({"kvops": [1, 2]})


def test_missing_yaml_names_the_file(tmp_path: Path):
    missing = tmp_path / "absent.yaml"
    with pytest.raises(KvopsPluginError, match=f"kvops config file '{missing}' not found"):
        load_settings({"kvops": {"config": str(missing)}})


def test_yaml_errors_name_the_file(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [unclosed\n")
    with pytest.raises(KvopsPluginError, match=f"{bad}: not valid YAML"):
        load_settings({"kvops": {"config": str(bad)}})
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(KvopsPluginError, match="expected a mapping"):
        load_settings({"kvops": {"config": str(listy)}})


def test_unknown_key_inside_yaml_names_the_file(tmp_path: Path):
    cfg = tmp_path / "kvops.yaml"
    cfg.write_text("surprise: true\n")
    with pytest.raises(KvopsPluginError) as err:
        load_settings({"kvops": {"config": str(cfg)}})
    assert str(cfg) in str(err.value)
    assert "unknown key 'surprise'" in str(err.value)


def test_yaml_may_not_chain_to_another_file(tmp_path: Path):
    cfg = tmp_path / "kvops.yaml"
    cfg.write_text("config: other.yaml\n")
    with pytest.raises(KvopsPluginError, match="may not name another file"):
        load_settings({"kvops": {"config": str(cfg)}})


def test_every_feature_names_a_real_settings_field():
    for feature, field in FEATURE_FIELDS.items():
        assert field in KvopsSettings.model_fields, (feature, field)
