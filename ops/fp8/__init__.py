"""FP8 KV on the ops side: calibration against a live server, accuracy scoring, test models."""
