"""The front door's view of the queue, kept up to date per event instead of walked per request.

Before, every arriving request walked all of the API server's unfinished requests
(``output_processor.request_states``) to replay the scheduler's FCFS rule: 23 ms of event-loop
time per request at 10,000 in flight. The ledger follows the same dict through its mutations
instead: vLLM adds a ``RequestState`` (output_processor.py add_request), flips
``is_prefilling`` to False at the first token (process_outputs) or back to True when a
streaming-input request gets more prompt (``_update_streaming_request_state``), and pops it when
it finishes or aborts. Each event costs O(1) amortized; a decision reads three sums.

The FCFS replay, incrementally: pending requests (no first token yet) are split into the
``fitting`` head, which the scheduler's rule (``AdmissionPolicy.admit``) lets start given the
blocks the started requests reserve, and the ``waiting`` tail held back behind the first one
that does not fit. Because each admit adds to the reservation, the head fits exactly when its
total does (or, with nothing started, when it is the one request an idle engine admits), so
rebalancing moves requests across the boundary one at a time. Reservations are taken when a
request is added or starts (with policy ``expected`` the learned quantile may move later; the
scheduler's own ledger does the same).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvops.core.admission.policy import AdmissionPolicy, RequestShape

_LEDGER = "_kvops_ledger"
_RID = "_kvops_rid"
_PREFILLING = "_kvops_prefilling"


class QueueLedger:
    """Started reservations, and the pending requests split into fitting head / waiting tail."""

    def __init__(self, policy: AdmissionPolicy) -> None:
        self.policy = policy
        self.started: dict[str, int] = {}  # request id -> reserved blocks
        self.started_blocks = 0
        self.fitting: OrderedDict[str, tuple[int, int]] = OrderedDict()  # id -> (blocks, kv tokens)
        self.fitting_blocks = 0
        self.waiting: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self.waiting_tokens = 0

    # -- events --------------------------------------------------------------------------------

    def add(self, rid: str, state: Any) -> None:
        self.discard(rid)
        shape = RequestShape(int(state.prompt_len), state.max_tokens_param)
        blocks = self.policy.reserve_blocks(shape)
        if state.is_prefilling:
            entry = (blocks, self.policy.request_kv_tokens(shape))
            self.waiting[rid] = entry
            self.waiting_tokens += entry[1]
        else:
            self.started[rid] = blocks
            self.started_blocks += blocks
        self._rebalance()

    def discard(self, rid: str) -> None:
        if rid in self.started:
            self.started_blocks -= self.started.pop(rid)
        elif rid in self.fitting:
            self.fitting_blocks -= self.fitting.pop(rid)[0]
        elif rid in self.waiting:
            self.waiting_tokens -= self.waiting.pop(rid)[1]
        else:
            return
        self._rebalance()

    # -- reads ---------------------------------------------------------------------------------

    @property
    def queued_requests(self) -> int:
        return len(self.waiting)

    @property
    def queued_kv_tokens(self) -> int:
        return self.waiting_tokens

    @property
    def reserved_blocks(self) -> int:
        return self.started_blocks

    # -- the boundary --------------------------------------------------------------------------

    def _fits(self, head_blocks: int, head_count: int) -> bool:
        budget = self.policy.budget
        if self.policy.policy == "off" or (not self.started and head_count == 1):
            return True
        return self.started_blocks + head_blocks + budget.headroom_blocks <= budget.usable_blocks

    def _rebalance(self) -> None:
        while self.fitting and not self._fits(self.fitting_blocks, len(self.fitting)):
            rid, entry = self.fitting.popitem(last=True)
            self.fitting_blocks -= entry[0]
            self.waiting[rid] = entry
            self.waiting.move_to_end(rid, last=False)
            self.waiting_tokens += entry[1]
        while self.waiting:
            rid = next(iter(self.waiting))
            entry = self.waiting[rid]
            if not self._fits(self.fitting_blocks + entry[0], len(self.fitting) + 1):
                return
            del self.waiting[rid]
            self.waiting_tokens -= entry[1]
            self.fitting[rid] = entry
            self.fitting_blocks += entry[0]


class TrackedStates(dict[str, Any]):
    """``output_processor.request_states`` with the ledger told of every change (vLLM uses only
    item assignment, get, pop and iteration on it, output_processor.py)."""

    def __init__(self, ledger: QueueLedger, existing: dict[str, Any]) -> None:
        super().__init__()
        self.ledger = ledger
        for rid, state in existing.items():
            self[rid] = state

    def __setitem__(self, rid: str, state: Any) -> None:
        super().__setitem__(rid, state)
        state.__dict__[_LEDGER] = self.ledger
        state.__dict__[_RID] = rid
        self.ledger.add(rid, state)

    def pop(self, rid: str, *default: Any) -> Any:
        state = super().pop(rid, *default)
        if state is not None and rid not in self:
            self.ledger.discard(rid)
            getattr(state, "__dict__", {}).pop(_LEDGER, None)
        return state

    def __delitem__(self, rid: str) -> None:
        self.pop(rid)

    def clear(self) -> None:
        for rid in list(self):
            self.pop(rid)


def track_prefill_flips(state_cls: type) -> None:
    """Make ``is_prefilling`` on vLLM's RequestState a property that tells the ledger of a
    flip (the first token, or more streamed prompt); states not in a TrackedStates are plain."""
    if getattr(state_cls, "_kvops_tracked", False):
        return

    def get(self: Any) -> bool:
        return bool(self.__dict__.get(_PREFILLING, True))

    def set_(self: Any, value: bool) -> None:
        before = self.__dict__.get(_PREFILLING)
        self.__dict__[_PREFILLING] = value
        ledger = self.__dict__.get(_LEDGER)
        if ledger is not None and before is not None and bool(before) != bool(value):
            ledger.add(self.__dict__[_RID], self)

    state_cls.is_prefilling = property(get, set_)  # type: ignore[attr-defined]
    state_cls._kvops_tracked = True  # type: ignore[attr-defined]
