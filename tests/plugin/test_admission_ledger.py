"""The incremental ledger agrees with the walk it replaces (the scheduler's FCFS replay over
every unfinished request, FrontDoor.queue_state) after every event of random request streams."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvops.core.admission.policy import AdmissionPolicy, KVBudget, RequestShape
from kvops.core.admission.settings import AdmissionSettings
from kvops.plugin.admission.http import FrontDoor
from kvops.plugin.admission.ledger import QueueLedger, TrackedStates, track_prefill_flips


class State:
    """Stands in for vLLM's RequestState: the attributes the front door reads."""

    def __init__(self, prompt_len: int, max_tokens: int | None) -> None:
        self.prompt_len = prompt_len
        self.max_tokens_param = max_tokens
        self.is_prefilling = True


track_prefill_flips(State)

EVENTS = st.lists(st.tuples(
    st.sampled_from(["arrive", "start", "finish"]),
    st.integers(0, 10_000), st.integers(1, 900), st.one_of(st.none(), st.integers(1, 900)),
), max_size=120)


def _walk(door: FrontDoor, policy: AdmissionPolicy, states: dict[str, Any]) -> tuple[int, int, int]:
    state = door.queue_state(policy, list(states.values()))
    reserved = sum(policy.reserve_blocks(RequestShape(s.prompt_len, s.max_tokens_param))
                   for s in states.values() if not s.is_prefilling)
    return state.queued_requests, state.queued_kv_tokens, reserved


@settings(max_examples=150, deadline=None)
@given(events=EVENTS, usable=st.integers(4, 40), headroom=st.integers(0, 3))
def test_the_ledger_matches_the_walk_after_every_event(events, usable, headroom):
    policy = AdmissionPolicy(KVBudget(usable_blocks=usable, block_size=128, max_model_len=1024,
                                      headroom_blocks=headroom), "strict")
    door = FrontDoor(AdmissionSettings())
    tracked = TrackedStates(QueueLedger(policy), {})
    plain: dict[str, Any] = {}
    for i, (kind, pick, prompt, max_tokens) in enumerate(events):
        ids = list(plain)
        if kind == "arrive" or not ids:
            rid = f"r{i}"
            plain[rid] = State(prompt, max_tokens)
            tracked[rid] = plain[rid]
        elif kind == "start":
            plain[ids[pick % len(ids)]].is_prefilling = False  # the first token
        else:
            rid = ids[pick % len(ids)]
            plain.pop(rid)
            tracked.pop(rid)
        ledger = tracked.ledger
        assert (ledger.queued_requests, ledger.queued_kv_tokens, ledger.reserved_blocks) == _walk(
            door, policy, plain)
