"""What the admission gate costs per engine step, measured on vLLM's real scheduler in-process.

A throughput A/B between two servers on a shared 2-core machine cannot resolve a 2% effect (the
machine's speed drifts by more than that between seconds). This part does not depend on the
machine's speed: vLLM's own ``Scheduler`` and our ``KVBudgetScheduler`` are built in one process
on the same config and driven through the same deterministic request stream (schedule, then
``update_from_output`` with one sampled token per request, as the engine core does,
vllm/v1/engine/core.py step), alternating runs so that drift hits both alike. The difference is
what the gate adds to a step; the schedules are compared too, since a gate that refuses nothing
must leave vLLM's decisions unchanged. Divided by a real server's step time, it bounds the
throughput the gate can cost. The front door's per-step work in the API server
(``FrontDoor.on_step``) is timed the same way.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

STRICT = {"kvops": {"admission": {"policy": "strict"}}}


@dataclass(frozen=True)
class StepShape:
    """A closed loop: ``running`` requests in flight, each replaced by a new one when it ends."""

    running: int
    prompt_tokens: int
    max_tokens: int
    num_blocks: int
    block_size: int
    max_model_len: int
    steps: int


def _scheduler(scheduler_cls: str | None, model: Path, shape: StepShape, extra: dict[str, Any]) -> Any:
    """A scheduler built the way the engine core builds it (vllm/v1/engine/core.py:
    ``get_scheduler_cls()`` on the config, then the class with the KV cache config)."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    init_none_hash(sha256)
    config = VllmConfig(
        model_config=ModelConfig(model=str(model), max_model_len=shape.max_model_len,
                                 skip_tokenizer_init=True),
        scheduler_config=SchedulerConfig(
            max_model_len=shape.max_model_len, is_encoder_decoder=False,
            max_num_seqs=max(shape.running, 1), max_num_batched_tokens=8192,
            scheduler_cls=scheduler_cls,
        ),
        cache_config=CacheConfig(block_size=shape.block_size),
        additional_config=extra,
    )
    config.cache_config.num_gpu_blocks = shape.num_blocks
    spec = FullAttentionSpec(block_size=shape.block_size, num_kv_heads=2, head_size=64,
                             dtype=torch.bfloat16)
    kv_config = KVCacheConfig(num_blocks=shape.num_blocks, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    cls = config.scheduler_config.get_scheduler_cls()
    return cls(vllm_config=config, kv_cache_config=kv_config,
               structured_output_manager=StructuredOutputManager(config),
               block_size=shape.block_size, log_stats=True)


Stepper = Callable[[], tuple[float, list[tuple[str, int]]]]


def _driver(shape: StepShape) -> Callable[[Any], Stepper]:
    """Returns start(scheduler) -> step(), and step() -> (CPU seconds of this thread in
    schedule + update_from_output, the step's schedule). CPU time, not wall time: another
    process taking the core does not count, so two schedulers stepped in turn compare fairly
    on a busy machine."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    hasher = get_request_block_hasher(shape.block_size, sha256)
    params = SamplingParams(max_tokens=shape.max_tokens, ignore_eos=True, temperature=0)

    def request(k: int) -> Request:
        prompt = [(k * 7919 + i) % 1000 + 1 for i in range(shape.prompt_tokens)]
        return Request(f"r{k}", prompt, params, None, block_hasher=hasher)

    def start(scheduler: Any) -> Stepper:
        issued = [shape.running]
        for k in range(shape.running):
            scheduler.add_request(request(k))

        def step() -> tuple[float, list[tuple[str, int]]]:
            begin = time.thread_time()
            out = scheduler.schedule()
            ids = list(out.num_scheduled_tokens)
            runner = ModelRunnerOutput(
                req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
                sampled_token_ids=[[7] for _ in ids],
            )
            finished = scheduler.update_from_output(out, runner)
            spent = time.thread_time() - begin
            done = sum(1 for o in finished.values() for x in o.outputs if x.finished)
            for _ in range(done):  # a closed loop: every finished request is replaced
                scheduler.add_request(request(issued[0]))
                issued[0] += 1
            return spent, sorted(out.num_scheduled_tokens.items())

        return step

    return start


def scheduler_step_cost(model: Path, shape: StepShape, repeats: int = 3) -> dict[str, Any]:
    """CPU microseconds per step of vLLM's Scheduler and of KVBudgetScheduler on the same
    request stream, stepped in lockstep (the order alternating every step), so that each
    step's pair ran moments apart on the same state."""
    from kvops.core.admission.settings import SCHEDULER_CLASSES

    start = _driver(shape)
    spent = {"stock": 0.0, "kvops": 0.0}
    diffs_us: list[float] = []
    identical = True
    scheduled = 0
    for _ in range(repeats):
        steppers = {
            "stock": start(_scheduler(None, model, shape, {})),
            "kvops": start(_scheduler(SCHEDULER_CLASSES[False], model, shape, STRICT)),
        }
        for i in range(shape.steps):
            order = ("stock", "kvops") if i % 2 == 0 else ("kvops", "stock")
            result = {name: steppers[name]() for name in order}
            for name, (cpu_s, _) in result.items():
                spent[name] += cpu_s
            diffs_us.append((result["kvops"][0] - result["stock"][0]) * 1e6)
            identical = identical and result["kvops"][1] == result["stock"][1]
            scheduled += sum(n for _, n in result["kvops"][1])
    steps = repeats * shape.steps
    return {
        "running": shape.running, "steps": shape.steps, "repeats": repeats,
        "stock_us_per_step": spent["stock"] / steps * 1e6,
        "kvops_us_per_step": spent["kvops"] / steps * 1e6,
        "added_us_per_step": (spent["kvops"] - spent["stock"]) / steps * 1e6,
        "added_us_per_step_median": statistics.median(diffs_us),
        "identical_schedule": identical,
        "scheduled_tokens": scheduled // repeats,
        "clock": "thread CPU time",
    }


def front_door_cost(running: int, repeats: int = 2000) -> dict[str, float]:
    """Microseconds of the API server's admission work with ``running`` requests known to the
    front end: ``on_step`` (every engine step) and the queue walk (every refresh interval, and
    once per arriving request)."""
    from kvops.core.admission.policy import RequestShape
    from kvops.core.admission.settings import AdmissionSettings
    from kvops.plugin.admission.http import FrontDoor

    door = FrontDoor(AdmissionSettings.model_validate({}), clock=lambda: 0.0)  # a frozen clock: no refresh
    config = SimpleNamespace(
        cache_config=SimpleNamespace(num_gpu_blocks=65537, block_size=16),
        model_config=SimpleNamespace(max_model_len=8192),
    )
    states = {
        f"r{i}": SimpleNamespace(prompt_len=500, max_tokens_param=300, is_prefilling=i % 8 == 0)
        for i in range(running)
    }
    door.check(config, [RequestShape(10, 10)], 1, states)
    scheduler_stats = SimpleNamespace(kv_cache_usage=0.5)
    iteration = SimpleNamespace(finished_requests=[])
    door.on_step(scheduler_stats, iteration)  # the first call refreshes the gauges
    start = time.perf_counter()
    for _ in range(repeats):
        door.on_step(scheduler_stats, iteration)
    on_step_us = (time.perf_counter() - start) / repeats * 1e6
    policy = door.policy_for(config)
    start = time.perf_counter()
    for _ in range(repeats // 10):
        door.queue_state(policy, states.values())
    walk_us = (time.perf_counter() - start) / (repeats // 10) * 1e6
    return {"running": running, "on_step_us": on_step_us, "queue_walk_us": walk_us}


class _State:
    """The attributes of vLLM's RequestState the front door reads (prompt_len,
    max_tokens_param, is_prefilling), with the same is_prefilling hook the plugin installs."""

    def __init__(self, prompt_len: int, max_tokens: int) -> None:
        self.prompt_len = prompt_len
        self.max_tokens_param = max_tokens
        self.is_prefilling = True


def front_door_request_cost(in_flight: int, requests: int = 3000, tracked: bool = True,
                            max_running: int = 256) -> dict[str, Any]:
    """Thread-CPU microseconds per arriving request of the real front door (FrontDoor.check on
    the states vLLM keeps, TrackedStates as the plugin installs them) with ``in_flight``
    unfinished requests, at most ``max_running`` of them started: each arrival is added, decided,
    and one started request finishes while the oldest pending one starts, so the count stays.
    ``tracked=False`` measures the walk the ledger replaced (a plain dict)."""
    from collections import deque

    from kvops.core.admission.policy import RequestShape
    from kvops.core.admission.settings import AdmissionSettings
    from kvops.plugin.admission.http import FrontDoor
    from kvops.plugin.admission.ledger import QueueLedger, TrackedStates, track_prefill_flips

    track_prefill_flips(_State)
    door = FrontDoor(AdmissionSettings.model_validate({"max_queued_kv_fraction": None}),
                     clock=lambda: 0.0)
    config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=65537, block_size=16),
                             model_config=SimpleNamespace(max_model_len=8192))
    policy = door.policy_for(config)
    states: dict[str, Any] = TrackedStates(QueueLedger(policy), {}) if tracked else {}
    started: deque[str] = deque()
    pending: deque[str] = deque()
    for i in range(in_flight):
        states[f"r{i}"] = _State(500, 300)
        if len(started) < min(max_running, in_flight):
            states[f"r{i}"].is_prefilling = False
            started.append(f"r{i}")
        else:
            pending.append(f"r{i}")
    shape = [RequestShape(500, 300)]
    begin = time.thread_time()
    for k in range(requests):
        rid = f"n{k}"
        states[rid] = _State(500, 300)
        door.check(config, shape, 1, states)
        pending.append(rid)
        states.pop(started.popleft())
        nxt = pending.popleft()
        states[nxt].is_prefilling = False
        started.append(nxt)
    spent = time.thread_time() - begin
    return {"in_flight": in_flight, "us_per_request": spent / requests * 1e6,
            "tracked": tracked, "clock": "thread CPU time"}


def front_door_scaling(low: int = 10, high: int = 10_000) -> dict[str, Any]:
    """Per-request front-door CPU at ``high`` vs ``low`` in flight (goal: ratio <= 1.5), and
    what the walk it replaced costs at ``high``."""
    runs: dict[int, list[float]] = {low: [], high: []}
    for _ in range(3):  # alternated, medians: drift on a shared machine hits both alike
        for size in (low, high):
            runs[size].append(front_door_request_cost(size)["us_per_request"])
    small, large = statistics.median(runs[low]), statistics.median(runs[high])
    walk = front_door_request_cost(high, requests=30, tracked=False)
    return {
        "front_door_us_per_request_10k_vs_10": large / small,
        "front_door_us_per_request": {str(low): small, str(high): large,
                                      f"{high}_walk_before": walk["us_per_request"]},
    }
