"""Our streaming user stamps TTFT at the first event, not after 1 KiB has arrived.

A real Locust process drives a loopback SSE server that sends one ~150-byte token event and
then pauses. Locust's own iter_lines (the oracle for the trap) reads the first token
only after the pause; ours must read it before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_first_event_is_timed_before_the_pause(tmp_path, pausing_server):
    pause_s, tokens = pausing_server.pause_s, pausing_server.tokens
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(HERE / "batching_locustfile.py"),
         "--headless", "-u", "2", "-r", "2", "-t", "5s", "--host", pausing_server.url,
         "--only-summary", "--stop-timeout", "3"],
        env={**os.environ, "KVOPS_TEST_OUT": str(out)}, capture_output=True, text=True,
        timeout=120, cwd=HERE.parents[1],
    )
    assert out.exists(), proc.stderr[-3000:]
    data = json.loads(out.read_text())
    ours = [r for r in data["ours"] if r["ok"]]
    assert ours, data
    assert data["naive"], "the oracle (Locust iter_lines) measured nothing"
    # the trap is real here: Locust's helper only sees the first token after the pause
    assert min(data["naive"]) >= pause_s * 0.9
    for record in ours:
        assert record["ttft_s"] < pause_s / 2
        assert record["e2e_s"] >= pause_s  # full request time, not time to headers
        assert record["completion_tokens"] == tokens
        assert record["content_events"] == tokens
        assert record["itl_s"][0] >= pause_s * 0.9  # the pause shows up as the first gap
        assert record["error"] is None
