"""How the e2e tests' serving vLLM servers run: the session pool's (conftest) and the staging
fleet's replicas (staging)."""

from __future__ import annotations

import os

SERVING_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0))),
}
"""The environment of the pool's serving servers and of the staging fleet's replicas: the worker runs inside the engine core, as
vLLM runs it on a GPU with one rank (vllm/config/parallel.py: "uni" when world_size is 1). On
the CPU vLLM otherwise forces the multiprocessing executor (vllm/platforms/cpu.py:335), a third
process that imports vLLM again: ~10 s of a core per start, a third of it. OMP_NUM_THREADS keeps
the model's threads at the cores' count, what that worker ran with (vllm/utils/torch_utils.py:
an engine core left to itself takes 1). The pool's refusals (``start_expecting_failure``) keep
the CPU's default, a worker that is the engine core's child, so both of refuse_in_engine's paths
run."""
