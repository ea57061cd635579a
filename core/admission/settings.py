"""The ``admission`` section of kvops settings (KV-budget admission control).

Given as ``--additional-config '{"kvops": {"admission": {...}}}'`` or in kvops.yaml. Imports only
pydantic, so the planner can build and check it without vLLM.
"""

from __future__ import annotations

import hashlib

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvops.core.admission.policy import Policy, QueueBudget

OTHER_TENANT = "other"
"""Metric label of every tenant not listed in ``tenants`` or ``tenant_labels``."""

# --scheduler-cls values, by whether the engine schedules asynchronously (GPU default; always
# off on the CPU platform, vllm/platforms/cpu.py:329-331).
SCHEDULER_CLASSES: dict[bool, str] = {
    False: "kvops.plugin.admission.KVBudgetScheduler",
    True: "kvops.plugin.admission.KVBudgetAsyncScheduler",
}


class TenantBudget(BaseModel):
    """Limits for the requests of one tenant, named by the tenant header."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # NaN/inf: never a setting

    max_in_flight: int = Field(ge=1)
    """HTTP 429 when this tenant already has this many requests queued or running."""


class AdmissionSettings(BaseModel):
    """How the scheduler reserves KV and how the HTTP front door sheds load."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # NaN/inf: never a setting

    policy: Policy = "strict"
    """strict: reserve prompt + max_tokens; expected: prompt + a learned output quantile; off."""
    headroom_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """Fraction of the KV blocks kept free beyond all reservations while something runs."""
    quantile: float = Field(0.9, gt=0.0, le=1.0)
    """expected policy: the output-length quantile reserved for each request."""
    min_samples: int = Field(20, ge=1)
    """expected policy: finished requests needed before the quantile replaces max_tokens."""
    max_request_fraction: float = Field(1.0, gt=0.0, le=1.0)
    """A request whose worst-case KV (n x (prompt + max_tokens)) exceeds this fraction of the
    cache is refused with HTTP 400: it could never run with its worst case reserved."""
    max_queued_requests: int | None = Field(None, ge=1)
    """HTTP 429 when more requests than this are accepted but not started."""
    max_queued_kv_fraction: float | None = Field(1.0, gt=0.0)
    """HTTP 429 when the worst-case KV of accepted-not-started requests would exceed this
    multiple of the whole cache (1.0: about one cache turnover of queued work). null: no limit."""
    max_queue_wait_s: float | None = Field(None, gt=0.0)
    """HTTP 429 when the predicted wait (queue ahead / drain rate) exceeds this many seconds."""
    retry_after_max_s: int = Field(60, ge=1)
    """Upper bound of the Retry-After header."""
    tenant_header: str = Field("x-kvops-tenant", min_length=1)
    """HTTP header naming the tenant of a request, for the per-tenant budgets below."""
    tenants: dict[str, TenantBudget] = Field(default_factory=dict)
    """Per-tenant budgets, by the tenant header's value."""
    default_tenant: TenantBudget | None = None
    """Budget of each tenant not listed in ``tenants`` (and of requests without the header,
    pooled as tenant ""). null: unlisted tenants have no per-tenant limit."""
    tenant_labels: list[str] = Field(default_factory=list, max_length=1000)
    """Tenants published under their own name in /metrics besides those in ``tenants``; every
    other tenant is published as ``other``, so clients cannot grow the series count."""
    tenant_api_keys: dict[str, str] | None = None
    """API key -> tenant. When set, a request's tenant is the one bound to the key it presents
    (``Authorization: Bearer <key>``), never the tenant header, so one client cannot spend
    another's budget or dodge its own by naming another tenant; a request with no bound key
    counts as tenant "". Keys prefixed ``sha256:`` are compared as SHA-256 hex digests."""

    @model_validator(mode="after")
    def _quantile_only_for_expected(self) -> AdmissionSettings:
        if self.policy != "expected" and "quantile" in self.model_fields_set:
            raise ValueError("quantile applies only to policy 'expected'")
        return self

    def queue_budget(self, cache_tokens: int) -> QueueBudget:
        """The front door's limits for a cache of ``cache_tokens`` usable tokens."""
        kv_limit = (
            None
            if self.max_queued_kv_fraction is None
            else int(self.max_queued_kv_fraction * cache_tokens)
        )
        return QueueBudget(
            max_queued_requests=self.max_queued_requests,
            max_queued_kv_tokens=kv_limit,
            max_queue_wait_s=self.max_queue_wait_s,
            retry_after_max_s=self.retry_after_max_s,
        )

    def tenant_budget(self, tenant: str) -> TenantBudget | None:
        return self.tenants.get(tenant, self.default_tenant)

    def tenant_label(self, tenant: str) -> str:
        """The metric label of ``tenant``: its name when listed, else ``other`` (bounded)."""
        return tenant if tenant in self.tenants or tenant in self.tenant_labels else OTHER_TENANT

    def tenant_for_key(self, api_key: str | None) -> str:
        """The tenant bound to ``api_key`` (``tenant_api_keys``), "" when none is."""
        if not api_key or not self.tenant_api_keys:
            return ""
        bound = self.tenant_api_keys.get(api_key)
        if bound is None:
            digest = "sha256:" + hashlib.sha256(api_key.encode()).hexdigest()
            bound = self.tenant_api_keys.get(digest)
        return bound or ""

    @property
    def enabled(self) -> bool:
        return bool(self.policy != "off")
