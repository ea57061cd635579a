"""``kvops bench planner``: agreement with vLLM's allocator, and plan time vs importing vLLM.

The comparison runs in a subprocess that imports vLLM (the planner itself never does), over the
fixture configs × budgets × max_model_len × kv dtypes (plus pipeline-parallel splits, and the
families with their own oracles: DeepSeek-V3.2 sparse MLA, Gemma-4 per-layer head dims,
speculative decoding, VLLM_PP_LAYER_PARTITION, every vLLM KV cache dtype with and without
--kv-cache-dtype-skip-layers on cuda and cpu), and counts exact (num_blocks, tokens,
concurrency) agreements.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvops.ops.bench import gpu_logs

_ORACLE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import test_capacity_oracle as t
o, exact, total = t.Oracle(), 0, 0
for path in t.FIXTURE_FILES:
    cfg = json.loads(path.read_text()); cfg.setdefault("torch_dtype", "bfloat16")
    for budget in t.BUDGETS:
        for mml in (4096, 32000):
            for kv in ("auto", "fp8"):
                case = {"budget": budget, "mml": mml, "tp": 1, "kv": kv, "device": "cuda", "mnbt": 2048}
                total += 1
                exact += o.run(cfg, case) == t.ours(cfg, case)
pp_exact, pp_total = 0, 0
for path in t.FIXTURE_FILES:
    cfg = json.loads(path.read_text()); cfg.setdefault("torch_dtype", "bfloat16")
    if "hybrid_override_pattern" in cfg:
        continue  # the oracle numbers Nemotron-H layers without its MLP slots: PP would split differently
    for pp in (2, 3):
        case = {"budget": 20 * 2**30, "mml": 32000, "tp": 1, "kv": "auto", "device": "cuda", "mnbt": 2048, "pp": pp}
        pp_total += 1
        pp_exact += t.run_pp(o, cfg, case) == t.ours_pp(cfg, case)
import os
import test_capacity_oracle_gemma4 as g4, test_capacity_oracle_pp_partition as ppp
import test_capacity_oracle_sparse_mla as smla, test_capacity_oracle_speculative as spd
families = {}
def count(name, expected, got):
    done = families.setdefault(name, [0, 0]); done[0] += expected == got; done[1] += 1
sparse = smla.SparseOracle(o)
for name, (cfg, indexed) in smla.CONFIGS.items():
    for kv in ("auto", "fp8", "fp8_e4m3"):
        for budget, mml in ((int(2.5 * 2**30), 4096), (20 * 2**30, 32000)):
            case = {"budget": budget, "mml": mml, "tp": 1, "kv": kv, "device": "cuda", "mnbt": 2048}
            count("sparse_mla", sparse.run(cfg, case, indexed), smla.ours(cfg, case))
gemma = g4.Gemma4Oracle(o)
for cfg in g4.CONFIGS.values():
    for kv in ("auto", "fp8"):
        for tp in (1, 2):
            case = {"budget": 20 * 2**30, "mml": 32768, "tp": tp, "kv": kv, "device": "cuda", "mnbt": 2048}
            count("gemma4_head_dims", gemma.run(cfg, case), g4.ours(cfg, case))
for name in ("gpt_oss_20b", "qwen3_next", "nemotron_h"):
    cfg = spd.config(name)
    for method, k, draft in spd.METHODS:
        case = {"budget": 20 * 2**30, "mml": 32000, "tp": 8 if name == "nemotron_h" else 2, "kv": "auto",
                "device": "cuda", "mnbt": 2048, "method": method, "k": k, "draft": draft}
        count("speculative", spd.run_vllm(o, cfg, case), spd.ours(cfg, case))
for name in ("llama_8b", "deepseek_v3", "qwen3_next"):
    cfg = ppp.config(name)
    for split in ppp.partitions(cfg["num_hidden_layers"]):
        os.environ["VLLM_PP_LAYER_PARTITION"] = split
        case = {"budget": 20 * 2**30, "mml": 32000, "tp": 1, "kv": "auto", "device": "cuda", "mnbt": 2048,
                "pp": split.count(",") + 1, "split": split}
        count("pp_layer_partition", t.run_pp(o, cfg, case), ppp.ours(cfg, case))
os.environ.pop("VLLM_PP_LAYER_PARTITION")
import test_capacity_oracle_kv_dtypes as kvd
dtypes = kvd.DtypeOracle(o)
for name in kvd.CONFIGS:
    cfg = kvd.load(name)
    for kv in kvd.cache_dtypes():
        for skip in kvd.SKIPS[name][:2]:
            for device in ("cuda", "cpu"):  # a dtype the device cannot run: both must refuse it
                case = {"budget": 20 * 2**30, "mml": 32000, "tp": 1 if "DeepSeek" in name else 2, "kv": kv,
                        "skip": skip, "device": device, "mnbt": 2048}
                count("kv_dtypes", dtypes.run(cfg, case), kvd.ours(cfg, case))
more_exact, more_total = (sum(v[i] for v in families.values()) for i in (0, 1))
print(json.dumps({"exact_cases": exact + pp_exact + more_exact, "total_cases": total + pp_total + more_total,
                  "pp_exact_cases": pp_exact, "pp_total_cases": pp_total,
                  "families": {k: {"exact_cases": v[0], "total_cases": v[1]} for k, v in families.items()}}))
"""


def _repo_tests() -> Path:
    return Path(__file__).resolve().parents[2] / "tests" / "ops"


def _time_plan() -> float:
    start = time.perf_counter()
    # The whole `kvops plan` (allocator, max_num_seqs, offload, validated kvops.yaml) in a fresh process.
    subprocess.run([str(Path(sys.executable).parent / "kvops"), "plan", "--config",
                    str(_repo_tests().parents[1] / "../shared/fixtures/model-configs/meta-llama--Meta-Llama-3.1-8B.json"),
                    "--gpu", "H100", "--max-model-len", "8192", "--p50", "1000", "--p95", "4000",
                    "--distinct-prefixes", "100", "--prefix-tokens", "2000", "--json"],
                   check=True, capture_output=True)
    return time.perf_counter() - start


def run() -> dict[str, Any]:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import vllm.v1.core.kv_cache_utils"], check=True, capture_output=True)
    import_s = time.perf_counter() - start
    plan_s = _time_plan()
    out = subprocess.run([sys.executable, "-c", _ORACLE, str(_repo_tests())], check=True,
                         capture_output=True, text=True)
    agreement = json.loads(out.stdout.strip().splitlines()[-1])
    return {**agreement, "plan_seconds": plan_s, "import_vllm_seconds": import_s,
            "speed_ratio": plan_s / import_s, **gpu_logs.run()}
