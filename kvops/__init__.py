"""vllm-kvops: KV-cache operations for vLLM.

The distribution maps three folders onto this namespace: ``plugin/`` (code that runs inside
vLLM), ``ops/`` (capacity model, diagnosis, calibration, CLI) and ``loadtest/`` (Locust).
"""

__version__ = "0.1.0"
