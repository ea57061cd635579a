"""The capacity plan as a type: what ``kvops plan --json`` and ``kvops kv-capacity --json`` print.

The planner (kvops.ops.capacity.plan.run_plan) builds one :class:`Plan`; the table, the
kvops.yaml, ``kvops verify`` and ``kvops loadtest --expect`` read it by attribute instead of by
string keys. Field order is the JSON key order, so ``Plan.to_json()`` prints the same object the
planner printed when it was a dict. It lives in core because the load test (which may import
nothing but core) reads the same document back.

Reading a document back (``--expect``) is deliberately lenient: an operator may hand-write only
the numbers to check (``{"kv_cache_size_tokens": 524288}``), so :class:`Expectation` takes the
fields a check against a live server uses, each optional, from either a plan or a kv-capacity
document, and refuses a field of the wrong type (exit 2) instead of comparing against it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

from kvops.core import kinds
from kvops.core.errors import BadInputError
from kvops.core.kinds import read_json_of_kind
from kvops.core.offload.costs import OffloadCosts

PLAN_COMMANDS = "`kvops plan --json` or `kvops kv-capacity --json`"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class KvGroup(_Frozen):
    """One KV cache group (layers sharing a block table), as vLLM's get_kv_cache_groups forms it."""

    kind: str  # full | sliding | chunked | mamba | mla ...
    layers: tuple[int, ...]
    slots: int
    block_size: int
    page_bytes: int
    blocks_per_request: int  # at max_model_len


class Capacity(_Frozen):
    """One rank's KV pool as vLLM 0.32 sizes it: ``kvops kv-capacity --json``, a plan's ``capacity``."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    kv_cache_size_tokens: int
    max_concurrency: float
    max_model_len: int
    available_kv_bytes: int
    usable_blocks: int  # num_blocks - 1: block 0 is the null block
    blocks_per_request: int
    max_in_flight_tokens: int
    mamba_page_padded_bytes: int | None
    groups: tuple[KvGroup, ...]
    notes: tuple[str, ...]
    log_line: str  # the server's own "KV cache size: ..." line, as it will print it

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"))


class MaxNumSeqsWhy(_Frozen):
    """Every number behind max_num_seqs: the risk-quantile fit, vLLM's caps, the rounding."""

    risk_quantile: str
    length_at_quantile: int
    blocks_per_request_at_quantile: int
    usable_blocks: int
    headroom_fraction: float
    budget_blocks: int
    fit_at_quantile: int
    caps: dict[str, int]  # vllm_default, max_num_batched_tokens, mamba_blocks (hybrids only)
    binding: str  # fit_at_quantile or the name of the cap that bound
    rounded_to_capture_step: int
    mean_length: float
    mean_load_concurrency: int


class NonKvTerms(_Frozen):
    """GiB per non-KV term on one rank (vLLM: KV = ceil(total × util) − these)."""

    weights_gib: float
    activation_gib: float
    non_torch_gib: float
    cudagraph_gib: float

    def items(self) -> list[tuple[str, float]]:
        return list(self.model_dump().items())

    def total(self) -> float:
        return sum(value for _, value in self.items())


class NonKvSources(_Frozen):
    """Where each non-KV term came from: a flag, a calibration file, or a documented default."""

    weights_gib: str
    activation_gib: str
    non_torch_gib: str
    cudagraph_gib: str


class WorkloadSummary(_Frozen):
    source: str
    p50: int
    p95: int
    p99: int
    mean: float
    risk_quantile: str
    blocks_per_request_at_quantile: int


class Fp8Alternative(_Frozen):
    """The same pool with fp8 KV: what --kv-cache-dtype fp8 would buy (accuracy not checked)."""

    kv_cache_dtype: str
    kv_cache_size_tokens: int
    max_concurrency: float
    num_blocks: int
    capacity_ratio: float


def _absent(value: object) -> bool:
    return value is None


def _empty(value: object) -> bool:
    return not value


class OffloadAdvice(_Frozen):
    """LMCache L1 (CPU DRAM) and disk sizes; both None when offload cannot help.

    The sizing fields (bytes_per_prefix, chunk_tokens, why) exist only when there is prefix
    reuse to size for, and ``warning`` only when there is something to warn about: absent keys
    stay absent in the JSON.
    """

    lmcache_cpu_gib: float | None
    lmcache_disk_gib: float | None
    working_set_gib: float
    bytes_per_prefix: int | None = Field(default=None, exclude_if=_absent)
    chunk_tokens: int | None = Field(default=None, exclude_if=_absent)
    why: str | None = Field(default=None, exclude_if=_absent)
    warning: str | None = Field(default=None, exclude_if=_absent)


class PlanSizing(_Frozen):
    """The derived serve flags and every number behind them (the first keys of a plan)."""

    device: str
    gpu_total_gib: float
    tensor_parallel_size: int
    pipeline_parallel_size: int
    pp_layer_partition: tuple[int, ...] | None
    gpu_memory_utilization: float
    max_num_seqs: int
    max_num_seqs_why: MaxNumSeqsWhy
    max_model_len: int
    max_num_batched_tokens: int
    kv_cache_dtype: str
    kv_cache_dtype_skip_layers: tuple[str, ...] = Field(default=(), exclude_if=_empty)  # kept at the model dtype
    non_kv: NonKvTerms
    non_kv_sources: NonKvSources
    available_kv_gib: float
    capacity: Capacity
    workload: WorkloadSummary
    fp8_alternative: Fp8Alternative | None
    calibration: str | None  # the calibration file's source, when one was used
    notes: tuple[str, ...]


class TraceCurvePoint(_Frozen):
    """One point of a trace's LRU curve: a cache of this size, and the share of prompt tokens
    it would have found."""

    cache_tokens: int
    cache_gib: float  # for the planned model and KV dtype, all ranks
    hit_ratio: float


class TraceAdvice(_Frozen):
    """What ``kvops plan --trace`` read from a production trace (kvops.core.trace)."""

    source: str
    requests: int
    duration_s: float
    arrival_rate_rps: float | None
    requests_over_max_model_len: int  # sized clipped to max_model_len; vLLM would reject them
    block_tokens: int
    prefix_reuse_ratio: float  # an unbounded cache
    target_hit_fraction: float
    target_hit_ratio: float
    gpu_cache_tokens: int
    gpu_hit_ratio: float  # the planned KV cache alone, as an LRU cache
    tokens_for_target: int  # the smallest LRU cache reaching target_hit_ratio
    tokens_for_all_reuse: int
    curve: tuple[TraceCurvePoint, ...]


class OffloadDecision(_Frozen):
    """Whether offload pays for this reuse in this transfer mode (``kvops plan --offload-mode``).

    Hit ratios are shares of all prompt tokens; the tiers are inclusive LRU caches (LMCache keeps
    what it stores in L1 and writes every chunk to disk too), so a tier finds what an LRU cache of
    its own size would, beyond what the ones in front of it find. Times are shares of the prefill
    time of every prompt token recomputed without a connector: ``prefill_saved_fraction`` is what
    the tier hits save, ``miss_overhead_fraction`` what the connector adds to the tokens still
    computed; offload pays when the first is larger.
    """

    recommendation: str  # enable | leave-off
    reason: str
    transfer_mode: str
    costs: OffloadCosts
    reuse_model: str
    kv_bytes_per_token: int  # all ranks
    gpu_cache_tokens: int
    l1_gib: float | None
    disk_gib: float | None
    l1_tokens: int
    disk_tokens: int
    gpu_hit_ratio: float  # GPU KV alone
    hit_ratio: float  # GPU KV + L1 + disk
    l1_hit_ratio: float
    disk_hit_ratio: float
    prefill_saved_fraction: float
    miss_overhead_fraction: float
    net_saved_fraction: float
    commands: tuple[str, ...]  # what to run when enabled: the LMCache server, then vLLM


class Plan(PlanSizing):
    """A whole plan: the sizing, then what the operator runs (``kvops plan --json``)."""

    weights_source: str
    offload: OffloadAdvice
    kvops_yaml: dict[str, Any]  # the plugin's settings mapping, already checked by its own parser
    serve: str  # the ready `vllm serve ...` line
    trace: TraceAdvice | None = Field(default=None, exclude_if=_absent)  # `kvops plan --trace`
    offload_decision: OffloadDecision | None = Field(default=None, exclude_if=_absent)  # --offload-mode

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"))


class _Lenient(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class ExpectedCapacity(_Lenient):
    """The capacity numbers a check against a server compares; None: the document lacks it."""

    num_blocks: StrictInt | None = None
    block_size: StrictInt | None = None
    bytes_per_block: StrictInt | None = None
    kv_cache_size_tokens: StrictInt | None = None
    max_concurrency: StrictFloat | None = None
    groups: tuple[KvGroup, ...] = ()

    def pool(self) -> tuple[int, int] | None:
        """(num_blocks, block_size) when both are positive: enough to count requests that fit."""
        if self.num_blocks and self.block_size and self.num_blocks > 0 and self.block_size > 0:
            return self.num_blocks, self.block_size
        return None


class Expectation(_Lenient):
    """An ``--expect`` document: a plan (``capacity`` nested) or a kv-capacity object (flat).

    The plan-level fields are None where the document has none (a kv-capacity object).
    """

    capacity: ExpectedCapacity
    is_plan: bool = False
    max_num_seqs: StrictInt | None = None
    gpu_total_gib: StrictFloat | None = None
    device: StrictStr | None = None
    tensor_parallel_size: StrictInt | None = None
    pipeline_parallel_size: StrictInt | None = None
    max_num_batched_tokens: StrictInt | None = None
    non_kv: NonKvTerms | None = None

    @classmethod
    def from_document(cls, doc: object, where: str = "--expect") -> Expectation:
        """Read a decoded JSON document; a field of the wrong type exits 2 naming it."""
        if not isinstance(doc, dict):
            raise BadInputError(f"{where}: not a JSON object; pass the JSON of {PLAN_COMMANDS}")
        nested = doc.get("capacity")
        is_plan = isinstance(nested, dict)
        try:
            return cls.model_validate({**doc, "capacity": nested if is_plan else doc, "is_plan": is_plan})
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = err["loc"]
            if not is_plan and loc[:1] == ("capacity",):
                loc = loc[1:]  # a flat document's capacity fields sit at its top level
            field = ".".join(str(part) for part in loc) or "(top level)"
            raise BadInputError(f"{where}: {field}: {err['msg']}; pass the JSON of {PLAN_COMMANDS}") from None


_CAPACITY_KEYS = frozenset(ExpectedCapacity.model_fields)


def read_expectation(path: Path, where: str = "--expect") -> Expectation:
    """An ``--expect`` file: the JSON ``kvops plan --json`` or ``kvops kv-capacity --json`` printed."""
    label = f"{where} {path}"
    doc = read_json_of_kind(path, label, kinds.PLAN, accepted=(kinds.KV_CAPACITY,))
    if isinstance(doc, dict) and not _CAPACITY_KEYS & set(doc) and not isinstance(doc.get("capacity"), dict):
        raise BadInputError(f"{label}: no capacity figures ({', '.join(sorted(_CAPACITY_KEYS))}); "
                            f"pass the JSON of {PLAN_COMMANDS}")
    return Expectation.from_document(doc, label)
