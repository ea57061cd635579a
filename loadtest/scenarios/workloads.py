"""Request bodies: generated from a scenario config, or replayed from an operator's dataset.

Generated text uses plain English words; exact token counts come back from the server's
``usage`` (and ``/tokenize`` where a diagnosis needs the tokens themselves), so no tokenizer is
loaded in the load generator.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvops.core.errors import BadInputError
from kvops.loadtest.config import PrefixMissConfig, Workload
from kvops.loadtest.records import read_jsonl

WORDS = (
    "the cache holds keys and values for every token of every request so that decoding reads "
    "them instead of recomputing attention over the prompt a block stores tokens the scheduler "
    "admits requests while blocks are free and preempts the newest one when memory runs out "
    "prefix caching reuses blocks whose hashes match an earlier prompt system prompts documents "
    "and earlier turns of a conversation are shared offload moves blocks to host memory and disk "
    "time to first token is queueing plus prefill plus the first decode step hello world you "
    "are a helpful assistant answer the question briefly and cite the document"
).split()


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def generated_body(workload: Workload, model: str, rng: random.Random) -> dict[str, Any]:
    """A request with a unique start (so prefix caching cannot shorten it) of ~N words."""
    text = f"{rng.randrange(10**9)} " + words(rng, workload.prompt_words)
    body: dict[str, Any] = {"model": model, "max_tokens": workload.max_tokens,
                            "temperature": workload.temperature}
    if workload.ignore_eos:
        body["ignore_eos"] = True
    if workload.api == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


@dataclass(frozen=True)
class PrefixRequest:
    body: dict[str, Any]
    group: str
    shared_text: str
    """The part of the prompt the workload *means* to share (the group's system prompt)."""


def group_prefix(config: PrefixMissConfig, group: int) -> str:
    return words(random.Random(f"{config.seed}-prefix-{group}"), config.prefix_words)


def prefix_request(config: PrefixMissConfig, model: str, group: int, rng: random.Random,
                   request_no: int) -> PrefixRequest:
    """One request of ``group``: its rendered system prompt, then a fresh question."""
    try:
        system = config.system_template.format(
            group=group, prefix=group_prefix(config, group), request=request_no,
            timestamp=datetime.now(UTC).isoformat(),
        )
    except (KeyError, IndexError) as exc:
        raise BadInputError(
            f"system_template: unknown placeholder {exc}: use {{group}}, {{prefix}}, "
            "{timestamp} or {request}") from exc
    question = "Question: " + words(rng, config.question_words)
    body: dict[str, Any] = {"model": model, "max_tokens": config.max_tokens, "temperature": 0.0}
    if config.api == "chat":
        body["messages"] = [{"role": "system", "content": system},
                            {"role": "user", "content": question}]
    else:
        body["prompt"] = system + "\n" + question
    return PrefixRequest(body=body, group=str(group), shared_text=system)


def load_dataset(path: Path) -> list[dict[str, Any]]:
    """OpenAI completions or chat bodies, one per line; each must have prompt or messages."""
    bodies = []
    for number, row in enumerate(read_jsonl(path), 1):
        if not isinstance(row.get("prompt"), (str, list)) and not isinstance(row.get("messages"), list):
            raise BadInputError(
                f"{path}: request {number} has neither 'prompt' nor 'messages': each line must be "
                "an OpenAI completions or chat request body")
        prompt = row.get("prompt")
        if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
            if len(prompt) != 1 or not isinstance(prompt[0], (str, list)):
                raise BadInputError(
                    f"{path}: request {number}: 'prompt' is a batch of {len(prompt)} prompts: give "
                    "one prompt per line (a string or a list of token ids), each is timed on its own")
            row["prompt"] = prompt[0]  # a batch of one is that prompt
        row.pop("stream", None)
        row.pop("stream_options", None)
        bodies.append(row)
    if not bodies:
        raise BadInputError(f"{path}: no requests in the dataset")
    return bodies


def dataset_body(body: dict[str, Any], model: str) -> dict[str, Any]:
    return {**body, "model": body.get("model") or model}
