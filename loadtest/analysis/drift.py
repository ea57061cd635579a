"""Shared structure inferred from the prompts themselves, for traffic we did not generate.

An operator's dataset (or a trace) carries no "this part is meant to be shared" marker, so the
structure is read off the token sequences: prompts that share most of their text are grouped
(near-duplicates by shared k-token runs), and inside a group every token the representative
has in a run that *every* member also contains, anywhere, counts as shared text. A group
drifts when shared text continues after the members' common prefix ends: something that varies
per request (a timestamp, a request id, a reordered tool list) sits inside otherwise shared
text and cuts the prefix cache's block chain there. The could-be hit rate is what the same
prompts would hit if that varying part moved after the shared text (or the list were sorted).

Pure functions over token ids; the caller tokenizes with the server's own tokenizer and chat
template (kvops.loadtest.analysis.tokens.ServerTokenizer).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

from kvops.loadtest.analysis.tokens import common_prefix_len

RUN = 8
"""Tokens in a run that counts as shared text: shorter common runs are coincidences of a small
vocabulary (the same word pair in two questions), not structure."""
MIN_SIMILARITY = 0.5
"""Share of a prompt's k-token runs the group's representative must also have to join it."""
MIN_SHARED_AFTER = 2 * RUN
"""Shared tokens after the common prefix that make a group's varying part worth reporting (a
chat template's closing tokens after varying questions are fewer)."""

BOILERPLATE = 64
"""Groups a k-token run is indexed for: one in more (a system prompt every conversation opens
with) tells no groups apart, and counting it for each would make grouping quadratic."""

Tokens = Sequence[int]
KGram = tuple[int, ...]


def block_chain(tokens: Tokens, block: int) -> list[int]:
    """Hash of each whole-block prefix, as vLLM's prefix cache chains block hashes."""
    out, h = [], 0
    for k in range(len(tokens) // block):
        h = hash((h, tuple(tokens[k * block:(k + 1) * block])))
        out.append(h)
    return out


def kgrams(tokens: Tokens, k: int = RUN) -> set[KGram]:
    return {tuple(tokens[i:i + k]) for i in range(len(tokens) - k + 1)}


def clusters(prompts: Sequence[Tokens], k: int = RUN,
             min_similarity: float = MIN_SIMILARITY) -> list[list[int]]:
    """Indices of near-duplicate prompts, grouped greedily in order: a prompt joins the first
    group whose representative (its first member) shares at least ``min_similarity`` of the
    smaller of their k-token-run sets. Runs are looked up in an index of the representatives'
    runs, so a trace replay's thousands of prompts are not compared pairwise; a run already in
    BOILERPLATE groups is counted for those only."""
    groups: list[list[int]] = []
    rep_sizes: list[int] = []
    owners: dict[KGram, list[int]] = {}
    for i, tokens in enumerate(prompts):
        mine = kgrams(tokens, k)
        shared = Counter(chain.from_iterable(owners[gram] for gram in mine if gram in owners))
        joined = next((g for g in sorted(shared)
                       if shared[g] >= min_similarity * min(len(mine), rep_sizes[g])), None)
        if joined is not None:
            groups[joined].append(i)
            continue
        for gram in mine:
            held = owners.setdefault(gram, [])
            if len(held) < BOILERPLATE:
                held.append(len(groups))
        groups.append([i])
        rep_sizes.append(len(mine))
    return groups


def covered(tokens: Tokens, common: set[KGram], k: int = RUN, prefix: int = 0) -> list[bool]:
    """Per position: inside the first ``prefix`` tokens, or inside a k-run found in ``common``."""
    marks = [i < prefix for i in range(len(tokens))]
    for i in range(len(tokens) - k + 1):
        if tuple(tokens[i:i + k]) in common:
            for j in range(i, i + k):
                marks[j] = True
    return marks


@dataclass(frozen=True)
class Structure:
    """What a group of near-duplicate prompts shares, read from the representative's tokens."""

    members: tuple[int, ...]
    first_differing_token: int
    """Length of the prefix every member shares: where the block chain breaks."""
    shared_tokens: int
    """Representative tokens in runs every member contains (wherever they sit)."""
    shared_after: int
    """Of those, the ones after the first differing token: shared text the cache cannot reach."""
    varying: tuple[int, int]
    """The representative's [start, end) from the first differing token to the next shared run;
    empty when shared text itself starts there (reordered, e.g. a shuffled list)."""

    @property
    def representative(self) -> int:
        return self.members[0]

    @property
    def drifts(self) -> bool:
        return len(self.members) >= 2 and self.shared_after >= MIN_SHARED_AFTER

    @property
    def reordered(self) -> bool:
        return self.drifts and self.varying[0] == self.varying[1]


def structure(prompts: Sequence[Tokens], members: Sequence[int], k: int = RUN) -> Structure:
    """The shared structure of one group (``members`` index ``prompts``; the first is its
    representative)."""
    rep = prompts[members[0]]
    lcp = min((common_prefix_len(list(rep), list(prompts[m])) for m in members[1:]),
              default=len(rep))
    common = kgrams(rep, k)
    for m in members[1:]:
        common &= kgrams(prompts[m], k)
    marks = covered(rep, common, k, lcp)
    end = next((i for i in range(lcp, len(rep)) if marks[i]), len(rep))
    return Structure(members=tuple(members), first_differing_token=lcp, shared_tokens=sum(marks),
                     shared_after=sum(marks[lcp:]), varying=(lcp, end))


def infer(prompts: Sequence[Tokens], k: int = RUN) -> list[Structure]:
    """Every group of two or more near-duplicates, with its structure."""
    return [structure(prompts, group, k) for group in clusters(prompts, k) if len(group) >= 2]


@dataclass(frozen=True)
class Rates:
    """Token-weighted hit rates of the prompts sent once each, in order, to an infinite cache."""

    ideal: float
    """What the prompts as written allow: each one's longest block-chain prefix seen earlier."""
    could_be: float
    """What they would allow with each group's shared text first: its whole blocks, from the
    group's second prompt on."""


def ideal_hits(prompts: Sequence[Tokens], block: int) -> list[int]:
    seen: set[int] = set()
    hits = []
    for tokens in prompts:
        # the last prompt token is always computed, so at most (len-1) tokens can hit
        chain = block_chain(tokens[: max(len(tokens) - 1, 0)], block)
        n = 0
        while n < len(chain) and chain[n] in seen:
            n += 1
        hits.append(n * block)
        seen.update(block_chain(tokens, block))
    return hits


def could_be_hits(prompts: Sequence[Tokens], structures: Sequence[Structure], block: int) -> list[int]:
    """Per prompt: the ideal hits, or its group's shared tokens in whole blocks if more (from the
    group's second member on: the first one prefills them)."""
    hits = ideal_hits(prompts, block)
    for s in structures:
        for m in s.members[1:]:
            usable = min(s.shared_tokens, max(len(prompts[m]) - 1, 0))
            hits[m] = max(hits[m], usable // block * block)
    return hits


def rates(prompts: Sequence[Tokens], structures: Sequence[Structure], block: int) -> Rates:
    total = sum(len(p) for p in prompts) or 1
    return Rates(ideal=round(sum(ideal_hits(prompts, block)) / total, 4),
                 could_be=round(sum(could_be_hits(prompts, structures, block)) / total, 4))


def distinct(prompts: Sequence[Tokens]) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts in first-seen order, and each input's index among them."""
    index: dict[tuple[int, ...], int] = {}
    unique: list[list[int]] = []
    where = []
    for tokens in prompts:
        key = tuple(tokens)
        if key not in index:
            index[key] = len(unique)
            unique.append(list(tokens))
        where.append(index[key])
    return unique, where
