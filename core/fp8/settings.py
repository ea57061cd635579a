"""The ``kv_scales`` section of the kvops settings.

``{"kv_scales": "scales.json"}`` is short for ``{"kv_scales": {"path": "scales.json"}}``.
``{"kv_scales": {"record": DIR}}`` is the recording mode ``kvops calibrate`` starts: workers
write per-layer K/V statistics under DIR and no scale is changed.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class KvScalesSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # NaN/inf: never a setting

    path: str | None = None
    """A scales file written by ``kvops calibrate``."""
    override_checkpoint: bool = False
    """Use the file's scales even when the checkpoint carries its own k/v scales."""
    record: str | None = None
    """Recording mode: directory where workers write K/V statistics (calibration)."""

    @model_validator(mode="before")
    @classmethod
    def _path_shorthand(cls, data: Any) -> Any:
        return {"path": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _one_mode(self) -> KvScalesSettings:
        if (self.path is None) == (self.record is None):
            raise ValueError("give exactly one of 'path' (a scales file) or 'record' (a directory)")
        return self
