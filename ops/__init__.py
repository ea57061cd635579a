"""Capacity model, diagnosis, calibration and the ``kvops`` CLI; never imports vLLM or torch."""
