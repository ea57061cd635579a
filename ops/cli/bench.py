"""``kvops bench NAME --json``: run one benchmark and print its JSON object."""

from __future__ import annotations

import importlib
import json
from enum import StrEnum
from typing import Annotated, Any

import typer

from kvops.core.errors import BadInputError
from kvops.ops.cli.options import JsonOut

BENCHES: dict[str, str] = {
    "planner": "planner agreement with vLLM's allocator, and plan time vs importing vLLM",
    "fp8": "fp8 KV capacity and accuracy, scale 1.0 vs calibrated, against bf16 KV",
    "offload": "LMCache L1/disk hit TTFT vs recompute, miss overhead, copy throughput",
    "admission": "the same overload against stock vLLM and kvops admission",
    "loadgen": "Locust's sustainable rate and TTFT error vs vllm bench serve",
    "trace": "trace stats on the 12k-request Mooncake trace vs a plain LRU simulation (time, agreement)",
    "chaos": "faults (LMCache killed/frozen, disk full/read-only/deleted, client hang-ups) under load: "
             "lost, wrong, crashes, recovery",
}


BenchName = StrEnum("BenchName", {name: name for name in BENCHES})  # type: ignore[misc]


def register(app: typer.Typer) -> None:
    app.command("bench", help="Run a benchmark: " + ", ".join(BENCHES) + ".")(bench)


def bench(
    name: Annotated[BenchName, typer.Argument(help="One of: " + ", ".join(BENCHES))],
    json_out: JsonOut = False,
    out: Annotated[str, typer.Option(help="Also write the JSON object to this file.")] = "",
    faults: Annotated[str, typer.Option(help="chaos only: the faults to run, comma-separated (default: all).")] = "",
    fault_seconds: Annotated[float, typer.Option(help="chaos only: how long each fault is held.")] = 15.0,
) -> None:
    """Measure side by side against real local servers and print the result."""
    chaos = {"faults": faults, "fault_seconds": fault_seconds}
    if name.value != "chaos" and (faults or fault_seconds != 15.0):
        raise BadInputError(f"--faults/--fault-seconds are for `kvops bench chaos`, not {name.value}")
    module = importlib.import_module(f"kvops.ops.bench.{name.value}")
    try:
        result: dict[str, Any] = module.run(**chaos) if name.value == "chaos" else module.run()
    except KeyboardInterrupt:  # SIGTERM too (cli.main.Terminated): what a long run measured
        done = getattr(module, "partial", lambda: None)()  # its servers are stopped by now
        if done:
            _emit({"bench": name.value, "complete": False, **done}, json_out, out)
        raise
    _emit({"bench": name.value, **result}, json_out, out)


def _emit(result: dict[str, Any], json_out: bool, out: str) -> None:
    """Print ``result`` (its ``bench`` key names its kind, so it is told apart from a plan:
    core/kinds.py), and write it to ``out`` when given."""
    text = json.dumps(result, indent=None if json_out else 2, sort_keys=False)
    if out:
        with open(out, "w") as handle:
            handle.write(text + "\n")
    typer.echo(text)
