"""kvops settings as ``vllm serve`` receives them, validated before the engine starts.

Settings arrive as ``--additional-config '{"kvops": {...}}'``; ``{"kvops": {"config": "kvops.yaml"}}``
names a YAML file holding the same mapping, and inline keys override the file's. Unknown keys
are errors that name the key and where it came from. This module imports only pydantic and
yaml, so the ops CLI can write and check kvops.yaml without vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from kvops.core import kinds
from kvops.core.admission.settings import AdmissionSettings
from kvops.core.errors import BadInputError, KvopsPluginError
from kvops.core.fp8.settings import KvScalesSettings
from kvops.core.kinds import read_mapping_of_kind
from kvops.core.offload.settings import OffloadSettings

ADDITIONAL_CONFIG_KEY = "kvops"


# feature name (as kvops_info reports it) -> the settings field that switches it on
FEATURE_FIELDS: dict[str, str] = {
    "fp8_scales": "kv_scales",
    "offload": "offload",
    "admission": "admission",
}


class KvopsSettings(BaseModel):
    """Everything the plugin can be told. Each feature owns one optional field/section."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # NaN/inf: never a setting

    config: str | None = None
    """Path of a kvops.yaml whose mapping is merged under the inline keys."""
    kv_scales: KvScalesSettings | None = None
    """Calibrated fp8 KV scales (kvops.plugin.fp8): a scales file, or recording mode."""
    offload: OffloadSettings | None = None
    """LMCache CPU/SSD offload (kvops.plugin.offload); needs a running `kvops offload serve`."""
    admission: AdmissionSettings | None = None
    """KV-budget admission (kvops.plugin.admission): scheduler reservations, HTTP 400/429."""

    def features(self) -> tuple[str, ...]:
        """Names of the features these settings switch on, for metrics and logs."""
        return tuple(
            name for name, field in FEATURE_FIELDS.items() if getattr(self, field, None) is not None
        )


def parse_settings(raw: Any, source: str) -> KvopsSettings:
    """Validate one mapping; ``source`` names where it came from in error messages."""
    if not isinstance(raw, dict):
        raise KvopsPluginError(
            f"{source}: expected a mapping of kvops settings, got {type(raw).__name__}"
        )
    try:
        return KvopsSettings.model_validate(raw)
    except ValidationError as exc:
        raise KvopsPluginError(f"{source}: {_first_error(exc)}") from None


def load_settings(additional_config: dict[str, Any] | None) -> KvopsSettings | None:
    """Settings from vLLM's additional_config, or None when kvops is not configured."""
    if not additional_config or ADDITIONAL_CONFIG_KEY not in additional_config:
        return None
    inline = additional_config[ADDITIONAL_CONFIG_KEY]
    source = "--additional-config kvops"
    if inline is None:
        return None
    settings = parse_settings(inline, source)
    if settings.config is None:
        return settings
    merged = {**_read_yaml(Path(settings.config)), **inline}
    return parse_settings(merged, f"{source} + {settings.config}")


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise KvopsPluginError(
            f"kvops config file {str(path)!r} not found: fix the path in "
            '--additional-config \'{"kvops": {"config": ...}}\' (relative paths are from the '
            "server's working directory)"
        )
    try:
        data = read_mapping_of_kind(path, "", kinds.SETTINGS)
    except BadInputError as exc:  # the plugin's refusal to start carries the same line
        raise KvopsPluginError(str(exc)) from None
    if "config" in data:
        raise KvopsPluginError(f"{path}: 'config' may not name another file from inside one")
    return data


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(part) for part in err["loc"]) or "(top level)"
    if err["type"] == "extra_forbidden":
        allowed = ", ".join(sorted(_section_model(err["loc"][:-1]).model_fields))
        return f"unknown key {where!r} (known keys: {allowed})"
    return f"{where}: {err['msg']}"


def _section_model(loc: tuple[Any, ...]) -> type[BaseModel]:
    """The settings model a nested key belongs to, so its known keys can be listed."""
    model: type[BaseModel] = KvopsSettings
    for part in loc:
        field = model.model_fields.get(str(part))
        inner = [t for t in getattr(field.annotation, "__args__", (field.annotation,))
                 if isinstance(t, type) and issubclass(t, BaseModel)] if field else []
        if not inner:
            break
        model = inner[0]
    return model
