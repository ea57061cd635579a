"""`kvops loadtest` and `kvops diagnose` refuse bad input with one line and exit 2, before any
process starts."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvops.ops.cli.main import app

URL = "http://127.0.0.1:9"  # nothing listens: bad input must be caught before any connection


def _run(*args: str):
    return CliRunner().invoke(app, list(args))


def test_unknown_scenario():
    res = _run("loadtest", "oom", "--url", URL)
    assert res.exit_code == 2
    assert "No such command 'oom'" in res.output  # scenarios are subcommands: a closed choice


def test_scenario_file_with_unknown_key_names_key_and_file(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("steps: [1, 2]\nstepz: 3\n")
    res = _run("loadtest", "kv-exhaustion", "--url", URL, "--scenario-file", str(path))
    assert res.exit_code == 2
    assert "stepz" in res.output
    assert str(path) in res.output


@pytest.mark.parametrize(("line", "expected"), [
    ('{"model": "m"}', "neither 'prompt' nor 'messages'"),
    ("not json", "not JSON"),
    ('{"prompt": ["a", "b"]}', "request 2: 'prompt' is a batch of 2 prompts"),
    ('{"prompt": [[1, 2], [3]]}', "request 2: 'prompt' is a batch of 2 prompts"),
])
def test_bad_dataset_line(tmp_path, line, expected):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n" + line + "\n")
    res = _run("loadtest", "prefix-miss", "--url", URL, "--dataset", str(path))
    assert res.exit_code == 2
    assert expected in res.output
    assert str(path) in res.output


def test_rate_only_for_ttft_regression():
    res = _run("loadtest", "kv-exhaustion", "--url", URL, "--rate", "2")
    assert res.exit_code == 2
    assert "--rate applies to ttft-regression only" in res.output


def test_baseline_must_be_a_ttft_result(tmp_path):
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"scenario": "prefix-miss", "verdicts": []}))
    res = _run("loadtest", "ttft-regression", "--url", URL, "--baseline", str(path))
    assert res.exit_code == 2
    assert "not a ttft-regression result" in res.output


def test_diagnose_bad_result_file(tmp_path):
    path = tmp_path / "r.json"
    path.write_text("{}")
    res = _run("diagnose", "--url", URL, "--result", str(path))
    assert res.exit_code == 2
    assert "no 'verdicts' list" in res.output


def test_diagnose_unreachable_server_is_an_error_not_a_traceback():
    res = _run("diagnose", "--url", URL, "--window", "0")
    assert res.exit_code == 1
    assert "cannot read" in res.output
    assert "Traceback" not in res.output


def test_unreachable_server_fails_in_one_line_before_locust_starts(tmp_path):
    res = _run("loadtest", "prefix-miss", "--url", URL, "--out", str(tmp_path / "out"))
    assert res.exit_code == 1
    assert "cannot list models at http://127.0.0.1:9/v1/models" in res.output
    assert not (tmp_path / "out").exists()


def test_expect_must_be_a_plan_and_only_for_kv_exhaustion(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"num_blocks": "many"}')
    res = _run("loadtest", "kv-exhaustion", "--url", URL, "--expect", str(path))
    assert res.exit_code == 2
    assert str(path) in res.output
    assert "kvops plan --json" in res.output
    assert "Traceback" not in res.output
    path.write_text('{"num_blocks": 12, "block_size": 128}')
    res = _run("loadtest", "prefix-miss", "--url", URL, "--expect", str(path))
    assert res.exit_code == 2
    assert "kv-exhaustion only" in res.output


@pytest.mark.parametrize(("args", "expected"), [
    (("--header", "X-Team search"), "'Name: value'"),
    (("--url", "127.0.0.1:8000"), "base URL"),
])
def test_bad_header_or_url_is_refused_before_any_connection(tmp_path, args, expected):
    url_args = () if "--url" in args else ("--url", URL)
    res = _run("loadtest", "prefix-miss", *url_args, *args, "--out", str(tmp_path / "out"))
    assert res.exit_code == 2, res.output
    assert expected in res.output
    assert not (tmp_path / "out").exists()


def test_locustfile_prints_a_path_locust_can_load():
    res = _run("loadtest", "locustfile", "kv-exhaustion")
    assert res.exit_code == 0
    path = res.stdout.strip()
    assert path.endswith("kv_exhaustion.py")
    assert "glue.wire(\"kv-exhaustion\")" in open(path).read()


def test_a_dataset_prompt_batch_of_one_is_that_prompt(tmp_path):
    from kvops.loadtest.scenarios.workloads import load_dataset

    path = tmp_path / "d.jsonl"
    rows = [{"prompt": ["one prompt"]}, {"prompt": [[5, 6, 7]]}, {"prompt": [5, 6, 7]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [b["prompt"] for b in load_dataset(path)] == ["one prompt", [5, 6, 7], [5, 6, 7]]
