"""Plain Locust users see every kvops option: on the parser itself (Locust's web UI lists only
those, locust/argument_parser.py ``args_included_in_web_ui``), each settable as KVOPS_<NAME>.
Run in a subprocess: importing Locust monkey-patches the process with gevent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import json
from locust import argument_parser as ap
from kvops.loadtest.scenarios import glue
parser = ap.get_empty_argument_parser()
ap.setup_parser_arguments(parser)
glue.add_arguments(parser)
opts = parser.parse_args([])
kvops = [a for a in parser._actions if a.dest.startswith("kvops_")]
print(json.dumps({
    "all": sorted(a.dest for a in kvops),
    "ui": sorted(d for d in parser.args_included_in_web_ui if d.startswith("kvops_")),
    "secret": sorted(parser.secret_args_included_in_web_ui),
    "groups": [g.title for g in parser._action_groups if any(a in kvops for a in g._group_actions)],
    "help": all(a.help for a in kvops),
    "values": {"users": opts.kvops_users, "rate": opts.kvops_rate, "model": opts.kvops_model,
               "key": opts.kvops_api_key, "header": opts.kvops_header},
}))
"""


def _probe(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVOPS_")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True,
                         text=True, check=True, timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_every_kvops_option_is_on_the_web_ui_with_help_and_the_key_masked():
    seen = _probe()
    assert seen["ui"] == seen["all"]
    assert {"kvops_users", "kvops_api_key", "kvops_header", "kvops_model"} <= set(seen["all"])
    assert "kvops_processes" not in seen["all"]  # derived from the runner, no flag
    assert seen["secret"] == ["kvops_api_key"]
    assert seen["help"]
    assert "kvops" not in seen["groups"]  # an argument group hides options from the web UI


def test_every_kvops_option_reads_its_environment_variable():
    seen = _probe(KVOPS_USERS="7", KVOPS_RATE="2.5", KVOPS_MODEL="served", KVOPS_API_KEY="k",
                  KVOPS_HEADERS="X-A: 1\nX-B: 2")
    assert seen["values"] == {"users": 7, "rate": 2.5, "model": "served", "key": "k",
                              "header": ["X-A: 1\nX-B: 2"]}
