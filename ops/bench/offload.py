"""``kvops bench offload --json``: TTFT of a long prefix served from LMCache L1 and from disk vs
recomputed, the cost of a miss, and LMCache's copy throughput vs a plain memory copy.

One run, real processes, the reference shape of research/offload_bench.md (8 layers, hidden
1024, 8 KV heads x head_dim 128 = 32 KiB of KV per token) so the ratios compare with the
measurements there. The offload server and a server without the connector stay up side by side.
Per prompt: (a) cold through the offload server, (c) again after /reset_prefix_cache (LMCache
L1), (d) again after also clearing L1 (disk); ratios are medians of c/a and d/a. Measured twice
per server: ``first_pass`` on the fresh server, then, after serving prompts until vLLM has handed
out every KV block once (CYCLE_PROMPTS), the top-level ratios, as a server that has been in
service a while sees them. In zero-copy (lmcache_driven) the LMCache server maps each page of
vLLM's KV segment on its first copy there, one 4 KiB page fault per page (a 2k-token load: 16,384
faults) unless /dev/shm gives huge pages; ``server_page_faults_per_load`` counts them (the
kernel's count for the LMCache server's processes around each hit). The cost of a
miss is measured apart, in interleaved ABBA blocks of fresh prompts (no connector, offload,
offload, no connector): a slow stretch of the shared machine hits both sides of a block alike.
``miss_overhead_ratio`` is the median of the blocks' ratios, reported with their spread.
``hit_time_split_s`` and ``miss_time_split_s`` say where the time goes, from vLLM's own queue,
prefill and TTFT histograms read around the hits and the miss blocks (TIME_SPLIT). The floor
under a hit is vLLM's own prefix-cache hit computing one token, on the no-connector server right
after each cold prompt (``prefix_hit_ttft_s``, ops/bench/offload_figures.py). A greedy text
that differs from the no-connector server's is scored by that server as the chaos bench scores
one (ops/bench/greedy.py): a tie flip of the tiny model's near-tied logits, or a wrong output. Beside the ratios,
which are this machine's (they divide by its prefill), sit the load's own figures, which carry to
another machine, and issue 43's goal (ops/bench/offload_figures.py). First of all, before any
server starts, ``worker_copy`` times the same load's copy three ways in this process (LMCache's
server transfer, LMCache's engine_driven worker scatter, kvops' own per-block copy) against
memcpy (ops/bench/offload_copy.py; KVOPS_BENCH_OFFLOAD_WORKER_COPY_ONLY=1 runs that part alone).

Variants, one offload server after another beside the one no-connector server (the same
model, prompts and baseline, so their ratios compare): the product default (transfer_mode auto,
or KVOPS_BENCH_OFFLOAD_TRANSFER_MODE) gives the top-level keys and names the mode auto chose;
the other transfer mode fills ``modes``; then one variant per tuning knob (KNOBS) on the default's
mode (a knob of one mode only, on that mode) fills ``tuning`` (KVOPS_BENCH_OFFLOAD_TUNING=0 leaves the knobs out, a comma-separated list
of knob names measures those only). Each variant has its
own LMCache server and disk tier and its own fresh miss prompts.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast, get_args

import requests

from kvops.core.errors import BadInputError, KvopsError
from kvops.core.offload.preflight import shm_huge_pages
from kvops.core.offload.settings import OffloadSettings, TransferModeSetting
from kvops.core.proc import free_port, group_minor_faults
from kvops.core.prom import (
    MetricsSample,
    Samples,
    delta,
    info_labels,
    samples_by_name,
    scrape,
    selector_sum,
)
from kvops.core.units import GIB
from kvops.ops.bench import greedy, offload_copy
from kvops.ops.bench.offload_figures import Loads
from kvops.ops.bench.offload_report import (
    FirstPass,
    Gaps,
    Knob,
    Measured,
    assemble,
    outputs,
    variant_result,
)
from kvops.ops.capacity.weights import prefill_flops_per_token
from kvops.ops.launch import ManagedServer, vllm_server
from kvops.ops.models.tiny import TinyModelSpec, build_tiny_model, config_dict
from kvops.ops.offload.server import lmcache_server
from kvops.ops.offload.shm import remove_stale_segments
from kvops.ops.offload.status import counter_values

REFERENCE_SHAPE = TinyModelSpec(
    layers=8, hidden=1024, heads=8, kv_heads=8, head_dim=128, intermediate=2816,
)
PROMPT_TOKENS = 2048
REPEATS = 3
MISS_BLOCKS = 4
IDLE_GAP_S = 1.5
"""Pause after each request: a vLLM worker spins for 1 s after its last message before it sleeps
(vllm/distributed/device_communicators/shm_broadcast.py busy_loop_s), so the server that just
answered is idle again when the other one is measured."""
OUTPUT_TOKENS = 8
KV_CACHE_BYTES = GIB
KV_BYTES_PER_TOKEN = 2 * REFERENCE_SHAPE.layers * REFERENCE_SHAPE.kv_heads * REFERENCE_SHAPE.head_dim * 2
CYCLE_PROMPTS = KV_CACHE_BYTES // (PROMPT_TOKENS * KV_BYTES_PER_TOKEN) + 1
"""Fresh prompts served between the first pass and the measured one: one more than vLLM's KV
cache holds, so its allocator (free blocks are handed out oldest first) gives out every block
once and LMCache stores (copies, so maps) each of them."""
CYCLE_SEED = 10_000
TIME_SPLIT = ("queue", "prefill", "ttft")
"""Where a request's time goes, from vLLM's own histograms (kvops.core.prom.HISTOGRAMS), read
around the requests measured: queue (arrival to scheduled: the connector's lookup, and a hit's
load, run while the request waits), prefill (scheduled to first token: the step, with the
connector's store hand-over and block checksums), ttft (the engine's, without the HTTP front
end's share of the TTFT the client sees)."""
WORKER_COPY_ONLY_ENV = "KVOPS_BENCH_OFFLOAD_WORKER_COPY_ONLY"
"""=1: measure the worker-side copy alone (ops/bench/offload_copy.py, ~10 s, no server) and print
only ``worker_copy`` and ``bench_seconds``."""
SERVER_ARGS = ("--max-model-len", "4096", "--max-num-batched-tokens", "4096", "--max-num-seqs", "4")
SPLIT_ARGS = ("--max-model-len", "4096", "--max-num-batched-tokens", str(PROMPT_TOKENS - 1),
              "--max-num-seqs", "4")
"""The no-connector server whose chunked prefill splits a prompt where a full L1/disk hit does:
vLLM loads all but the last token and computes that one alone (its scheduler leaves at least one
token to compute). On an AMX CPU stock vLLM's eager greedy text moves with that split (6 of 6
prompts of the reference model, gaps up to 3.5 nats, against 0 on AVX2; its eager path there is
wrong on a real model: launch.EAGER_WRONG_ON_AMX), so a hit is judged against this server's text
as well as the unsplit one's."""


def torch_default_threads() -> int:
    """The intra-op threads torch gives a process of this environment: OMP_NUM_THREADS when set,
    else one per physical core (SMT siblings counted once), as ``torch.get_num_threads()`` reads
    in the `lmcache server` left at its default; here without importing torch."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    cores = set()
    for topology in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology"):
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:
            continue
    return len(cores) or os.cpu_count() or 1


KNOBS = (
    Knob("verify_kv", False, True,
         "bench only: the product keeps the block checksums (a corrupt cache file must be a miss, "
         "never wrong KV); measures what the xxh3 digest of every stored and loaded block costs"),
    Knob("chunk_size", 512, 256,
         "tokens per LMCache chunk: half as many chunks, RPC entries and keys per prompt"),
    Knob("load_wait_ms", 0, OffloadSettings().load_wait_ms,
         "vLLM's own polling: while loads run, the worker hands back an empty step at once "
         "(one every ~1.5 ms) instead of sleeping on the load"),
    Knob("lmcache_server_threads", 1, torch_default_threads(),
         "torch threads of the `lmcache server` process (OMP_NUM_THREADS=1 in its environment): "
         "its per-layer copy into vLLM's KV (lmcache_driven) runs on them while vLLM's own "
         "threads spin on the same cores", server_env=(("OMP_NUM_THREADS", "1"),)),
    Knob("worker_copy", "lmcache", OffloadSettings().worker_copy,
         "engine_driven only (measured there, compared with modes.engine_driven): LMCache's own "
         "per-layer index_copy_ in the worker instead of kvops' per-block copy "
         "(kvops.plugin.offload.worker_copy)", transfer_mode="engine_driven"),
)


_DONE: dict[str, Any] = {}
"""What this run has measured so far: ``worker_copy`` and each finished variant's ``Measured``."""


def partial() -> dict[str, Any] | None:
    """The variants a stopped run had finished (SIGTERM, Ctrl-C; ``kvops bench`` prints them with
    ``complete: false``), their ratios and figures as in a full run; None when none had."""
    measured: dict[str, Measured] = _DONE.get("variants", {})
    if not measured and "worker_copy" not in _DONE:
        return None
    memcpy = memcpy_gb_per_s() if measured else None
    return {"worker_copy": _DONE.get("worker_copy"), "memcpy_gb_per_s": memcpy,
            "variants": {name: variant_result(m, memcpy) for name, m in measured.items() if memcpy}}


def run() -> dict[str, Any]:
    started = time.monotonic()
    _DONE.clear()
    wanted, knobs_wanted = transfer_mode_from_env(), _knobs()
    worker_copy = offload_copy.measure()  # first, while no vLLM thread spins beside it
    _DONE["worker_copy"] = worker_copy
    if os.environ.get(WORKER_COPY_ONLY_ENV, "") == "1":
        return {"worker_copy": worker_copy, "bench_seconds": time.monotonic() - started}
    with tempfile.TemporaryDirectory(prefix="kvops-bench-offload-") as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "model", REFERENCE_SHAPE)
        # what the step computing a hit's last token reads besides the KV (the floor's bytes)
        weight_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        prompts = [_prompt(seed) for seed in range(2 * REPEATS + 1)]  # [0] warms up
        baseline = vllm_server(model, SERVER_ARGS, log_path=root / "vllm-baseline.log",
                               kv_cache_bytes=KV_CACHE_BYTES, name="vllm-baseline")
        try:
            baseline.start()
            bench = _Bench(model, prompts[:REPEATS + 1], prompts[REPEATS + 1:], root, baseline)
            bench.split_texts = _split_texts(model, [*bench.prompts[1:], *bench.steady_prompts], root)
            default, reason = bench.measure("default", {"transfer_mode": wanted})
            other = "engine_driven" if default.transfer_mode == "lmcache_driven" else "lmcache_driven"
            other_mode, _ = bench.measure(other, {"transfer_mode": other})
            knobs = [(knob, bench.measure(f"{knob.name}={knob.value}", {
                "transfer_mode": knob.transfer_mode or default.transfer_mode, **knob.overrides()},
                dict(knob.server_env))[0]) for knob in knobs_wanted]
        finally:
            baseline.stop()
        memcpy = memcpy_gb_per_s()
        digests = digest_ms_per_prompt()
    results = {m.transfer_mode: variant_result(m, memcpy) for m in (default, other_mode)}
    context = {
        "split_oracle": {
            "max_num_batched_tokens": PROMPT_TOKENS - 1, "prompts": len(bench.split_texts),
            "differs_from_unsplit": sum(split != text for split, (_, text)
                                        in zip(bench.split_texts, bench.baseline_runs, strict=False)),
        },
        "prompt_tokens": PROMPT_TOKENS,
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
        "hidden_size": REFERENCE_SHAPE.hidden,
        "layers": REFERENCE_SHAPE.layers,
        "transfer_mode_setting": wanted,
        "transfer_mode_reason": reason,
        "memcpy_gb_per_s": memcpy,
        "cold_prefill_tokens_per_s": PROMPT_TOKENS / results[default.transfer_mode]["ttft_s"]["no_connector"],
        "prefill_flops_per_token": prefill_flops_per_token(config_dict(REFERENCE_SHAPE)),
        "weight_bytes": weight_bytes,
        "shm_huge_pages": shm_huge_pages(),
        **digests,
        "worker_copy": worker_copy,
    }
    report = assemble(results[default.transfer_mode], results,
                      [(knob, variant_result(m, memcpy)) for knob, m in knobs], context)
    report["bench_seconds"] = time.monotonic() - started
    return report


def _split_texts(model: Path, prompts: list[list[int]], root: Path) -> list[str]:
    """The greedy text of each prompt on a no-connector server (as the baseline) whose prefill
    splits it as a full hit does (SPLIT_ARGS), started for this and stopped before any measurement."""
    server = vllm_server(model, SPLIT_ARGS, log_path=root / "vllm-split.log",
                         kv_cache_bytes=KV_CACHE_BYTES, name="vllm-split")
    try:
        server.start()
        return [ttft(server.url, model, prompt)[1] for prompt in prompts]
    finally:
        server.stop()


class _Bench:
    """Starts one offload variant at a time against the shared no-connector server."""

    def __init__(self, model: Path, prompts: list[list[int]], steady_prompts: list[list[int]],
                 root: Path, baseline: ManagedServer) -> None:
        """``prompts``: the first pass's, [0] warms up; ``steady_prompts``: the measured pass's
        (others: the first pass stored its prompts in LMCache)."""
        self.model, self.prompts, self.root, self.baseline = model, prompts, root, baseline
        self.steady_prompts = steady_prompts
        self.baseline_runs: list[tuple[float, str]] = []
        self.prefix_hits: list[float] = []
        """The same server's TTFT on each prompt of ``baseline_runs`` and one token more: vLLM's
        own prefix-cache hit computing one token (``_baseline``)."""
        self.split_texts: list[str] = []
        """The same-split server's texts on ``prompts[1:]`` then ``steady_prompts``."""
        self.variants = 0

    def measure(self, name: str, overrides: dict[str, Any],
                server_env: dict[str, str] | None = None) -> tuple[Measured, str]:
        """(measurements, the vLLM log's line on the transfer mode it runs)."""
        directory = self.root / name.replace("=", "-")
        settings = OffloadSettings(
            port=free_port(), http_port=free_port(), l1_gib=1.0,
            disk_path=str(directory / "l2"), disk_gib=4.0, **overrides,
        )
        self.variants += 1
        measured = _measure(self, settings, directory, miss_seed=100 + 20 * self.variants,
                            server_env=server_env)
        _DONE.setdefault("variants", {})[name] = measured[0]
        return measured


def _prompt(seed: int) -> list[int]:
    rng = random.Random(1000 + seed)
    return [rng.randrange(5, REFERENCE_SHAPE.vocab - 1) for _ in range(PROMPT_TOKENS)]


def _measure(bench: _Bench, settings: OffloadSettings, root: Path, miss_seed: int,
             server_env: dict[str, str] | None = None) -> tuple[Measured, str]:
    model = bench.model
    lmcache = lmcache_server(settings, log_path=root / "lmcache.log", env=server_env)
    lmcache.start(health_path="/healthcheck")
    cfg = json.dumps({"kvops": {"offload": settings.model_dump()}})
    log = root / "vllm-offload.log"
    server = vllm_server(model, (*SERVER_ARGS, "--additional-config", cfg), log_path=log,
                         kv_cache_bytes=KV_CACHE_BYTES, env={"VLLM_SERVER_DEV_MODE": "1"},
                         name="vllm-offload")
    try:
        server.start()
        sides = (("no_connector", bench.baseline.url), ("offload", server.url))
        info = metrics_samples(server.url)
        mode = _transfer_mode_of(info)
        l1_transfer = (info_labels(info, "kvops_info") or {}).get("offload_l1_transfer", "")
        first = _measure_tiers(server, lmcache, model, bench.prompts, settings.chunk_size,
                               warm_up=True)
        _cycle_kv_cache(server, lmcache, model, settings.chunk_size)
        steady = _measure_tiers(server, lmcache, model, bench.steady_prompts, settings.chunk_size,
                                warm_up=False)
        if not bench.baseline_runs:
            bench.baseline_runs, bench.prefix_hits = _baseline(bench.baseline.url, model,
                                                               [*bench.prompts, *bench.steady_prompts])
        before = {side: scrape(url) for side, url in sides}
        misses = _measure_misses(server, lmcache, bench.baseline, model, settings.chunk_size,
                                 miss_seed)
        miss_split = _TimeSplit()
        for side, url in sides:
            miss_split.add(side, before[side], scrape(url))
        metrics = metrics_samples(server.url)
        worker_copy = worker_copy_of(metrics)
    finally:
        server.stop()
        remove_stale_segments()  # lmcache_driven leaves vLLM's KV segment in /dev/shm
        lmcache.stop()
    first_count = len(first.runs["cold"])
    first_pass = FirstPass(runs=first.runs, baseline=bench.baseline_runs[:first_count],
                           split_baseline=bench.split_texts[:first_count],
                           load_gb_per_s=first.load_gb_per_s, server_faults=first.faults,
                           loads=first.loads)
    measured = Measured(
        transfer_mode=mode, l1_transfer=l1_transfer, worker_copy=worker_copy, runs=steady.runs, baseline=bench.baseline_runs[first_count:],
        split_baseline=bench.split_texts[first_count:],
        misses=misses, hits=steady.hits, load_gb_per_s=steady.load_gb_per_s,
        store_gb_per_s=_rate(metrics, "kvops_offload_stored_bytes_total",
                             "kvops_offload_store_seconds_sum"),
        settings=settings.model_dump(), miss_split=miss_split.means(),
        prefix_hits=bench.prefix_hits[first_count:],
        hit_split=steady.split.means(), server_faults=steady.faults, loads=steady.loads,
        first_pass=replace(first_pass, gaps=_score(bench, bench.prompts[1:], first_pass, first.token_ids)),
    )
    return replace(measured, gaps=_score(bench, bench.steady_prompts, measured, steady.token_ids)), _mode_line(log)


def _baseline(url: str, model: Path, prompts: list[list[int]]) -> tuple[list[tuple[float, str]], list[float]]:
    """The no-connector server on each prompt but the first (it warms up): (TTFT, text) cold, then
    the TTFT of the same prompt and one token more, which vLLM answers from its own prefix cache
    computing that one token, as an offload hit computes the prompt's last (the same prompt again
    would recompute its whole last block: vLLM keeps a block-aligned hit below the full prompt)."""
    cold: list[tuple[float, str]] = []
    hits: list[float] = []
    for prompt in prompts:
        cold.append(ttft(url, model, prompt))
        hits.append(ttft(url, model, [*prompt, prompt[0]])[0])
    return cold[1:], hits[1:]


def _score(bench: _Bench, prompts: list[list[int]], measured: FirstPass | Measured,
           token_ids: dict[str, list[tuple[int, ...]]]) -> Gaps:
    """The no-connector server's per-token gaps of each text that differs from its own, as the
    chaos bench scores them (ops/bench/greedy.py); run once the offload server is down, so the
    scoring prefills share the machine with no measurement."""
    gaps: Gaps = {tier: [None] * len(runs) for tier, runs in measured.runs.items()}
    for output in outputs(measured):
        if output.unexpected:
            gaps[output.tier][output.prompt] = tuple(greedy.gaps(
                bench.baseline.url, str(bench.model), prompts[output.prompt],
                token_ids[output.tier][output.prompt]))
    return gaps


def _transfer_mode_of(metrics: Samples) -> str:
    mode = (info_labels(metrics, "kvops_info") or {}).get("offload_transfer_mode")
    if not mode:
        raise KvopsError("the offload server's /metrics has no kvops_info offload_transfer_mode label")
    return mode


def worker_copy_of(metrics: Samples) -> str:
    """Which copy the engine_driven worker ran ("kvops" or "lmcache": the connector's
    kvops_offload_worker_copy{copy}), "" where none did (lmcache_driven: the server copies)."""
    return next((labels.get("copy", "") for labels, value in metrics.get("kvops_offload_worker_copy", [])
                 if value == 1), "")


def _mode_line(log: Path) -> str:
    """The preflight's line on the mode it chose and why (kvops.plugin.offload.wiring)."""
    marker = "kvops offload: transfer mode "
    lines = [line for line in log.read_text(errors="replace").splitlines() if marker in line]
    return lines[0].split(marker, 1)[1].strip() if lines else ""


@dataclass
class _Tiers:
    """One pass over prompts: their (TTFT, text) and generated token ids per tier, LMCache's hit
    tokens, vLLM's time split, the connector's load rate over the pass, the LMCache server's page
    faults per hit."""

    runs: dict[str, list[tuple[float, str]]] = field(
        default_factory=lambda: {"cold": [], "l1": [], "disk": []})
    token_ids: dict[str, list[tuple[int, ...]]] = field(
        default_factory=lambda: {"cold": [], "l1": [], "disk": []})
    hits: dict[str, float] = field(default_factory=lambda: {"l1": 0.0, "disk": 0.0})
    split: _TimeSplit = field(default_factory=lambda: _TimeSplit())
    faults: dict[str, list[int]] = field(default_factory=lambda: {"l1": [], "disk": []})
    loads: Loads = field(default_factory=lambda: {"l1": [], "disk": []})
    load_gb_per_s: float = 0.0


def _measure_tiers(server: ManagedServer, lmcache: ManagedServer, model: Path,
                   prompts: list[list[int]], chunk_size: int, warm_up: bool) -> _Tiers:
    """Each prompt cold, from L1, from disk; ``warm_up``: the first prompt is not counted."""
    tiers = _Tiers()
    chunks = PROMPT_TOKENS // chunk_size
    group = lmcache.process.pid if lmcache.process is not None else 0
    loads_before = metrics_samples(server.url)
    for index, prompt in enumerate(prompts):
        stored = _lmcache(lmcache)["l2_stored_chunks"]
        cold = stream(server.url, model, prompt)
        _wait_stored(lmcache, stored + chunks)
        _post(server.url + "/reset_prefix_cache")
        before = _lmcache(lmcache)
        l1, l1_first, l1_last, l1_faults = _hit(server, model, prompt, group)
        _post(lmcache.url + "/cache/clear")
        _post(server.url + "/reset_prefix_cache")
        middle = _lmcache(lmcache)
        disk, disk_first, disk_last, disk_faults = _hit(server, model, prompt, group)
        after = _lmcache(lmcache)
        _post(server.url + "/reset_prefix_cache")
        if warm_up and index == 0:
            continue
        for tier, (seconds, text, ids) in (("cold", cold), ("l1", l1), ("disk", disk)):
            tiers.runs[tier].append((seconds, text))
            tiers.token_ids[tier].append(ids)
        tiers.hits["l1"] += middle["hit_tokens_l1"] - before["hit_tokens_l1"]
        tiers.hits["disk"] += after["hit_tokens_l2"] - middle["hit_tokens_l2"]
        tiers.split.add("l1", l1_first, l1_last)
        tiers.split.add("disk", disk_first, disk_last)
        for tier, count in (("l1", l1_faults), ("disk", disk_faults)):
            if count is not None:
                tiers.faults[tier].append(count)
        tiers.loads["l1"].append(_load_of(l1_first, l1_last))
        tiers.loads["disk"].append(_load_of(disk_first, disk_last))
    loads_after = metrics_samples(server.url)
    tiers.load_gb_per_s = _rate_between(loads_before, loads_after, "kvops_offload_loaded_bytes_total",
                                        "kvops_offload_load_seconds_sum")
    return tiers


def _hit(server: ManagedServer, model: Path, prompt: list[int],
         group: int) -> tuple[tuple[float, str, tuple[int, ...]], MetricsSample, MetricsSample, int | None]:
    """One hit: (TTFT, text, token ids), vLLM's scrapes before it and once it is counted
    (_settled), and the minor page faults of the LMCache server's process ``group`` during it
    (None: no /proc)."""
    first, faults = scrape(server.url), group_minor_faults(group)
    hit = stream(server.url, model, prompt)
    faulted = group_minor_faults(group)
    during = None if faults is None or faulted is None else faulted - faults
    return hit, first, _settled(server.url, first), during


def _load_of(first: MetricsSample, last: MetricsSample) -> tuple[float, float]:
    """(bytes, seconds) the connector counted loading between two scrapes of vLLM's /metrics."""
    return (delta(first, last, "kvops_offload_loaded_bytes_total"),
            delta(first, last, "kvops_offload_load_seconds_sum"))


def _cycle_kv_cache(server: ManagedServer, lmcache: ManagedServer, model: Path,
                    chunk_size: int) -> None:
    """Serve CYCLE_PROMPTS fresh prompts (as many at once as the server runs) and wait for
    LMCache to store them, then empty vLLM's prefix cache and LMCache's L1: every KV block has
    been handed out and copied once, as on a server in service, and the pass measured next finds
    room in L1 as the first did."""
    stored = _lmcache(lmcache)["l2_stored_chunks"]
    prompts = [_prompt(CYCLE_SEED + i) for i in range(CYCLE_PROMPTS)]
    with ThreadPoolExecutor(int(SERVER_ARGS[SERVER_ARGS.index("--max-num-seqs") + 1])) as pool:
        list(pool.map(lambda prompt: ttft(server.url, model, prompt), prompts))
    _wait_stored(lmcache, stored + len(prompts) * PROMPT_TOKENS // chunk_size)
    _post(server.url + "/reset_prefix_cache")
    _post(lmcache.url + "/cache/clear")


class _TimeSplit:
    """vLLM's mean TIME_SPLIT seconds per label, over the windows added for it."""

    def __init__(self) -> None:
        self.totals: dict[str, dict[str, float]] = {}

    def add(self, label: str, first: MetricsSample, last: MetricsSample) -> None:
        totals = self.totals.setdefault(label, {})
        for key in TIME_SPLIT:
            for part in ("_sum", "_count"):
                totals[key + part] = totals.get(key + part, 0.0) + delta(first, last, key + part)

    def means(self) -> dict[str, dict[str, float | None]]:
        return {label: {key: t[key + "_sum"] / t[key + "_count"] if t[key + "_count"] else None
                        for key in TIME_SPLIT} for label, t in self.totals.items()}


def _settled(url: str, before: MetricsSample, timeout_s: float = 10.0) -> MetricsSample:
    """A scrape that counts the request finished after ``before`` (vLLM records a request's
    histograms as its output is processed, which may trail the end of the stream)."""
    deadline = time.monotonic() + timeout_s
    while True:
        sample = scrape(url)
        if delta(before, sample, "prefill_count") >= 1 or time.monotonic() > deadline:
            return sample
        time.sleep(0.05)


def _measure_misses(server: ManagedServer, lmcache: ManagedServer, baseline: ManagedServer,
                    model: Path, chunk_size: int, seed: int) -> dict[str, list[float]]:
    """Cold TTFTs of fresh prompts, ABBA per block: (no connector, offload) on one prompt, then
    (offload, no connector) on the next. Each offload round waits for LMCache's stores to end,
    so its disk writes do not land in the next round."""
    ttfts: dict[str, list[float]] = {"baseline": [], "offload": []}
    for block in range(MISS_BLOCKS):
        first, second = (_prompt(seed + 2 * block + i) for i in range(2))
        for side, prompt in (("baseline", first), ("offload", first),
                             ("offload", second), ("baseline", second)):
            target = server if side == "offload" else baseline
            stored = _lmcache(lmcache)["l2_stored_chunks"]
            ttfts[side].append(ttft(target.url, model, prompt)[0])
            if side == "offload":
                _wait_stored(lmcache, stored + PROMPT_TOKENS // chunk_size)
            time.sleep(IDLE_GAP_S)
    return ttfts


def ttft(url: str, model: Path, prompt: list[int]) -> tuple[float, str]:
    """(seconds to the first streamed token, greedy text) of one completion."""
    first, text, _ = stream(url, model, prompt)
    return first, text


def stream(url: str, model: Path, prompt: list[int]) -> tuple[float, str, tuple[int, ...]]:
    """(seconds to the first streamed token, greedy text, its token ids) of one completion; the
    ids (vLLM's ``return_token_ids``, per chunk) are what the reference scores when the text
    differs from its own. vLLM's first event carries every prompt id too (~14 KB for 2,048
    tokens): the response is read as its HTTP chunks arrive (``chunk_size=None``; vLLM streams
    chunked, one event per chunk), not one byte per call, which added 45-225 ms to a hit's TTFT
    on a 2-core box (issue 43)."""
    body = {"model": str(model), "prompt": prompt, "max_tokens": OUTPUT_TOKENS,
            "temperature": 0, "stream": True, "return_token_ids": True}
    started = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    ids: list[int] = []
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines(chunk_size=None):
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - started
            choice = json.loads(line[6:])["choices"][0]
            text.append(choice["text"])
            ids.extend(int(token) for token in choice.get("token_ids") or ())
    if first is None:
        raise KvopsError(f"{url} streamed no tokens")
    return first, "".join(text), tuple(ids)


def _lmcache(server: ManagedServer) -> dict[str, float]:
    values: dict[str, float] = counter_values(requests.get(server.url + "/metrics", timeout=10).text)
    return values


def _post(url: str) -> None:
    requests.post(url, timeout=60).raise_for_status()


def _wait_stored(lmcache: ManagedServer, chunks: float) -> None:
    _wait(lambda: _lmcache(lmcache)["l2_stored_chunks"] >= chunks)


def _wait(check: Callable[[], bool], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise KvopsError("LMCache did not store the prompt in time (see its log)")
        time.sleep(0.2)


def memcpy_gb_per_s(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Best-of-n plain copy between two pre-faulted buffers on this machine (decimal GB/s)."""
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


def digest_ms_per_prompt(repeats: int = 5) -> dict[str, float]:
    """What checking one prompt's blocks costs inside vLLM's step, on every store and L1/disk
    load: the connector's digest (xxh3 over every layer, read in place) beside the zlib CRC32
    that earlier kvops used, over KV of the reference shape in vLLM's CPU layout ([num_blocks,
    kv heads, 128-token block, 2 x head_dim], bf16); best of ``repeats``, milliseconds."""
    import zlib

    import torch

    from kvops.plugin.offload.integrity import BlockHasher, block_rows

    block, shape = 128, REFERENCE_SHAPE
    blocks = list(range(1, 1 + PROMPT_TOKENS // block))
    layers = [torch.randn(len(blocks) + 2, shape.kv_heads, block, 2 * shape.head_dim).to(torch.bfloat16)
              for _ in range(shape.layers)]
    rows = [block_rows(layer) for layer in layers]
    digest_of = BlockHasher(layers)

    def crc32(block_id: int) -> int:
        crc = 0
        for layer_rows in rows:
            crc = zlib.crc32(layer_rows[block_id], crc)
        return crc

    def best_ms(one: Callable[[int], int]) -> float:
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            for block_id in blocks:
                one(block_id)
            best = min(best, time.perf_counter() - started)
        return best * 1e3

    return {"digest_ms_per_prompt": best_ms(digest_of), "crc32_ms_per_prompt": best_ms(crc32)}


def metrics_samples(url: str) -> Samples:
    return samples_by_name(requests.get(url + "/metrics", timeout=10).text)


def _rate(metrics: Samples, bytes_name: str, seconds_name: str) -> float:
    """GB/s of a byte counter over its seconds counter, since the server started."""
    return _rate_between({}, metrics, bytes_name, seconds_name)


def _rate_between(first: Samples, last: Samples, bytes_name: str, seconds_name: str) -> float:
    """GB/s of a byte counter over its seconds counter, between two scrapes."""
    seconds = selector_sum(last, seconds_name) - selector_sum(first, seconds_name)
    moved = selector_sum(last, bytes_name) - selector_sum(first, bytes_name)
    return moved / seconds / 1e9 if seconds > 0 else 0.0


def transfer_mode_from_env(variable: str = "KVOPS_BENCH_OFFLOAD_TRANSFER_MODE") -> TransferModeSetting:
    """A bench's offload mode: the product default (auto) unless ``variable`` names one."""
    mode = os.environ.get(variable, "auto")
    for known in get_args(TransferModeSetting):
        if mode == known:
            return cast(TransferModeSetting, known)
    raise BadInputError(f"{variable}={mode!r}: use auto, engine_driven or lmcache_driven")


def _knobs() -> tuple[Knob, ...]:
    """The knobs KVOPS_BENCH_OFFLOAD_TUNING asks for: 1 (the default) all, 0 none, or knob names
    separated by commas (each variant is a server start and ~30 cold 2k-token prefills)."""
    value = os.environ.get("KVOPS_BENCH_OFFLOAD_TUNING", "1")
    if value in ("0", "1"):
        return KNOBS if value == "1" else ()
    names = [name.strip() for name in value.split(",")]
    known = {knob.name: knob for knob in KNOBS}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise BadInputError(f"KVOPS_BENCH_OFFLOAD_TUNING={value!r}: use 1 (measure every tuning "
                            "knob, the default), 0 (both modes only) or knob names separated by "
                            f"commas ({', '.join(known)})")
    return tuple(known[name] for name in dict.fromkeys(names))
