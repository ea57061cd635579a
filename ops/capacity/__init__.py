"""Capacity planning that agrees with vLLM 0.32's own KV allocator, without importing vLLM.

``model`` turns a config.json into per-layer KV specs, ``allocator`` reproduces vLLM's block
size, grouping and block-count arithmetic, ``formula`` is the textbook per-token view, ``plan``
turns a GPU and a workload into serve flags, and ``verify`` compares a plan with a live server.
"""
