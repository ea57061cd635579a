"""Full-resolution per-request records, kept by us rather than by Locust.

Locust rounds its histograms (whole ms below 100 ms, two significant digits above) and its
``stream=True`` response time is time-to-headers, so every streamed request becomes one
``RequestRecord`` with wall-clock stamps (for aligning with /metrics samples) and perf-counter
durations (for accuracy). Records travel as plain dicts: JSONL on disk, and worker → master
messages in distributed runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kvops.core.errors import BadInputError


@dataclass
class RequestRecord:
    """One streamed request as the client saw it. Times in seconds; ``*_at`` are epoch stamps."""

    request_id: str
    kind: str  # "completions" | "chat"
    sent_at: float
    worker: str = "local"
    scenario: str = ""
    phase: str = "measure"
    group: str | None = None
    users: int = 0
    scheduled_at: float | None = None
    lateness_s: float | None = None
    headers_s: float | None = None
    first_event_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    content_events: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    status: int = 0
    ok: bool = False
    stopped: bool = False
    """In flight when the run ended: neither a success nor a server error."""
    error: str | None = None
    prompt: Any = None
    shared_text: str | None = None
    template: dict[str, Any] | None = None
    """A chat body's other chat-template inputs (``tools``, ``chat_template_kwargs``...): the
    server renders them into the prompt, so the prompt's tokens depend on them."""

    @property
    def first_token_at(self) -> float | None:
        """When the first token came out: its event, even without text (prefill was done)."""
        first = self.first_event_s if self.first_event_s is not None else self.ttft_s
        return None if first is None else self.sent_at + first

    @property
    def done_at(self) -> float:
        return self.sent_at + (self.e2e_s or 0.0)

    @property
    def token_count_mismatch(self) -> bool:
        """The stream's token-bearing events disagree with the server's usage count.

        vLLM sends one event per decode step; detokenization may hold text back (an empty delta)
        so fewer content events than tokens is normal, more is not.
        """
        if self.completion_tokens is None:
            return False
        return self.content_events > self.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row, separators=(",", ":")) + "\n")


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of a JSONL file; a malformed line is bad input naming the file and line."""
    try:
        handle = open(path)
    except OSError as exc:
        raise BadInputError(f"cannot read {path}: {exc.strerror}") from exc
    with handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise BadInputError(f"{path}:{number}: not JSON ({exc.msg}): fix or remove the line") from exc
            if not isinstance(row, dict):
                raise BadInputError(f"{path}:{number}: expected a JSON object per line")
            yield row


def load_records(path: Path) -> list[RequestRecord]:
    return sorted((RequestRecord.from_dict(r) for r in read_jsonl(path)), key=lambda r: r.sent_at)
