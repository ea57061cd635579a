"""Calibrated FP8 KV: validate in the front end, apply per-layer scales and record K/V
absmax in the workers, publish what is in effect on /metrics.

settings.py is pure pydantic (the ops CLI reads it without vLLM); validate.py runs in the
front end; worker.py runs in every worker after the weights load.
"""
