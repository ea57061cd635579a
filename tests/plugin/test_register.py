"""register() as vLLM calls it: once per process, possibly twice, cheap and idempotent."""

from __future__ import annotations

import pytest

import kvops.plugin as plugin
from kvops.core.settings import KvopsSettings


@pytest.fixture
def platform_cls():
    from vllm.platforms import current_platform

    cls = type(current_platform)
    original = cls.__dict__["check_and_update_config"]
    plugin.reset_for_tests()
    yield cls
    cls.check_and_update_config = original
    plugin.reset_for_tests()


def test_register_twice_wraps_the_config_hook_once(platform_cls):
    plugin.register()
    first = platform_cls.__dict__["check_and_update_config"]
    plugin.register()
    assert platform_cls.__dict__["check_and_update_config"] is first
    plugin.reset_for_tests()  # a second module-level registration in the same process
    plugin.register()
    assert platform_cls.__dict__["check_and_update_config"] is first
    assert getattr(first.__func__, "_kvops_wrapped", False)


def test_bad_settings_stop_config_with_exit_code_2(platform_cls, capsys):
    plugin.register()

    class FakeConfig:  # only the attribute our hook reads before the platform's own hook
        additional_config = {"kvops": {"nope": 1}}

    with pytest.raises(SystemExit) as stop:
        platform_cls.check_and_update_config(FakeConfig())
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvops: refusing to start: --additional-config kvops: unknown key 'nope' (known keys: "
                   + ", ".join(sorted(KvopsSettings.model_fields)) + ")"]
