"""Plugin unit tests run without vLLM's config hook, which names the model every kvops series is
labelled with: bind one here, as the hook does in a server."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvops.plugin import metrics

MODEL_NAME = "unit-model"


@pytest.fixture(autouse=True)
def _bound_model_name() -> None:
    metrics.bind_model_name(SimpleNamespace(
        model_config=SimpleNamespace(model="/models/unit", served_model_name=MODEL_NAME)))
