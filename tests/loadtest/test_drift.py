"""Shared structure inferred from hand-written prompt sets (not our generators): a timestamp in
the first block, a request id after several blocks, a shuffled tool list, and no drift. Tokens
are words and punctuation, so where the drift starts is countable by hand; blocks are 16."""

from __future__ import annotations

import re
from typing import Any

from kvops.core.prom import MetricsSample
from kvops.loadtest.analysis import drift, prefix
from kvops.loadtest.analysis.tokens import ServerTokenizer
from kvops.loadtest.records import RequestRecord

BLOCK = 16
VOCAB: dict[str, int] = {}

POLICY = (
    "Refunds are granted within thirty days of purchase when the receipt is shown. Orders "
    "shipped abroad take up to three weeks and carry customs fees paid by the buyer. Never "
    "promise a delivery date; quote the carrier estimate instead. Escalate legal threats to a "
    "human agent at once. Keep answers short, polite and free of internal jargon. Loyalty "
    "members get free returns, others pay a flat fee of five euros per parcel returned."
)
QUESTIONS = [
    "Can I return shoes I wore once?",
    "Where is my parcel from Lisbon?",
    "Why was I charged twice for one order?",
    "Do you ship batteries to Norway?",
    "How do I cancel my loyalty membership?",
    "Is the winter jacket waterproof?",
]
TOOLS = [
    "lookup_order(order_id) returns the order status and the carrier tracking code",
    "issue_refund(order_id, amount) refunds part or all of an order to its card",
    "open_ticket(summary) hands the conversation over to a human support agent",
    "check_stock(sku, store) tells how many items a given store still holds",
]
ORDERS = [(0, 1, 2, 3), (2, 0, 3, 1), (1, 3, 0, 2), (3, 2, 1, 0), (0, 2, 1, 3), (1, 0, 3, 2)]


def tok(text: str) -> list[int]:
    return [VOCAB.setdefault(w, len(VOCAB)) for w in re.findall(r"\w+|[^\w\s]", text)]


def test_timestamp_inside_the_first_block():
    head = "You are the shop assistant. Session opened 2026-12-01T09:"
    prompts = [tok(f"{head}{10 + 7 * i}:{5 * i + 3:02d}Z. {POLICY} Question: {q}")
               for i, q in enumerate(QUESTIONS)]
    (s,) = drift.infer(prompts)
    assert s.members == tuple(range(6))
    assert s.drifts
    assert not s.reordered
    assert s.first_differing_token == len(tok(head)) < BLOCK
    # the varying part is the minutes and seconds, up to the shared text after them
    start, end = s.varying
    assert prompts[0][start:end] == tok("10:03Z")[:end - start]
    assert s.shared_after >= len(tok(POLICY))
    r = drift.rates(prompts, [s], BLOCK)
    assert r.ideal == 0.0  # nothing shared before the first block ends
    assert r.could_be > 0.5


def test_request_id_after_several_blocks():
    head = f"{POLICY} Request id:"
    prompts = [tok(f"{head} req-{1000 + 37 * i} handled by tier one. Question: {q}")
               for i, q in enumerate(QUESTIONS)]
    (s,) = drift.infer(prompts)
    assert s.first_differing_token == len(tok(head)) + 2  # "req", "-", then the number
    assert s.first_differing_token >= 4 * BLOCK
    r = drift.rates(prompts, [s], BLOCK)
    # the cache reaches the whole blocks before the id; after it, "handled by tier one.
    # Question:" is shared but too short to be reported as drift
    assert r.ideal > 0.5
    assert not s.drifts
    assert r.could_be == r.ideal


def test_request_id_before_shared_text_in_a_later_block():
    head = f"{POLICY} Request id:"
    prompts = [tok(f"{head} req-{1000 + 37 * i}. {POLICY} Question: {q}")
               for i, q in enumerate(QUESTIONS)]
    (s,) = drift.infer(prompts)
    assert s.drifts
    assert s.first_differing_token == len(tok(head)) + 2
    start, end = s.varying
    assert end - start == 1  # the number alone: "." and the policy after it are shared
    r = drift.rates(prompts, [s], BLOCK)
    assert r.could_be > r.ideal > 0.3


def test_shuffled_tool_list():
    head = "Tools you may call:"
    prompts = [tok(f"{head} " + "; ".join(TOOLS[t] for t in order) + f". {POLICY} Question: {q}")
               for order, q in zip(ORDERS, QUESTIONS, strict=True)]
    (s,) = drift.infer(prompts)
    assert s.drifts
    assert s.reordered  # shared text starts right where the prompts differ
    assert s.first_differing_token == len(tok(head))
    assert s.shared_after >= len(tok(" ".join(TOOLS))) - 8
    r = drift.rates(prompts, [s], BLOCK)
    assert r.ideal < 0.05  # only the fifth list starts with the same tool as the first
    assert r.could_be > 0.6


def test_no_drift_shared_prefix_then_questions():
    prompts = [tok(f"{POLICY} Question: {q}") for q in QUESTIONS]
    (s,) = drift.infer(prompts)
    assert not s.drifts
    assert s.first_differing_token == len(tok(f"{POLICY} Question:"))
    r = drift.rates(prompts, [s], BLOCK)
    assert r.could_be == r.ideal > 0.5


def test_unrelated_prompts_are_not_grouped():
    prompts = [tok(q * 3) for q in QUESTIONS] + [tok(t) for t in TOOLS]
    assert drift.infer(prompts) == []
    assert drift.clusters(prompts) == [[i] for i in range(len(prompts))]


def test_two_templates_two_groups():
    a = [tok(f"{POLICY} Question: {q}") for q in QUESTIONS[:3]]
    b = [tok(f"{'; '.join(TOOLS)}. Question: {q}") for q in QUESTIONS[3:]]
    assert drift.clusters([a[0], b[0], a[1], b[1], a[2], b[2]]) == [[0, 2, 4], [1, 3, 5]]


def test_repeats_are_one_distinct_prompt():
    p, q = tok("one two three"), tok("four five")
    assert drift.distinct([p, q, p, p]) == ([p, q], [0, 1, 0, 0])


def test_last_prompt_token_never_hits():
    p = list(range(2 * BLOCK))
    assert drift.ideal_hits([p, p], BLOCK) == [0, BLOCK]


class WordTokenizer(ServerTokenizer):
    """The server's tokenizer stood in by words (the analysis, not tokenization, is tested)."""

    def __init__(self) -> None:
        super().__init__("http://unused", "m")

    def tokens(self, prompt: Any, *, add_generation_prompt: bool | None = None,
               template: dict[str, Any] | None = None) -> list[int]:
        return tok(str(prompt))

    def text(self, tokens: list[int]) -> str:
        words = {v: k for k, v in VOCAB.items()}
        return " ".join(words[t] for t in tokens)


def _records(prompts: list[str]) -> list[RequestRecord]:
    # one request a second, each prefilled 0.1 s after it was sent: a dataset replay, no groups
    return [RequestRecord(request_id=str(i), kind="completions", sent_at=float(i), ttft_s=0.1,
                          e2e_s=0.2, ok=True, prompt=p) for i, p in enumerate(prompts)]


def _samples(hit_rate: float) -> list[MetricsSample]:
    cache = {"block_size": str(BLOCK), "enable_prefix_caching": "True"}
    return [MetricsSample(t=0.0, values={"prefix_queries": 0, "prefix_hits": 0}, cache_config=cache),
            MetricsSample(t=9.0, values={"prefix_queries": 1000, "prefix_hits": 1000 * hit_rate},
                          cache_config=cache)]


def test_dataset_drift_is_a_verdict_although_measured_equals_ideal():
    # the run: intended 0 (a dataset declares nothing), measured = ideal, yet the
    # prompts share most of their text after a per-request timestamp
    head = "You are the shop assistant. Session opened 2026-12-01T09:"
    prompts = [f"{head}{10 + 7 * i}:{5 * i + 3:02d}Z. {POLICY} Question: {q}"
               for i, q in enumerate(QUESTIONS)]
    summary, (v,) = prefix.analyse(_records(prompts), _samples(0.0), WordTokenizer(), 0.8)
    assert summary["intended_hit_rate"] == summary["ideal_hit_rate"] == 0.0
    assert summary["could_be_hit_rate"] > 0.5
    assert (v.problem, v.cause) == ("prefix-miss", "prefix-drift")
    assert v.evidence["first_differing_token"] == len(tok(head))
    assert v.evidence["varying_text"].startswith("10 : 03")
    assert v.evidence["inferred_from"] == "prompts"


def test_dataset_without_drift_stays_healthy():
    prompts = [f"{POLICY} Question: {q}" for q in QUESTIONS]
    summary, (v,) = prefix.analyse(_records(prompts), _samples(0.6), WordTokenizer(), 0.8)
    assert v.problem == "healthy"
    assert summary["could_be_hit_rate"] == summary["ideal_hit_rate"] > 0.5


def test_a_dataset_prompt_of_token_ids_declares_no_shared_part():
    # a completions prompt given as token ids is one prompt, not a conversation whose history
    # (all but the last "message") was meant to be shared
    record = RequestRecord(request_id="0", kind="completions", sent_at=0.0, prompt=[5, 6, 7, 8])
    got = prefix._tokens_of(record, ServerTokenizer("http://unused", "m"))
    assert (got.tokens, got.intended) == ([5, 6, 7, 8], 0)


class BodyOf(ServerTokenizer):
    """Records the /tokenize body instead of sending it (what is asked, not how it is answered:
    the e2e drift tests tokenize on a real server)."""

    def __init__(self) -> None:
        super().__init__("http://unused", "m")
        self.bodies: list[dict[str, Any]] = []

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.bodies.append(body)
        return {"tokens": [len(self.bodies)]}


def test_a_chat_body_s_own_generation_prompt_flag_renders_its_full_prompt():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    asked = BodyOf()
    asked.tokens(messages, template={"add_generation_prompt": False, "tools": []})
    asked.tokens(messages[:1], add_generation_prompt=False, template={"add_generation_prompt": True})
    asked.tokens(messages)
    assert [b["add_generation_prompt"] for b in asked.bodies] == [False, False, True]
    assert asked.bodies[0]["tools"] == []
