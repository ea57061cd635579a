"""The offload bench's JSON without a server: miss overhead from ABBA rounds and its spread, the
default variant's contract keys on top, both modes side by side, the tuning table's verdicts."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

import pytest

from kvops.ops.bench.offload import torch_default_threads
from kvops.ops.bench.offload_report import (
    FirstPass,
    Knob,
    Measured,
    assemble,
    miss_block_ratios,
    spread,
    variant_result,
)

CONTRACT_KEYS = {"prompt_tokens", "l1_ttft_ratio", "disk_ttft_ratio", "miss_overhead_ratio",
                 "copy_fraction_of_memcpy", "outputs_identical", "kv_bytes_per_token",
                 "hidden_size"}  # DESIGN.md: kvops bench offload --json


def test_a_drift_linear_within_a_block_cancels():
    # Rounds run baseline, offload, offload, baseline; the machine slows by 10% per round and
    # the connector costs exactly 5%. Comparing the sides' first rounds alone would say +15.5%.
    slow = [1.0 + 0.1 * i for i in range(8)]
    ttfts = {"baseline": [slow[0], slow[3], slow[4], slow[7]],
             "offload": [1.05 * slow[1], 1.05 * slow[2], 1.05 * slow[5], 1.05 * slow[6]]}
    assert miss_block_ratios(ttfts) == pytest.approx([0.05, 0.05])
    assert ttfts["offload"][0] / ttfts["baseline"][0] - 1 == pytest.approx(0.155)


def test_spread_orders_the_blocks():
    assert spread([0.3, -0.1, 0.1, 0.2]) == pytest.approx(
        {"min": -0.1, "q1": 0.05, "q3": 0.225, "max": 0.3})


def _measured(mode: str, l1: float, miss: float, load_gb_s: float = 1.0,
              text: str = "w5 w6", split: dict | None = None) -> Measured:
    """Three prompts, cold 2 s each, L1 hits at ``l1`` of cold (+-1%), disk hits at 0.1; the
    no-connector side 1 s per miss round, offload ``1 + miss`` (+-1% per block)."""
    cold = [(2.0, text)] * 3
    hits = [(2.0 * l1 * f, text) for f in (0.99, 1.0, 1.01)]
    misses = {"baseline": [1.0] * 8,
              "offload": [(1 + miss) * f for f in (0.99, 0.99, 1.0, 1.0, 1.0, 1.0, 1.01, 1.01)]}
    return Measured(transfer_mode=mode, runs={"cold": cold, "l1": hits, "disk": [(0.2, text)] * 3},
                    baseline=[(1.9, "w5 w6")] * 3, misses=misses, hits={"l1": 6144.0, "disk": 6144.0},
                    load_gb_per_s=load_gb_s, store_gb_per_s=0.5, miss_split=split or {})


def _report(default: Measured, other: Measured, tuned: list[tuple[Knob, Measured]]) -> dict:
    results = {m.transfer_mode: variant_result(m, memcpy_gb_per_s=10.0) for m in (default, other)}
    context = {"prompt_tokens": 2048, "kv_bytes_per_token": 32768, "hidden_size": 1024,
               "transfer_mode_setting": "auto"}
    rows = [(knob, variant_result(m, memcpy_gb_per_s=10.0)) for knob, m in tuned]
    return assemble(results[default.transfer_mode], results, rows, context)


def test_the_default_variant_gives_the_contract_keys_and_both_modes_sit_side_by_side():
    report = _report(_measured("lmcache_driven", l1=0.05, miss=0.02, load_gb_s=1.5),
                     _measured("engine_driven", l1=0.25, miss=0.20, load_gb_s=0.1,
                               split={"offload": {"queue": 0.01, "prefill": 1.2, "ttft": 1.21}}), [])
    assert CONTRACT_KEYS <= report.keys()
    assert report["transfer_mode"] == "lmcache_driven"
    assert report["transfer_mode_setting"] == "auto"
    assert report["l1_ttft_ratio"] == pytest.approx(0.05)
    assert report["disk_ttft_ratio"] == pytest.approx(0.1)
    assert report["miss_overhead_ratio"] == pytest.approx(0.02, abs=0.011)
    assert report["copy_fraction_of_memcpy"] == pytest.approx(0.15)
    assert report["outputs_identical"] is True
    assert report["store_fraction_of_memcpy"] is None  # lmcache_driven: the step is no copy
    modes = report["modes"]
    assert set(modes) == {"lmcache_driven", "engine_driven"}
    assert modes["engine_driven"]["l1_ttft_ratio"] == pytest.approx(0.25)
    assert modes["engine_driven"]["miss_overhead_ratio"] == pytest.approx(0.20, abs=0.013)
    assert modes["engine_driven"]["store_fraction_of_memcpy"] == pytest.approx(0.05)
    assert modes["lmcache_driven"]["l1_ttft_ratio"] == report["l1_ttft_ratio"]
    assert modes["engine_driven"]["miss_time_split_s"]["offload"]["queue"] == 0.01
    assert report["tuning"] == []


def test_outputs_differing_from_the_no_connector_server_are_reported():
    report = _report(_measured("lmcache_driven", 0.05, 0.02, text="w5 w7"),
                     _measured("engine_driven", 0.25, 0.2), [])
    assert report["outputs_identical"] is False
    assert report["modes"]["engine_driven"]["outputs_identical"] is True
    # not scored by the no-connector server: nothing shows they are ties, so all 9 count as wrong
    assert (report["wrong_outputs"], report["tie_flips"], report["outputs_correct"]) == (9, 0, False)
    assert report["modes"]["engine_driven"]["outputs_correct"] is True


EIGHT_TOKENS = (0.0,) * 8
BF16_STEP = 0.03125  # one bf16 step of the tiny model's logits in [4, 8) (ops/bench/greedy.py)


def _with_l1_texts(m: Measured, texts: list[str], l1_gaps: list[tuple[float, ...] | None]) -> Measured:
    """``m`` whose L1 hits gave ``texts`` (the no-connector server said "w5 w6" on each prompt),
    with the gaps the no-connector server scored for each (as kvops bench offload stores them)."""
    from dataclasses import replace

    runs = {**m.runs, "l1": [(seconds, text) for (seconds, _), text in zip(m.runs["l1"], texts, strict=True)]}
    return replace(m, runs=runs, gaps={"cold": [None] * 3, "l1": l1_gaps, "disk": [None] * 3})


def test_a_text_that_differs_only_by_a_tie_flip_is_correct_though_not_identical():
    """Two L1 hits differ from the no-connector server's text: one took a token tied exactly with
    the best (gap 0.0), the other one a bf16 step below it; both are greedy up to a tie."""
    tie = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    one_step = (0.0, 0.0, BF16_STEP, 0.0, 0.0, 0.0, 0.0, 0.0)
    default = _with_l1_texts(_measured("lmcache_driven", l1=0.05, miss=0.02),
                             ["w5 w6", "w5 w9", "w5 w7"], [None, tie, one_step])
    knob = Knob("chunk_size", 512, 256, "")
    report = _report(default, _measured("engine_driven", 0.25, 0.2), [(knob, default)])
    assert report["outputs_identical"] is False
    assert report["outputs_correct"] is True
    assert (report["tie_flips"], report["wrong_outputs"]) == (2, 0)
    assert report["max_logprob_gap"] == BF16_STEP
    assert [(d["pass"], d["tier"], d["prompt"], d["got"], d["verdict"]) for d in report["differing_outputs"]] == [
        ("measured", "l1", 1, "w5 w9", "tie_flip"), ("measured", "l1", 2, "w5 w7", "tie_flip")]
    assert report["differing_outputs"][1]["logprob_gaps"] == one_step
    assert report["modes"]["lmcache_driven"]["outputs_correct"] is True
    row = report["tuning"][0]
    assert (row["outputs_identical"], row["outputs_correct"], row["tie_flips"]) == (False, True, 2)


def test_a_text_whose_greedy_token_had_a_clear_margin_is_a_wrong_output():
    """The 6th token is 0.125 nats (four bf16 steps) below the no-connector server's best there:
    not a tie that flipped, so the variant's outputs are not correct."""
    clear_margin = (0.0, 0.0, 0.0, 0.0, 0.0, 0.125, 0.0, 0.0)
    default = _with_l1_texts(_measured("lmcache_driven", l1=0.05, miss=0.02),
                             ["w5 w6", "w5 w6", "w8 w6"], [None, None, clear_margin])
    report = _report(default, _measured("engine_driven", 0.25, 0.2), [])
    assert (report["outputs_identical"], report["outputs_correct"]) == (False, False)
    assert (report["wrong_outputs"], report["tie_flips"]) == (1, 0)
    assert report["max_logprob_gap"] == 0.125
    assert report["differing_outputs"] == [
        {"pass": "measured", "tier": "l1", "prompt": 2, "got": "w8 w6", "expected": "w5 w6",
         "logprob_gaps": clear_margin, "verdict": "wrong"}]
    assert report["modes"]["engine_driven"]["outputs_correct"] is True


def test_a_hit_that_equals_the_same_split_server_is_correct_but_a_cold_text_must_be_unsplit():
    """On an AMX CPU stock vLLM's greedy text moves with the prefill split: a hit (all but the
    last token loaded, that one computed) must equal the no-connector server whose prefill splits
    there, and is then correct though not identical, with no scoring; a cold text equal to it
    (a cold prefill has no split) and a hit equal to neither stay unexpected."""
    from dataclasses import replace

    m = _measured("lmcache_driven", l1=0.05, miss=0.02)
    m = replace(m, split_baseline=["w5 w8"] * 3,
                runs={"cold": [(2.0, "w5 w6"), (2.0, "w5 w6"), (2.0, "w5 w8")],
                      "l1": [(0.1, "w5 w8"), (0.1, "w5 w6"), (0.1, "w5 w9")],
                      "disk": [(0.2, "w5 w8")] * 3})
    report = _report(m, _measured("engine_driven", 0.25, 0.2), [])
    assert report["split_matched_outputs"] == 4  # l1 prompt 0, disk 0-2
    assert report["outputs_identical"] is False
    assert (report["wrong_outputs"], report["tie_flips"]) == (2, 0)  # cold 2, l1 2: not scored
    verdicts = {(d["tier"], d["prompt"]): d["verdict"] for d in report["differing_outputs"]}
    assert verdicts == {("cold", 2): "wrong", ("l1", 0): "split_matched", ("l1", 2): "wrong",
                        ("disk", 0): "split_matched", ("disk", 1): "split_matched",
                        ("disk", 2): "split_matched"}
    only_split = replace(m, runs={**m.runs, "cold": [(2.0, "w5 w6")] * 3, "l1": [(0.1, "w5 w8")] * 3})
    report = _report(only_split, _measured("engine_driven", 0.25, 0.2), [])
    assert (report["outputs_correct"], report["outputs_identical"], report["split_matched_outputs"]) == (True, False, 6)
    assert report["modes"]["lmcache_driven"]["split_matched_outputs"] == 6


def test_each_pass_scores_its_own_differences_and_the_variant_both():
    """A wrong disk hit in the first pass and a tie flip in the measured one: the first pass
    says wrong, the variant (top level) counts both and is not correct."""
    from dataclasses import replace

    steady = _with_l1_texts(_measured("lmcache_driven", l1=0.05, miss=0.02),
                            ["w5 w7", "w5 w6", "w5 w6"], [EIGHT_TOKENS, None, None])
    first = FirstPass(runs={"cold": [(2.0, "w5 w6")] * 3, "l1": [(0.12, "w5 w6")] * 3,
                            "disk": [(0.16, "w5 w6"), (0.16, "w9 w9"), (0.16, "w5 w6")]},
                      baseline=[(1.9, "w5 w6")] * 3, load_gb_per_s=0.8,
                      gaps={"disk": [None, (0.0, 2.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0), None]})
    report = _report(replace(steady, first_pass=first), _measured("engine_driven", 0.25, 0.2), [])
    fresh = report["first_pass"]
    assert (fresh["wrong_outputs"], fresh["tie_flips"], fresh["outputs_correct"]) == (1, 0, False)
    assert fresh["max_logprob_gap"] == 2.5
    assert (report["wrong_outputs"], report["tie_flips"], report["outputs_correct"]) == (1, 1, False)
    assert [(d["pass"], d["verdict"]) for d in report["differing_outputs"]] == [
        ("measured", "tie_flip"), ("first", "wrong")]



def test_the_first_pass_sits_beside_the_measured_one_and_its_outputs_count():
    """The fresh server's pass (before every KV block was handed out once) is reported apart;
    the top-level ratios are the later pass's; a wrong text in either pass makes outputs differ."""
    from dataclasses import replace

    steady = replace(_measured("lmcache_driven", l1=0.05, miss=0.02, load_gb_s=1.5),
                     server_faults={"l1": [3, 0, 1], "disk": [0, 0, 0]})
    cold_segment = FirstPass(runs={"cold": [(2.0, "w5 w6")] * 3,
                                   "l1": [(0.12, "w5 w6"), (0.14, "w5 w6"), (0.13, "w5 w6")],
                                   "disk": [(0.16, "w5 w6")] * 3},
                             baseline=[(1.9, "w5 w6")] * 3, load_gb_per_s=0.8,
                             server_faults={"l1": [16390, 16384, 16386], "disk": [16384] * 3})
    report = _report(replace(steady, first_pass=cold_segment), _measured("engine_driven", 0.25, 0.2), [])
    assert report["l1_ttft_ratio"] == pytest.approx(0.05)
    assert report["copy_fraction_of_memcpy"] == pytest.approx(0.15)
    assert report["server_page_faults_per_load"] == {"l1": 1, "disk": 0}
    first = report["first_pass"]
    assert first["l1_ttft_ratio"] == pytest.approx(0.13 / 2.0)
    assert first["disk_ttft_ratio"] == pytest.approx(0.08)
    assert first["copy_fraction_of_memcpy"] == pytest.approx(0.08)
    assert first["server_page_faults_per_load"] == {"l1": 16386, "disk": 16384}
    assert report["outputs_identical"] is True
    assert report["modes"]["lmcache_driven"]["first_pass"] == first
    assert report["modes"]["engine_driven"]["first_pass"] is None

    wrong = replace(cold_segment, runs={**cold_segment.runs, "disk": [(0.16, "w5 w7")] * 3})
    report = _report(replace(steady, first_pass=wrong), _measured("engine_driven", 0.25, 0.2), [])
    assert report["first_pass"]["outputs_identical"] is False
    assert report["outputs_identical"] is False

MIB = 1 << 20


def test_the_loads_own_figures_are_their_ms_per_mib_against_memcpy_and_what_a_hit_pays_besides():
    """Hand-computed: memcpy 10 GB/s moves a MiB in 1,048,576 / 1e10 s = 0.1048576 ms. Three L1
    hits load 64 MiB each in 50, 60 and 70 ms: 180 ms / 192 MiB = 0.9375 ms per MiB, 11.18% of
    memcpy; the median hit's TTFT (0.1 s = 0.05 x the 2 s cold) less its median load (60 ms)
    leaves 40 ms; 16,384 faults per 64 MiB hit are 256 per MiB. Disk hits loaded nothing the
    connector counted: None, not a division by zero."""
    from dataclasses import replace

    loads = {"l1": [(64 * MIB, 0.05), (64 * MIB, 0.06), (64 * MIB, 0.07)], "disk": [(0.0, 0.0)] * 3}
    measured = replace(_measured("lmcache_driven", l1=0.05, miss=0.02, load_gb_s=1.5), loads=loads,
                       server_faults={"l1": [16384] * 3, "disk": [0] * 3})
    report = _report(measured, _measured("engine_driven", 0.25, 0.2), [])
    assert report["memcpy_ms_per_mib"] == pytest.approx(0.1048576)
    assert report["load_ms_per_mib"] == {"l1": pytest.approx(0.9375), "disk": None}
    assert report["load_copy_fraction_of_memcpy"]["l1"] == pytest.approx(0.1048576 / 0.9375)
    assert report["load_mib_per_hit"]["l1"] == 64
    assert report["load_s_per_hit"]["l1"] == pytest.approx(0.06)
    assert report["hit_overhead_s"]["l1"] == pytest.approx(0.04)
    assert report["server_page_faults_per_mib"] == {"l1": 256, "disk": None}
    assert report["modes"]["lmcache_driven"]["load_ms_per_mib"] == report["load_ms_per_mib"]


@pytest.mark.parametrize(("l1", "load_gb_s", "met"), [
    (0.18, 1.1, {"copy_goal_met": False, "copy_moonshot_met": False, "l1_goal_met": False}),  # issue 43's AMX run
    (0.04, 3.5, {"copy_goal_met": True, "copy_moonshot_met": False, "l1_goal_met": True}),
    (0.04, 6.0, {"copy_goal_met": True, "copy_moonshot_met": True, "l1_goal_met": True}),
])
def test_the_goal_is_copy_at_030_of_memcpy_and_l1_at_005_of_recompute_with_correct_outputs(l1, load_gb_s, met):
    report = _report(_measured("lmcache_driven", l1=l1, miss=0.0, load_gb_s=load_gb_s),
                     _measured("engine_driven", 0.25, 0.2), [])
    goals = report["goals"]
    assert {key: goals[key] for key in met} == met
    assert (goals["copy_fraction_of_memcpy_min"], goals["copy_fraction_of_memcpy_moonshot"],
            goals["l1_ttft_ratio_max"]) == (0.30, 0.50, 0.05)
    assert report["goal_met"] is (met["copy_goal_met"] and met["l1_goal_met"])
    wrong = _report(_measured("lmcache_driven", l1=l1, miss=0.0, load_gb_s=load_gb_s, text="w5 w7"),
                    _measured("engine_driven", 0.25, 0.2), [])
    assert wrong["goal_met"] is False  # an unscored differing text counts as wrong


def test_the_reference_models_prefill_flops_are_its_linears():
    """Per layer of 8: q, k, v, o 1024 x 1024 each (8 KV heads x 128), gate and up 1024 x 2816,
    down 2816 x 1024: 12,845,056 weights; x 8 x 2 FLOPs; the LM head runs for the last token only."""
    from kvops.ops.bench.offload import REFERENCE_SHAPE
    from kvops.ops.capacity.weights import prefill_flops_per_token
    from kvops.ops.models.tiny import config_dict

    assert prefill_flops_per_token(config_dict(REFERENCE_SHAPE)) == 2 * 8 * (4 * 1024 * 1024 + 3 * 1024 * 2816)


def test_a_knob_is_judged_against_the_default_measured_in_the_same_run():
    default = _measured("lmcache_driven", l1=0.07, miss=0.15)
    checksums_off = Knob("verify_kv", False, True, "bench only")
    bigger_chunks = Knob("chunk_size", 512, 256, "")
    noisy = Knob("chunk_size", 128, 256, "")
    report = _report(default, _measured("engine_driven", 0.25, 0.2), [
        (checksums_off, _measured("lmcache_driven", l1=0.04, miss=0.03)),
        (bigger_chunks, _measured("lmcache_driven", l1=0.10, miss=0.15)),
        (noisy, _measured("lmcache_driven", l1=0.0705, miss=0.152)),
    ])
    off, chunks, within = report["tuning"]
    assert (off["knob"], off["value"], off["default"]) == ("verify_kv", False, True)
    assert off["miss_overhead_ratio"] == pytest.approx(0.03, abs=0.011)
    assert off["delta_vs_default"]["miss_overhead_ratio"] == pytest.approx(-0.12, abs=0.02)
    assert off["delta_vs_default"]["l1_ttft_ratio"] == pytest.approx(-0.03)
    assert off["effect"] == "helps"
    assert chunks["effect"] == "hurts"  # L1 hit 0.07 -> 0.10, miss unchanged
    assert within["effect"] == "no clear effect"  # moves inside the variants' own spread
    assert report["miss_overhead_ratio"] == pytest.approx(0.15, abs=0.012)  # top level: default


def test_a_knob_of_one_transfer_mode_is_judged_against_that_modes_variant():
    """worker_copy acts only in engine_driven: on an lmcache_driven default it is measured in
    engine_driven and compared with the engine_driven variant of the same run, not the default."""
    from kvops.ops.bench.offload import KNOBS

    (knob,) = [k for k in KNOBS if k.name == "worker_copy"]
    assert (knob.value, knob.default, knob.transfer_mode) == ("lmcache", "kvops", "engine_driven")
    report = _report(_measured("lmcache_driven", l1=0.07, miss=0.15),
                     _measured("engine_driven", 0.10, 0.2),
                     [(knob, _measured("engine_driven", l1=0.20, miss=0.2))])
    (row,) = report["tuning"]
    assert row["compared_with_transfer_mode"] == "engine_driven"
    assert row["delta_vs_default"]["l1_ttft_ratio"] == pytest.approx(0.10)  # 0.20 - 0.10, not - 0.07
    assert row["effect"] == "hurts"


def test_an_lmcache_server_environment_knob_changes_no_offload_setting():
    """The thread-count knob runs the LMCache server with another environment: the variant's
    offload settings are the default's, and its row says which environment it ran with."""
    from kvops.ops.bench.offload import KNOBS

    threads = next(k for k in KNOBS if k.server_env)
    assert threads.overrides() == {}
    assert dict(threads.server_env) == {"OMP_NUM_THREADS": "1"}
    assert Knob("chunk_size", 512, 256, "").overrides() == {"chunk_size": 512}
    report = _report(_measured("lmcache_driven", l1=0.07, miss=0.15),
                     _measured("engine_driven", 0.25, 0.2),
                     [(threads, _measured("lmcache_driven", l1=0.06, miss=0.15)),
                      (Knob("chunk_size", 512, 256, ""), _measured("lmcache_driven", 0.07, 0.15))])
    env_row, setting_row = report["tuning"]
    assert env_row["server_env"] == {"OMP_NUM_THREADS": "1"}
    assert "server_env" not in setting_row


def test_the_tuning_variable_selects_knobs_by_name_and_names_the_known_ones(monkeypatch):
    from kvops.core.errors import BadInputError
    from kvops.ops.bench.offload import KNOBS, _knobs

    monkeypatch.delenv("KVOPS_BENCH_OFFLOAD_TUNING", raising=False)
    assert _knobs() == KNOBS
    monkeypatch.setenv("KVOPS_BENCH_OFFLOAD_TUNING", "0")
    assert _knobs() == ()
    monkeypatch.setenv("KVOPS_BENCH_OFFLOAD_TUNING", "lmcache_server_threads, verify_kv")
    assert [k.name for k in _knobs()] == ["lmcache_server_threads", "verify_kv"]
    for bad in ("threads", "", "verify_kv,,chunk_size"):
        monkeypatch.setenv("KVOPS_BENCH_OFFLOAD_TUNING", bad)
        with pytest.raises(BadInputError) as caught:
            _knobs()
        assert str(caught.value).startswith(f"KVOPS_BENCH_OFFLOAD_TUNING={bad!r}")
        assert "chunk_size" in str(caught.value)
        assert "\n" not in str(caught.value)


def test_the_digest_cost_is_measured_beside_the_crc32_it_replaced():
    """Both are timed on the same KV of the reference shape in one call (kvops bench offload
    reports them as digest_ms_per_prompt and crc32_ms_per_prompt); no speed is asserted here."""
    from kvops.ops.bench.offload import digest_ms_per_prompt

    costs = digest_ms_per_prompt(repeats=1)
    assert set(costs) == {"digest_ms_per_prompt", "crc32_ms_per_prompt"}
    assert all(0 < ms < float("inf") for ms in costs.values())


@pytest.mark.parametrize("omp", [None, "1"])
def test_the_threads_knobs_default_is_torchs_own(monkeypatch, omp):
    """The oracle is torch itself, in a process of the same environment (as the `lmcache
    server` gets it): the row's `default` must be what the server really ran with."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    torch_says = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                                env=env, capture_output=True, text=True, check=True, timeout=120)
    assert torch_default_threads() == int(torch_says.stdout)


@pytest.mark.parametrize(("prefix_hits", "floor", "reachable"), [
    ([0.09, 0.1, 0.11], 0.1 / 1.9, False),  # above 0.05: no transfer could meet the goal here
    ([0.04, 0.05, 0.06], 0.05 / 1.9, True),
])
def test_vllms_own_prefix_hit_is_the_floor_under_an_l1_hit_and_says_whether_the_goal_is_reachable(
        prefix_hits, floor, reachable):
    """Hand-computed: L1 hits at 0.1 of the 2 s cold TTFT are 0.2 s (median) and load in 60 ms
    (median of 50/60/70); the no-connector server answers the same prompts cold in 1.9 s and
    again from its prefix cache in ``prefix_hits`` (median 0.1 or 0.05 s). The hit costs 0.1 (or
    0.15) s above vLLM's own hit, 0.04 (0.09) s of it besides the load; the floor is the prefix
    hit over 1.9 s."""
    from dataclasses import replace

    loads = {"l1": [(64 * MIB, 0.05), (64 * MIB, 0.06), (64 * MIB, 0.07)], "disk": [(0.0, 0.0)] * 3}
    measured = replace(_measured("engine_driven", l1=0.1, miss=0.0, load_gb_s=6.0), loads=loads,
                       prefix_hits=prefix_hits)
    report = _report(measured, _measured("lmcache_driven", 0.25, 0.2), [])
    prefix = statistics.median(prefix_hits)
    assert report["prefix_hit_ttft_s"] == pytest.approx(prefix)
    assert report["prefix_hit_ttft_ratio"] == pytest.approx(floor)
    assert report["hit_over_prefix_hit_s"]["l1"] == pytest.approx(0.2 - prefix)
    assert report["offload_overhead_s"]["l1"] == pytest.approx(0.2 - prefix - 0.06)
    assert report["offload_overhead_s"]["disk"] is None  # disk loaded nothing the connector counted
    assert report["goals"]["l1_ttft_ratio_floor"] == pytest.approx(floor)
    assert report["goals"]["l1_goal_reachable"] is reachable
    assert report["modes"]["engine_driven"]["hit_over_prefix_hit_s"] == report["hit_over_prefix_hit_s"]


def test_without_vllms_own_hit_measured_the_floor_is_unknown_not_zero():
    report = _report(_measured("engine_driven", l1=0.1, miss=0.0), _measured("lmcache_driven", 0.25, 0.2), [])
    assert report["prefix_hit_ttft_s"] is None
    assert report["prefix_hit_ttft_ratio"] is None
    assert report["hit_over_prefix_hit_s"] == {"l1": None, "disk": None}
    assert report["goals"]["l1_goal_reachable"] is None


def test_the_worker_copy_is_read_from_the_connectors_gauge_and_reported_per_mode():
    from dataclasses import replace

    from kvops.core.prom import samples_by_name
    from kvops.ops.bench.offload import worker_copy_of

    page = ('# TYPE kvops_offload_worker_copy gauge\n'
            'kvops_offload_worker_copy{engine="0",model_name="m",copy="kvops"} 1.0\n'
            'kvops_offload_worker_copy{engine="0",model_name="m",copy="lmcache"} 0.0\n')
    assert worker_copy_of(samples_by_name(page)) == "kvops"
    assert worker_copy_of(samples_by_name("# TYPE kvops_offload_worker_copy gauge\n")) == ""
    report = _report(replace(_measured("engine_driven", 0.05, 0.0), worker_copy="kvops"),
                     _measured("lmcache_driven", 0.25, 0.2), [])
    assert report["worker_copy_used"] == "kvops"
    assert report["modes"]["lmcache_driven"]["worker_copy_used"] == ""
    default = variant_result(replace(_measured("engine_driven", 0.05, 0.0), worker_copy="kvops"), 10.0)
    timings = {"best": "kvops_worker"}  # the top level's worker_copy: the copy timed in-process
    assert assemble(default, {"engine_driven": default}, [], {"worker_copy": timings})["worker_copy"] == timings
