"""The ``--baseline`` of ttft-regression: a result.json of an earlier run, typed before the run.

``compare`` indexes the baseline's samples and intervals as numbers; a list where a mapping is
expected, or a string among the samples, once surfaced as a TypeError after the whole load test
had run. Read here before anything starts, refused in one line naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictFloat, StrictInt, ValidationError

from kvops.core import kinds
from kvops.core.errors import BadInputError
from kvops.core.kinds import read_json_of_kind

Number = StrictInt | StrictFloat
_RUN = "run `kvops loadtest ttft-regression --url URL --json` and pass its JSON report"


class _Summary(BaseModel):
    """What ``ttft.compare`` reads; the rest of the summary is the report's."""

    model_config = ConfigDict(extra="allow", frozen=True)

    samples: dict[str, list[Number]]
    intervals: dict[str, list[tuple[Number, Number]]]
    server_means_s: dict[str, Number | None] = {}


class _Section(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    summary: _Summary


class _Baseline(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    ttft: _Section


def load_baseline(path: Path) -> dict[str, Any]:
    """The ``ttft.summary`` mapping of a ttft-regression result, checked field by field."""
    label = f"--baseline {path}"
    data = read_json_of_kind(path, label, kinds.LOADTEST_RESULT)
    if not isinstance(data, dict) or data.get("scenario") != "ttft-regression" or "ttft" not in data:
        raise BadInputError(f"baseline {path} is not a ttft-regression result: {_RUN}")
    try:
        _Baseline.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(part) for part in err["loc"])
        raise BadInputError(f"{label}: {where}: {err['msg']}; {_RUN}") from None
    summary: dict[str, Any] = data["ttft"]["summary"]
    return summary
