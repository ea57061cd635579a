"""How kvops reaches a server that is not ours: URL, API key, a proxy's headers."""

from __future__ import annotations

import pytest

from kvops.core.endpoint import check_url, endpoint, header_lines, parse_header
from kvops.core.errors import BadInputError


def test_api_key_becomes_a_bearer_header_and_wins_over_a_given_authorization():
    ep = endpoint("https://staging.example.com/", api_key="sk-1",
                  headers=["X-Team: search", "Authorization: Basic abc"])
    assert ep.url == "https://staging.example.com"
    assert ep.header_dict() == {"X-Team": "search", "Authorization": "Bearer sk-1"}
    assert "sk-1" not in repr(ep)


def test_a_header_value_may_hold_colons():
    assert parse_header("X-Forwarded-For: http://a:80") == ("X-Forwarded-For", "http://a:80")


@pytest.mark.parametrize("bad", ["no colon", ": empty name", "Two words: x"])
def test_a_malformed_header_names_itself(bad):
    with pytest.raises(BadInputError, match="'Name: value'") as info:
        parse_header(bad)
    assert bad in str(info.value)


@pytest.mark.parametrize("bad", ["127.0.0.1:8000", "ftp://host", "http://"])
def test_url_needs_http_or_https_and_a_host(bad):
    with pytest.raises(BadInputError, match="base URL"):
        check_url(bad)


def test_header_lines_from_a_repeated_option_or_one_newline_separated_string():
    assert header_lines(None) == []
    assert header_lines(["A: 1", "B: 2\nC: 3"]) == ["A: 1", "B: 2", "C: 3"]
    assert header_lines("A: 1\n\nB: 2") == ["A: 1", "B: 2"]
