"""fp8 KV on an AMX CPU: the worker asks Linux for AMX tile state before vLLM's attention uses it.

Linux lets a process execute AMX tile instructions only after it asked for the XTILEDATA state
(``arch_prctl(ARCH_REQ_XCOMP_PERM)``); without it the first one raises SIGILL. oneDNN asks when
it first picks an AMX GEMM, for large enough matrices. vLLM 0.32's CPU attention runs AMX tiles
for fp8 KV without asking (its ``amx`` ISA: a bfloat16 model, block size a multiple of 32,
vllm/v1/attention/backends/cpu_attn.py ``_get_attn_isa``). With ``--enforce-eager``, whose start
runs no large compiled warm-up, a first request of a few tokens reaches that attention before any
AMX GEMM: the worker dies on signal 4 and the server answers 500 from then on.

Measured on an Intel Xeon with AMX (amx_bf16/int8/tile), stock vLLM 0.32.0 without the plugin:
fp8 KV, --enforce-eager, a first request of 1 or 2 tokens: VllmWorker-0 exited with -4; a first
request of 600 tokens and any after it: served; --dtype float32 (vLLM's ``vec`` attention):
served; the same server with ``torch.cpu._init_amx()`` run in each process first (PyTorch's
wrapper of that request): served. So the plugin makes that request in the worker of every server
with fp8 KV on a CPU that has AMX, with or without kvops settings (it changes nothing else); the
request cannot fail a start: an error is logged, never raised.
"""

from __future__ import annotations

from typing import Any

_DONE = False


def request_amx_for_fp8(vllm_config: Any) -> None:
    """Once per process: on the CPU platform, with fp8 KV and AMX, request the AMX tile state."""
    global _DONE
    if _DONE:
        return
    _DONE = True
    from kvops.core.fp8.scales import normalize_fp8_dtype

    if normalize_fp8_dtype(str(vllm_config.cache_config.cache_dtype)) is None:
        return
    from vllm.platforms import current_platform

    from kvops.plugin._compat import plugin_logger

    if not current_platform.is_cpu():
        return
    try:
        import torch

        if not torch.cpu._is_amx_tile_supported():
            return
        granted = bool(torch.cpu._init_amx())
    except Exception as exc:  # a guest never fails a start: say so and let vLLM run as it would
        plugin_logger().error("kvops fp8: could not request AMX tile state (%s); a first short "
                              "request may kill this worker with SIGILL under --enforce-eager", exc)
        return
    plugin_logger().info("kvops fp8: requested AMX tile state for this worker (%s): vLLM's AMX "
                         "attention with fp8 KV uses it before anything else asks",
                         "granted" if granted else "refused by the kernel")


def reset_for_tests() -> None:
    global _DONE
    _DONE = False
