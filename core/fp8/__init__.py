"""FP8 KV scales: the scale file format and the settings schema (no vLLM, no torch)."""
