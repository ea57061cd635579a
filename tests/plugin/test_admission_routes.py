"""The start-up audit of the app's routes: a POST route kvops does not know is logged loudly."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI

from kvops.plugin.admission.routes import GENERATING_UNGUARDED, audit_app


def test_unknown_and_unguarded_generation_routes_are_logged_loudly(caplog: pytest.LogCaptureFixture):
    app = FastAPI()
    for path in ("/v1/completions", "/v1/chat/completions/batch", "/tokenize", "/v1/new_generate",
                 "/v1/audio/transcriptions", "/inference/v1/generate"):
        app.add_api_route(path, lambda: None, methods=["POST"])
    app.add_api_route("/v1/models", lambda: None, methods=["GET"])
    log = logging.getLogger("kvops-test-routes")
    with caplog.at_level(logging.ERROR, logger="kvops-test-routes"):
        unknown = audit_app(app, log)
    assert unknown == ["/v1/new_generate", "/v1/audio/transcriptions"]  # generate is guarded
    assert "/v1/audio/transcriptions" in GENERATING_UNGUARDED
    assert caplog.text.count("bypass the KV front door") == 2
