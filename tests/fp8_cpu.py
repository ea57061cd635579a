"""Can vLLM run fp8 KV on this machine's CPU? vLLM's own answer, as the oracle for tests.

vLLM's CPU attention refuses fp8 KV unless torch reports AVX-512 or AMX
(vllm/v1/attention/backends/cpu_attn.py ``_get_attn_isa``: "FP8 KV cache on CPU requires x86
with AVX-512 or AMX"). On such a CPU, tests that serve fp8 KV cannot run; each one skipped with
``needs_fp8_cpu`` is paired with a test that checks the refusal here instead
(tests/e2e/test_fp8_validation_e2e.py, tests/ops/test_doctor.py).
"""

from __future__ import annotations

import pytest
import torch

CPU_RUNS_FP8: bool = bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())

VLLM_REFUSAL = "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"
"""What vLLM alone says on a CPU without them (cpu_attn.py ``_get_attn_isa``)."""

needs_fp8_cpu = pytest.mark.skipif(
    not CPU_RUNS_FP8,
    reason="serves fp8 KV: vLLM refuses it on this CPU (no AVX-512/AMX); the refusal is "
    "checked by test_fp8_validation_e2e.py::test_vllm_alone_refuses_fp8_on_this_cpu",
)
