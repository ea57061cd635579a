"""`kvops fp8 check` on the real model (SmolLM2-135M-Instruct, conftest ``smollm2_model``) and
license text Debian ships, scales calibrated offline on other passages than the ones scored.

What must hold on a trained model, whatever the figures: it predicts English far better than
chance (a random model's perplexity is in the thousands), fp8 KV moves its predictions a little
but not nothing, and the verdict is the threshold applied to the printed figures. The accuracy
targets themselves live in the bench, not here."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kvops.core.fp8.scales import LayerScales, ScalesFile, fingerprint_of_config, read_model_config

pytestmark = pytest.mark.e2e

GPL = Path("/usr/share/common-licenses/GPL-3")


def _paragraphs() -> list[str]:
    paragraphs = [" ".join(p.split()) for p in GPL.read_text().split("\n\n")]
    return [p for p in paragraphs if len(p.split()) >= 40]


def test_check_on_smollm2(smollm2_model: Path, tmp_path: Path) -> None:
    from kvops.core.fp8.scales import scale_from_absmax
    from kvops.ops.fp8.offline import load_offline_model

    passages = _paragraphs()
    model = load_offline_model(smollm2_model)
    # absmax scales (one forward): the check reads whatever scales it is given, and the per-layer
    # search that kvops calibrate adds costs minutes of this CI's CPU (its figures: bench fp8)
    scales = [(scale_from_absmax(k, "fp8_e4m3"), scale_from_absmax(v, "fp8_e4m3"))
              for k, v in model.absmax(model.encode(passages[:6], 128))]  # calibration
    scales_file = ScalesFile(
        dtype="fp8_e4m3", model=fingerprint_of_config(read_model_config(smollm2_model)),
        layers={f"model.layers.{i}.self_attn.attn": LayerScales(k_scale=k, v_scale=v)
                for i, (k, v) in enumerate(scales)})
    (tmp_path / "scales.json").write_text(scales_file.model_dump_json())
    (tmp_path / "prompts.txt").write_text("\n".join(passages[6:9]) + "\n")  # held out
    proc = subprocess.run(  # noqa: S603 - our own CLI
        [str(Path(sys.executable).parent / "kvops"), "fp8", "check", "--model", str(smollm2_model),
         "--prompts", str(tmp_path / "prompts.txt"), "--scales", str(tmp_path / "scales.json"),
         "--max-tokens", "64", "--json"],
        capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode in (0, 3), proc.stderr
    result = json.loads(proc.stdout)
    assert result["bf16_perplexity"] < 100  # trained weights on English text
    calibrated = result["variants"]["fp8 calibrated"]
    assert 0 < calibrated["mean_kl"] < 0.1
    worst = max(calibrated["perplexity_ratio"], math.exp(calibrated["mean_kl"]))
    assert (result["verdict"] == "safe") == (worst <= result["threshold"])
    assert (proc.returncode == 3) == (result["verdict"] == "not safe")
