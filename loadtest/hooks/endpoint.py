"""The server as this run reaches it (URL, API key, headers), built once per run from the
options and hung off the Environment, for the users, the scraper and the tokenizer alike."""

from __future__ import annotations

import os

from locust.env import Environment

from kvops.core.endpoint import API_KEY_ENV, Endpoint, endpoint


def endpoint_of(environment: Environment) -> Endpoint:
    """--kvops-api-key (else $OPENAI_API_KEY) and --kvops-header, on the run's host."""
    found = getattr(environment, "kvops_endpoint", None)
    if found is None:
        opts = environment.parsed_options
        key = getattr(opts, "kvops_api_key", "") or os.environ.get(API_KEY_ENV) or None
        found = endpoint(str(environment.host), api_key=key, headers=getattr(opts, "kvops_header", None))
        environment.kvops_endpoint = found  # type: ignore[attr-defined]
    assert isinstance(found, Endpoint)
    return found
