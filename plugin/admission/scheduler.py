"""vLLM schedulers with KV-budget admission: ``--scheduler-cls kvops.plugin.admission.KVBudgetScheduler``.

The classes only delegate: ``KVBudgetGate`` reads the few request fields the policy needs and
asks ``kvops.core.admission.policy`` whether a waiting request may take KV blocks now. It is
imported by vLLM in the engine-core process (vllm/config/scheduler.py:228 get_scheduler_cls), after
KV profiling, so the block count is known. Settings come from ``--additional-config
'{"kvops": {"admission": {...}}}'`` (validated earlier, in the front end, by kvops.plugin.hooks).

Hook: the scheduler's WAITING loop calls ``kv_cache_manager.allocate_slots`` for each head
request and ``break``s when it returns None (vllm/v1/core/sched/scheduler.py:1256-1282), exactly as
vLLM's own ``full_sequence_must_fit``/``watermark`` gates do; wrapping that call on the instance
keeps FCFS order, and the held-back request shows as
``vllm:num_requests_waiting_by_reason{reason="capacity"}``.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from kvops.core.admission.policy import (
    AdmissionPolicy,
    KVBudget,
    RequestShape,
    ReservationLedger,
    headroom_blocks,
    spec_decode_lookahead_tokens,
)
from kvops.core.admission.settings import AdmissionSettings
from kvops.core.settings import load_settings

logger = init_logger("vllm.plugins.kvops.admission")

# Statuses of requests the WAITING loop admits (vllm/v1/core/kv_cache_manager.py:507-515 uses
# the same pair for its watermark).
_ADMITTED_FROM = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
# Requests that ended normally teach the expected-length quantile; aborts would bias it low.
_LEARN_FROM = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


_request_id = attrgetter("request_id")


def shape_of(request: Request) -> RequestShape:
    """``request.max_tokens`` is already resolved (unset -> max_model_len - prompt,
    vllm/v1/engine/input_processor.py:477-479)."""
    return RequestShape(
        prompt_tokens=request.num_prompt_tokens,
        max_tokens=request.max_tokens,
        output_tokens=request.num_output_tokens,
    )


def admission_settings_of(vllm_config: Any) -> AdmissionSettings:
    settings = load_settings(getattr(vllm_config, "additional_config", None))
    if settings is None or settings.admission is None:
        return AdmissionSettings.model_validate({})
    return settings.admission


class KVBudgetGate:
    """Holds the policy for one scheduler and sits between it and its KV cache manager."""

    def __init__(self, scheduler: Scheduler, settings: AdmissionSettings) -> None:
        usable = scheduler.kv_cache_config.num_blocks - 1  # minus the null block (block_pool.py)
        self.budget = KVBudget(
            usable_blocks=usable,
            block_size=scheduler.block_size,
            max_model_len=scheduler.max_model_len,
            headroom_blocks=headroom_blocks(usable, settings.headroom_fraction),
            lookahead_tokens=spec_decode_lookahead_tokens(scheduler.num_lookahead_tokens),
        )
        self.policy = AdmissionPolicy(
            self.budget, settings.policy, settings.quantile, settings.min_samples
        )
        self.ledger = ReservationLedger(self.policy)
        self.scheduler = scheduler
        self.held_back = 0
        self._reserved_blocks: int | None = None
        manager = scheduler.kv_cache_manager
        self._allocate = manager.allocate_slots
        manager.allocate_slots = self._pass_through_unless_waiting(manager.allocate_slots)
        logger.info(
            "kvops admission: policy=%s usable_blocks=%d block_size=%d headroom_blocks=%d",
            settings.policy, usable, self.budget.block_size, self.budget.headroom_blocks,
        )

    def new_step(self) -> None:
        """Reservations are recomputed lazily once per step, after the RUNNING loop grew them."""
        self._reserved_blocks = None

    def _pass_through_unless_waiting(self, allocate: Any) -> Any:
        """The wrapper vLLM calls for every running request in every step: a closure, whose
        pass-through costs about half of a bound method's (kvops bench admission measures it
        at 256 running sequences)."""
        admit = self.allocate_slots
        admitted_from = _ADMITTED_FROM

        def allocate_slots(request: Request, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
            if request.status not in admitted_from:
                return allocate(request, num_new_tokens, *args, **kwargs)
            return admit(request, num_new_tokens, *args, **kwargs)

        return allocate_slots

    def allocate_slots(self, request: Request, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        """For a waiting or preempted request: allocate only when the policy admits it."""
        running = self.scheduler.running
        if self._reserved_blocks is None:
            self._reserved_blocks = self.ledger.total_blocks(running, _request_id, shape_of)
        decision = self.policy.admit(shape_of(request), self._reserved_blocks, len(running))
        if not decision.admit:
            self.held_back += 1
            return None
        blocks = self._allocate(request, num_new_tokens, *args, **kwargs)
        if blocks is not None:
            self._reserved_blocks += decision.need_blocks
        return blocks

    def finished(self, request: Request) -> None:
        self.ledger.forget(request.request_id)
        if request.status in _LEARN_FROM:
            self.policy.record_finished(request.num_output_tokens)


class _KVBudgetMixin:
    """One line per hook; all logic is in KVBudgetGate and the policy module."""

    _kvops_gate: KVBudgetGate

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kvops_gate = KVBudgetGate(self, admission_settings_of(self.vllm_config))  # type: ignore[attr-defined]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._kvops_gate.new_step()
        return super().schedule(*args, **kwargs)  # type: ignore[misc]

    # vllm/v1/core/sched/scheduler.py:2714 — every finished request passes here exactly once.
    def _free_request(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        self._kvops_gate.finished(request)
        return super()._free_request(request, *args, **kwargs)  # type: ignore[misc]


class KVBudgetScheduler(_KVBudgetMixin, Scheduler):
    """For engines without async scheduling (always the case on the CPU platform)."""


class KVBudgetAsyncScheduler(_KVBudgetMixin, AsyncScheduler):
    """For GPU engines, where async scheduling is on by default (vllm/config/vllm.py:1585)."""

