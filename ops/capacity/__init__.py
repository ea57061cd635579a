"""Capacity planning that agrees with vLLM 0.32's own KV allocator, without importing vLLM.

``model`` turns a config.json into per-layer KV specs (drafter layers included; ``layers``,
``mamba``, ``indexer`` for DeepSeek-V3.2 sparse MLA, ``gemma4`` for per-layer head dims and
``speculative`` for what K speculative tokens add are its parts), ``allocator``
reproduces vLLM's block size, grouping, pipeline-parallel split and block-count arithmetic,
``formula`` is the textbook per-token view, ``workload`` reads request-length quantiles or files,
``plan`` turns a GPU and a workload into serve flags, ``offload`` sizes LMCache tiers from the
prefix working set, ``outputs`` renders the serve line and the validated kvops.yaml,
``calibration`` reads the non-KV memory a real server measured, and ``verify`` compares a plan
with a live server.
"""
