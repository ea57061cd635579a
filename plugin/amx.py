"""An AMX CPU: the process that runs the model asks Linux for AMX tile state before vLLM's
attention uses it.

Linux lets a process execute AMX tile instructions only after it asked for the XTILEDATA state
(``arch_prctl(ARCH_REQ_XCOMP_PERM)``); without it the first one raises SIGILL. oneDNN asks when
it first picks an AMX GEMM, for large enough matrices. vLLM 0.32's CPU attention runs AMX tiles
without asking (its ``amx`` ISA: a bfloat16 model, block size a multiple of 32,
vllm/v1/attention/backends/cpu_attn.py ``_get_attn_isa``). With ``--enforce-eager``, whose start
runs no large compiled warm-up, a first request of a few tokens reaches that attention before any
AMX GEMM: the process dies on signal 4 and the server answers 500 from then on.

Measured on an Intel Xeon with AMX (amx_bf16/int8/tile), stock vLLM 0.32.0 without the plugin,
the tiny bf16 Llama under --enforce-eager: with fp8 KV, a first request of 1 or 2 tokens:
VllmWorker-0 exited with -4; a first request of 600 tokens and any after it: served; --dtype
float32 (vLLM's ``vec`` attention): served; ``torch.cpu._init_amx()`` (PyTorch's wrapper of that
request) run in each process first: served. With bf16 KV, a first request of 3 tokens ("the
cache holds") killed the engine the same way (tests/e2e/test_guest_e2e.py, where kvops stays
out). So the plugin makes that request in the process that loads the model on every CPU with
AMX, with or without kvops settings (it changes nothing else); it cannot fail a start: an error is
logged, never raised.
"""

from __future__ import annotations

_DONE = False


def request_amx() -> None:
    """Once per process: on the CPU platform with AMX, request the AMX tile state."""
    global _DONE
    if _DONE:
        return
    _DONE = True
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
        plugin_logger().error("kvops: could not request AMX tile state (%s); a first short "
                              "request may kill this process with SIGILL under --enforce-eager", exc)
        return
    plugin_logger().info("kvops: requested AMX tile state for the process that runs the model "
                         "(%s): vLLM's AMX attention uses it before anything else asks",
                         "granted" if granted else "refused by the kernel")
