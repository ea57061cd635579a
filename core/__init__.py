"""kvops.core: the contracts the plugin, the ops CLI and the load tests share.

It imports no other kvops package and never vLLM, torch, LMCache, Typer or Locust (import-linter
checks this in ``make lint``): errors, the settings schemas of every plugin section, admission
policy arithmetic, fp8 scale files, offload checks that need no LMCache, Prometheus text reading,
verdicts, the typed plan and small process helpers.
"""
