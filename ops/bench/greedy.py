"""Is a completion a greedy output of a reference server (one without the plugin)?

Equal text is too strict an oracle for the tiny random test model: its logits are often nearly
tied (top-2 margins of hundredths of a nat), and the same prompt computed in another batch,
chunk or from loaded KV sums bf16 values in another order, which flips such a tie; every token
after a flip differs. Wrong KV (a corrupt or misplaced block) moves logits by far more.

So a completion is *greedy up to ties* when, at every generated position, its token's logprob
under the reference server (given the prompt and the tokens before it) is within TIE_NATS of the
best token's there. The reference scores the whole completion in one request: the prompt plus
the completion as a prompt, with ``prompt_logprobs`` (vLLM's own numbers, not ours).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import requests

from kvops.core.errors import KvopsError

TIE_NATS = 0.05
"""Between one and two bf16 steps of the tiny model's logits (1/32 for logits in [4, 8)): a flip
of a tie is a one-step gap. Measured on the tiny model (600-token prompts, 8 tokens): a greedy
completion scored by the same server has gaps of 0.0 on an AVX2 CPU (decode path and one-pass
prefill agree) and, on an AVX-512 one, one bf16 step (0.03125) at one token of 1 of 8 prompts;
the greedy output of a prompt with one 128-token block swapped for another prompt's (misplaced
KV) departs by more than this in 42 of 44 prompts (gaps 0.0625 to several nats). The e2e test
tests/e2e/test_offload_e2e.py::test_the_greedy_oracle_tells_a_misplaced_block_from_a_tie checks
both on a few prompts."""


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: tuple[int, ...]


def complete(url: str, model: str, prompt: Sequence[int], max_tokens: int, timeout_s: float = 300.0) -> Completion:
    """A greedy completion with its token ids (vLLM's ``return_token_ids``); raises HTTPError on
    a non-200 and requests' errors otherwise."""
    body = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}
    resp = requests.post(url + "/v1/completions", json=body, timeout=timeout_s)
    resp.raise_for_status()
    choice = resp.json()["choices"][0]
    return Completion(str(choice["text"]), tuple(int(t) for t in choice["token_ids"]))


def gaps(url: str, model: str, prompt: Sequence[int], output: Sequence[int], timeout_s: float = 300.0) -> list[float]:
    """Per generated position: the best token's logprob minus the output token's, under the
    reference server at ``url`` (0.0 where the output took the best token)."""
    if not output:
        return []
    body = {"model": model, "prompt": [*prompt, *output], "max_tokens": 1, "temperature": 0,
            "prompt_logprobs": 1}
    resp = requests.post(url + "/v1/completions", json=body, timeout=timeout_s)
    resp.raise_for_status()
    scored = resp.json()["choices"][0]["prompt_logprobs"]
    if len(scored) != len(prompt) + len(output):
        raise KvopsError(f"{url}: prompt_logprobs has {len(scored)} positions for "
                         f"{len(prompt) + len(output)} tokens")
    out = []
    for position, token in enumerate(output, len(prompt)):
        ranked = scored[position]  # {token id: {"logprob", "rank", ...}}, the given token included
        best = max(float(v["logprob"]) for v in ranked.values())
        out.append(round(best - float(ranked[str(token)]["logprob"]), 4))
    return out


def departs(position_gaps: Sequence[float], tie_nats: float = TIE_NATS) -> int | None:
    """The first position where the output left greedy by more than a tie; None when it never did."""
    return next((i for i, gap in enumerate(position_gaps) if gap > tie_nats), None)


class Judged:
    """What a completion is against the reference: one of its greedy texts, a tie flip, or wrong.

    Mixed into the frozen dataclasses of the benches (a chaos request, an offload output), which
    give the three fields: the completion's text (None: nothing came back), the reference's greedy
    texts for its prompt, and the reference's per-token gaps, scored only where the text is none
    of them (None: not scored, which counts as wrong: nothing shows it is a tie)."""

    text: str | None
    expected: tuple[str, ...]
    gaps: tuple[float, ...] | None

    @property
    def unexpected(self) -> bool:
        return self.text is not None and self.text not in self.expected

    @property
    def wrong(self) -> bool:
        return self.unexpected and (self.gaps is None or departs(self.gaps) is not None)

    @property
    def tie_flip(self) -> bool:
        return self.unexpected and not self.wrong


def tally(outputs: Iterable[Judged]) -> dict[str, int | float]:
    """``tie_flips`` and ``wrong_outputs`` among ``outputs``, and ``max_logprob_gap``: the largest
    per-token gap the reference scored in any of them (0.0 when none was scored)."""
    listed = list(outputs)
    scored = [gap for output in listed if output.unexpected and output.gaps for gap in output.gaps]
    return {"tie_flips": sum(output.tie_flip for output in listed),
            "wrong_outputs": sum(output.wrong for output in listed),
            "max_logprob_gap": max(scored, default=0.0)}
