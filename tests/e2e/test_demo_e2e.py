"""`make demo` keeps working: the README's first command, run as a user runs it, on the real
model it serves (the session's SmolLM2 build, which the demo reuses as it reuses its own)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def test_demo_runs_end_to_end(tmp_path: Path, smollm2_model: Path):
    kvops = Path(sys.executable).with_name("kvops")
    out = subprocess.run(
        [str(kvops), "demo", "--work-dir", str(tmp_path), "--model-dir", str(smollm2_model)],
        capture_output=True, text=True, timeout=900, check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    # a trained model answers (its knowledge, not our code): the newcomer sees a real answer
    answer = re.search(r"^\[4/6\] asked 'What is the capital of France\?'; the model answered: '(.*)'$",
                       text, flags=re.M)
    assert answer is not None, text
    assert "Paris" in answer.group(1)
    # vLLM's own log line agrees with the planner's prediction.
    assert "— matches the plan" in text, text
    served = re.search(r"vLLM: 'CPU KV cache size: ([\d,]+) tokens", text)
    assert served is not None
    assert int(served.group(1).replace(",", "")) == 20 * 128
    # Every request of the burst (24 + the never-fits one) got an answer.
    answers = re.findall(r"^      (200|400|429|503): request (\d+)", text, flags=re.M)
    assert sorted(int(i) for _, i in answers) == list(range(25))
    assert ("400", "24") in answers
    assert re.search(r"^      vllm:num_preemptions_total\{\} 0$", text, flags=re.M), text
    assert 'kvops_info{config_file="' in text
    assert "server stopped" in text
