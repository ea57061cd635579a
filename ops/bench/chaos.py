"""``kvops bench chaos --json``: the fault list against real servers under load.

A tiny model is built on the spot. A server without the plugin (VLLM_PLUGINS=none) answers every
prompt the run will send first: its greedy outputs are the oracle for wrong outputs. It stops,
and a real ``lmcache server`` (disk tier on a small tmpfs when run as root) and a vLLM server
with the kvops offload connector start, its own KV cache too small to keep the prompts between
their turns (so repeats load from LMCache). Then, per fault, in turn: load runs (a few clients,
greedy), the fault is
injected, held ``--fault-seconds``, cleared, and health is probed once a second until it has
held for a few probes (or RECOVERY_TIMEOUT_S). recovery_s counts from the start of the clear
(a restart of a killed server is part of recovering). An engine that died is counted and
restarted before the next fault. Goal per fault (issue 15): lost 0, wrong 0, crashes 0.
The offload server runs the product default (transfer_mode auto) unless
KVOPS_BENCH_CHAOS_TRANSFER_MODE names a mode; ``transfer_mode`` and ``l1_transfer`` say what it
resolved to (its kvops_info), since the faults strike each mode differently.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvops.core.errors import BadInputError
from kvops.core.offload.settings import OffloadSettings, TransferModeSetting
from kvops.core.proc import free_port
from kvops.core.prom import info_labels
from kvops.ops.bench import greedy
from kvops.ops.bench.chaos_faults import Fault, Rig, choose, mount_tmpfs, unmount
from kvops.ops.bench.chaos_load import Load, complete, healthy, token_prompt
from kvops.ops.bench.chaos_report import FaultRun, Probe, chaos_report
from kvops.ops.bench.offload import metrics_samples, transfer_mode_from_env
from kvops.ops.launch import ManagedServer, vllm_server
from kvops.ops.models.tiny import TinyModelSpec, build_tiny_model
from kvops.ops.offload.server import lmcache_server
from kvops.ops.offload.shm import remove_stale_segments

MODE_ENV = "KVOPS_BENCH_CHAOS_TRANSFER_MODE"
FAULT_S = 15.0
WARM_S = 5.0
PROMPTS_PER_FAULT = 12  # 24 chunks of 512 KiB: more than the 16 MiB disk cap holds
RECOVERY_TIMEOUT_S = 120.0
STABLE_PROBES = 5
DISK_GIB = 0.016
SERVER_ARGS = ("--max-model-len", "2048")
BLOCK_BYTES = 128 * 2 * 4 * 2 * 64 * 2  # CPU block of 128 tokens x K+V x layers x kv heads x head_dim x bf16
KV_BLOCKS = 33
"""32 usable blocks (+ vLLM's null block): 4 running 600-token prompts take 20, and 6 of the 12
prompts of a fault fit, so a prompt is evicted before its next turn."""


def run(faults: str = "", fault_seconds: float = FAULT_S) -> dict[str, Any]:
    chosen = choose(faults)
    if not 1 <= fault_seconds <= 600:
        raise BadInputError(f"--fault-seconds {fault_seconds:g}: give 1 to 600")
    started = time.monotonic()
    setting = transfer_mode_from_env(MODE_ENV)
    with tempfile.TemporaryDirectory(prefix="kvops-bench-chaos-") as tmp:
        root = Path(tmp)
        model = str(build_tiny_model(root / "model", TinyModelSpec()))
        seeds = {f.name: [1000 * i + j for j in range(PROMPTS_PER_FAULT)] for i, f in enumerate(chosen, 1)}
        oracle = _stock_outputs(model, [s for group in seeds.values() for s in group], root)
        rigged, mode = _with_rig(root, model, chosen, seeds, oracle, fault_seconds, setting)
        runs = _scored(rigged, model, root)
    return chaos_report(
        runs, transfer_mode_setting=setting, **mode, fault_seconds=fault_seconds,
        prompts_per_fault=PROMPTS_PER_FAULT,
        oracle_prompts_with_two_outputs=sum(len(texts) > 1 for texts in oracle.values()),
        descriptions={f.name: f.why for f in chosen}, bench_s=round(time.monotonic() - started, 1),
    )


def _stock_outputs(model: str, seeds: Sequence[int], root: Path) -> dict[int, tuple[str, ...]]:
    """Each prompt twice in a row on a server without the plugin: cold, then with its prefix
    from vLLM's own cache (512 tokens, four 128-token blocks: the span an LMCache hit loads)."""
    stock = vllm_server(model, SERVER_ARGS, log_path=root / "vllm-stock.log",
                        env={"VLLM_PLUGINS": "none"}, name="vllm-stock")

    def both(seed: int) -> tuple[str, ...]:
        cold = complete(stock.url, model, token_prompt(seed))
        return tuple(dict.fromkeys((cold, complete(stock.url, model, token_prompt(seed)))))

    try:
        stock.start()
        with ThreadPoolExecutor(max_workers=4) as pool:
            return dict(zip(seeds, pool.map(both, seeds), strict=True))
    finally:
        stock.stop()


def _scored(runs: list[FaultRun], model: str, root: Path) -> list[FaultRun]:
    """Completions whose text is none of the oracle's, scored token by token by a server without
    the plugin (started again only when there are any): wrong, or a near-tie flip."""
    if not any(s.unexpected for run in runs for s in run.sent):
        return runs
    stock = vllm_server(model, SERVER_ARGS, log_path=root / "vllm-stock-scoring.log",
                        env={"VLLM_PLUGINS": "none"}, name="vllm-stock")
    try:
        stock.start()
        return [replace(run, sent=[
            replace(s, gaps=tuple(greedy.gaps(stock.url, model, token_prompt(s.prompt), s.token_ids)))
            if s.unexpected else s for s in run.sent]) for run in runs]
    finally:
        stock.stop()


def _with_rig(root: Path, model: str, chosen: Sequence[Fault], seeds: dict[str, list[int]],
              oracle: dict[int, tuple[str, ...]], fault_seconds: float,
              transfer_mode: TransferModeSetting) -> tuple[list[FaultRun], dict[str, str]]:
    mount = root / "fs" if any(f.needs_root for f in chosen) else None
    disk = (mount or root) / "l2"
    if mount is not None:
        mount_tmpfs(mount)
    disk.mkdir(parents=True)
    settings = OffloadSettings(port=free_port(), http_port=free_port(), l1_gib=0.25, disk_path=str(disk),
                               disk_gib=DISK_GIB, heartbeat_s=1.0, canary_interval_s=3600,
                               transfer_mode=transfer_mode)
    lmcache = lmcache_server(settings, log_path=root / "lmcache-1.log")
    rig = Rig(root, settings, lmcache, _offload_vllm(model, settings, root, 1), model, mount)
    try:
        lmcache.start(health_path="/healthcheck", timeout_s=240)
        rig.vllm.start()
        info = info_labels(metrics_samples(rig.vllm.url), "kvops_info") or {}
        mode = {"transfer_mode": info.get("offload_transfer_mode", ""),
                "l1_transfer": info.get("offload_l1_transfer", "")}
        runs = []
        for index, fault in enumerate(chosen, 1):
            prompts = [(seed, oracle[seed]) for seed in seeds[fault.name]]
            runs.append(_run_fault(rig, fault, prompts, fault_seconds, probe_seeds=100_000 * index))
            _restore(rig, index)
        return runs, mode
    finally:
        rig.vllm.stop()
        remove_stale_segments()
        rig.lmcache.stop(grace_s=5)
        if mount is not None:
            unmount(mount)


def _offload_vllm(model: str, settings: OffloadSettings, root: Path, start: int) -> ManagedServer:
    config = json.dumps({"kvops": {"offload": settings.model_dump()}})
    return vllm_server(model, (*SERVER_ARGS, "--additional-config", config),
                       log_path=root / f"vllm-offload-{start}.log", kv_cache_bytes=KV_BLOCKS * BLOCK_BYTES,
                       name="vllm-offload")


def _run_fault(rig: Rig, fault: Fault, prompts: list[tuple[int, tuple[str, ...]]], fault_seconds: float,
               probe_seeds: int) -> FaultRun:
    log_mark = _dead_engine_lines(rig.vllm)
    load = Load(rig.vllm.url, rig.model, prompts)
    load.start()
    try:
        time.sleep(WARM_S)
        fault.inject(rig)
        time.sleep(fault_seconds)
        cleared_at = time.monotonic()
        fault.clear(rig)
        probes = _probe_until_stable(rig, probe_seeds)
    finally:
        sent = load.stop()
    crashed = rig.vllm.returncode() is not None or _dead_engine_lines(rig.vllm) > log_mark
    return FaultRun(fault.name, sent, cleared_at, probes, engine_crashes=int(crashed))


def _probe_until_stable(rig: Rig, first_seed: int) -> list[Probe]:
    probes: list[Probe] = []
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while time.monotonic() < deadline:
        ok = rig.vllm.returncode() is None and healthy(rig.vllm.url, rig.model, first_seed + len(probes))
        probes.append(Probe(time.monotonic(), ok))
        if len(probes) >= STABLE_PROBES and all(p.healthy for p in probes[-STABLE_PROBES:]):
            break
        if rig.vllm.returncode() is not None:
            break  # dead: counted as a crash, no recovery
        time.sleep(1.0)
    return probes


def _restore(rig: Rig, index: int) -> None:
    """Whatever a fault left broken is made whole before the next one (a dead engine restarted,
    a dead or frozen LMCache restarted), so faults do not add up."""
    if rig.lmcache.returncode() is not None:
        rig.restart_lmcache()
    if rig.vllm.returncode() is not None or _dead_engine_lines(rig.vllm):
        rig.vllm.stop()
        rig.vllm = _offload_vllm(rig.model, rig.settings, rig.root, index + 1)
        rig.vllm.start()


def _dead_engine_lines(server: ManagedServer) -> int:
    try:
        return server.log_path.read_text(errors="replace").count("EngineDeadError")
    except OSError:
        return 0
