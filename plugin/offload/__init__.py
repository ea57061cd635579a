"""CPU/SSD KV offload through LMCache's multi-process server, wrapped so that it either works
or refuses to start with the reason.

Modules: ``settings`` (the ``offload`` section of kvops settings, pydantic only), ``preflight``
(front-end checks against the live LMCache server before vLLM waits on it), ``connector``
(``KVOpsOffloadConnector``, a thin subclass of LMCache's MP connector that adds stats and a loud
degraded state), ``prom`` (the ``kvops_offload_*`` metrics in vLLM's /metrics). Only
``connector`` and ``prom`` import vLLM/LMCache, and only when vLLM loads the connector.
"""

CONNECTOR_NAME = "KVOpsOffloadConnector"
CONNECTOR_MODULE = "kvops.plugin.offload.connector"
