"""A stream whose tokens all carry empty text (a detokenizer holding partial UTF-8 back to the
end, common with random tiny models) is a success with a first-event time and no first-text
time, not a failed request. A real Locust process drives the fake SSE server of the loadgen
bench, told to send empty text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvops.core.proc import free_port
from kvops.ops.launch import ManagedServer

HERE = Path(__file__).parent
EVENTS = 6


def test_stream_without_text_is_ok_with_a_first_event(tmp_path):
    port = free_port()
    server = ManagedServer(name="fake-sse", port=port, log_path=tmp_path / "fake.log",
                           env=dict(os.environ), argv=[sys.executable, "-m", "kvops.ops.bench.fake_sse",
                                                       str(port), str(EVENTS), "5", ""])
    server.start(health_path="/v1/models", timeout_s=60)
    out = tmp_path / "out.json"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(HERE / "batching_locustfile.py"),
             "--headless", "-u", "1", "-r", "1", "-t", "3s", "--host", server.url, "OurUser",
             "--only-summary", "--stop-timeout", "3"],
            env={**os.environ, "KVOPS_TEST_OUT": str(out)}, capture_output=True, text=True,
            timeout=120, cwd=HERE.parents[1],
        )
    finally:
        server.stop()
    assert out.exists(), proc.stderr[-3000:]
    ours = [r for r in json.loads(out.read_text())["ours"] if not r["stopped"]]
    assert ours
    for record in ours:
        assert record["ok"], record
        assert record["ttft_s"] is None
        assert record["content_events"] == 0
        assert 0 < record["first_event_s"] <= record["e2e_s"]
        assert record["completion_tokens"] == EVENTS
