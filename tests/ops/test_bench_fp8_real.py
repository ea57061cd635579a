"""``kvops bench fp8``'s real-model section reads text a Debian package ships, and calibrates and
evaluates on disjoint passages (the accuracy figures themselves are the bench's, not a test's)."""

from __future__ import annotations

from kvops.ops.bench import fp8_real


def test_calibration_and_evaluation_passages_are_disjoint_license_text() -> None:
    calibration = fp8_real.paragraphs(fp8_real.CALIBRATION_TEXT, fp8_real.CALIBRATION_PASSAGES)
    evaluation = [p for name in fp8_real.EVALUATION_TEXTS for p in fp8_real.paragraphs(name, 100)]
    assert len(calibration) == fp8_real.CALIBRATION_PASSAGES
    assert len(evaluation) >= fp8_real.EVALUATION_PASSAGES
    assert not set(calibration) & set(evaluation)
    assert all(len(p.split()) >= 40 for p in calibration + evaluation)
