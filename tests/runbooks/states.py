"""The states of the real stack that runbook pages are checked in.

Each state is a `vllm serve` configuration of the tiny test model (or none), plus the load that
puts it into the condition a page describes. States are visited in the order of STATES, so that
blocks of one page can build on files an earlier state's block wrote (the page's working
directory is shared). Server arguments name the very flags the pages tell an operator to change;
``page_flags`` lists them and tests/runbooks/test_pages.py checks each page mentions them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

KIB = 1024
MIB = 1024 * KIB
# Tiny model (4 layers x 2 KV heads x head_dim 64, bf16): 2 KiB of KV per token, CPU blocks of
# 128 tokens = 256 KiB per block.
BLOCK_BYTES = 256 * KIB


@dataclass(frozen=True)
class Load:
    """Closed-loop users sending completions for as long as the state is active."""

    users: int
    prompt_words: int
    max_tokens: int
    shared_prompt: bool = False
    """Every request sends the same prompt (prefix-cache hits when caching is on)."""


@dataclass(frozen=True)
class State:
    name: str
    description: str
    args: tuple[str, ...] = ()
    kv_cache_bytes: int = 1 << 30
    server: bool = True
    refuses_start: bool = False
    """The server is started expecting it to fail; VLLM_LOG is its log, VLLM_URL is unset."""
    load: Load | None = None
    ready: dict[str, float] = field(default_factory=dict)
    """Conditions on /metrics the load must reach before commands run: key -> minimum
    (keys of kvops.core.prom: preemptions, waiting, requests_finished ...)."""
    page_flags: tuple[str, ...] = ()
    model_shape: tuple[tuple[str, int], ...] = ()
    """Another tiny-model shape than the default (TinyModelSpec fields)."""
    lmcache: str = ""
    """"up" or "down": the state's LMCache server (kvops offload serve) runs or was stopped;
    "" when the state has none. "{kvops_yaml}" in args is its kvops.yaml."""


MAX_MODEL_LEN = ("--max-model-len", "2048")
"""The e2e modules' default length: the states on 1 GiB of KV (kv-mitigated, healthy) are the
configuration most e2e tests share (tests/e2e/conftest.py SHARED_ARGS), which the session pool
evicts last, so they normally find it running instead of starting a server of their own."""
# 16 usable blocks, strict reservations, at most 6 requests accepted but not started: the shape
# of the admission e2e tests' server (tests/e2e/test_admission_e2e.py), whose tenant budgets make
# it another configuration.
ADMISSION_KV_BYTES = 17 * BLOCK_BYTES
ADMISSION_ARGS = ("--max-model-len", "1024", "--max-num-seqs", "32")


def _admission(**settings: object) -> tuple[str, ...]:
    return ("--additional-config", json.dumps({"kvops": {"admission": settings}}))


# "{pages}" in server arguments is the pages' working directories: the scales file that
# fp8-accuracy.md's `kvops calibrate` block wrote in the offline state.
SCALES = "{pages}/fp8-accuracy/scales.json"
FP8_WITH_SCALES = ("--kv-cache-dtype", "fp8", "--additional-config",
                   json.dumps({"kvops": {"kv_scales": SCALES}}))


OFFLOAD_CONFIG = json.dumps({"kvops": {"config": "{kvops_yaml}"}})

STATES: tuple[State, ...] = (
    State("offline", "no server: commands that read configs and logs only", server=False),
    State(
        "startup-refused",
        "a KV space too small for one --max-model-len request: vLLM refuses to start",
        args=(*MAX_MODEL_LEN, "--kv-cache-memory-bytes", str(2 * BLOCK_BYTES)),
        refuses_start=True,
        page_flags=("--kv-cache-memory-bytes", "--max-model-len", "--gpu-memory-utilization"),
    ),
    State(
        "prefix-off",
        "prefix caching switched off (the page's own load test supplies the shared prefixes)",
        args=(*MAX_MODEL_LEN, "--no-enable-prefix-caching"),
        page_flags=("--no-enable-prefix-caching",),
    ),
    State(
        "kv-exhausted",
        "16 KV blocks (2,048 tokens) under 6 users generating 800 tokens each: preemptions",
        # 1,024 tokens a request: vLLM keeps one of the 16 blocks as its null block, and on the
        # 1,920 tokens left it refuses to start with --max-model-len 2048
        args=("--max-model-len", "1024"), kv_cache_bytes=16 * BLOCK_BYTES,
        load=Load(users=6, prompt_words=60, max_tokens=800),
        ready={"preemptions": 1, "waiting": 1},
        page_flags=("--kv-cache-memory-bytes", "--gpu-memory-utilization", "--max-num-seqs"),
    ),
    State(
        "kv-mitigated",
        "the same load on 1 GiB of KV (512 Ki tokens): no preemption, nothing waits",
        args=MAX_MODEL_LEN,
        load=Load(users=6, prompt_words=60, max_tokens=800),
    ),
    State(
        "healthy",
        "the default tiny server, idle but for a few shared-prefix requests",
        args=MAX_MODEL_LEN,
        load=Load(users=1, prompt_words=300, max_tokens=4, shared_prompt=True),
        ready={"requests_finished": 2},
    ),
    State(
        "queueing",
        "--max-num-seqs 1 under 4 users: requests queue for the single slot while KV is free",
        args=(*MAX_MODEL_LEN, "--max-num-seqs", "1"),
        # 64 output tokens, not 8: at 8 the single slot served ~15 req/s, faster than four
        # Python clients resubmitted, so vLLM's log showed "Waiting: 0" most of the time and a
        # 10 s diagnose window could read an idle server (clean-clone run); at 64 a request holds
        # the slot ~0.5 s, the other three wait, and the clients send an eighth as often
        load=Load(users=4, prompt_words=20, max_tokens=64),
        ready={"waiting": 1},
        page_flags=("--max-num-seqs",),
    ),
    State(
        "fp8-default",
        "--kv-cache-dtype fp8 without scales: vLLM runs the fp8 KV at scale 1.0",
        args=(*MAX_MODEL_LEN, "--kv-cache-dtype", "fp8"),
        page_flags=("--kv-cache-dtype fp8",),
    ),
    State(
        "fp8-calibrated",
        "the restart the fp8 page prescribes: fp8 KV with the scales kvops calibrate wrote",
        args=(*MAX_MODEL_LEN, *FP8_WITH_SCALES),
        page_flags=("kv_scales",),
    ),
    State(
        "fp8-mismatch",
        "those scales given to a 2-layer model: the plugin refuses to start",
        args=(*MAX_MODEL_LEN, *FP8_WITH_SCALES),
        refuses_start=True, model_shape=(("layers", 2),),
    ),
    State(
        "offload-refused",
        "offload configured while the LMCache server is down: the plugin refuses to start",
        args=(*MAX_MODEL_LEN, "--additional-config", OFFLOAD_CONFIG),
        refuses_start=True, lmcache="down",
    ),
    State(
        "offload-down",
        "a running server whose LMCache server was stopped: the connector runs degraded",
        args=(*MAX_MODEL_LEN, "--additional-config", OFFLOAD_CONFIG),
        lmcache="down", load=Load(users=1, prompt_words=300, max_tokens=4, shared_prompt=True),
        ready={"kvops_offload_server_down": 1, "kvops_offload_degraded": 1},
    ),
    State(
        "offload-restored",
        "the LMCache server restarted with `kvops offload serve`: offload works again",
        args=(*MAX_MODEL_LEN, "--additional-config", OFFLOAD_CONFIG),
        lmcache="up", load=Load(users=1, prompt_words=300, max_tokens=4, shared_prompt=True),
        ready={"kvops_offload_server_up": 1, "kvops_offload_recovered": 1},
    ),
    State(
        "admission-shedding",
        "KV admission with max_queued_requests 6 under 24 users: excess requests get HTTP 429",
        args=(*ADMISSION_ARGS, *_admission(policy="strict", max_queued_requests=6)),
        kv_cache_bytes=ADMISSION_KV_BYTES,
        load=Load(users=24, prompt_words=30, max_tokens=150),
        ready={"kvops_rejected": 1},
        page_flags=("max_queued_requests",),
    ),
    State(
        "admission-relaxed",
        "the same load after raising the queue limits (64 requests, 4 caches of KV): nothing is "
        "rejected",
        args=(*ADMISSION_ARGS, *_admission(policy="strict", max_queued_requests=64,
                                           max_queued_kv_fraction=4.0)),
        kv_cache_bytes=ADMISSION_KV_BYTES,
        load=Load(users=24, prompt_words=30, max_tokens=150),
        ready={"requests_finished": 8},
    ),
)

STATE_ORDER: dict[str, int] = {s.name: i for i, s in enumerate(STATES)}


def state(name: str) -> State:
    for s in STATES:
        if s.name == name:
            return s
    raise KeyError(f"unknown runbook state {name!r} (known: {', '.join(STATE_ORDER)})")
