"""``kvops bench NAME --json``: run one benchmark and print its JSON object."""

from __future__ import annotations

import importlib
import json
from typing import Annotated, Any

import typer

from kvops.ops.errors import BadInputError

BENCHES: dict[str, str] = {
    "planner": "planner agreement with vLLM's allocator, and plan time vs importing vLLM",
    "fp8": "fp8 KV capacity and accuracy, scale 1.0 vs calibrated, against bf16 KV",
    "offload": "LMCache L1/disk hit TTFT vs recompute, miss overhead, copy throughput",
    "admission": "the same overload against stock vLLM and kvops admission",
    "loadgen": "Locust's sustainable rate and TTFT error vs vllm bench serve",
}


def register(app: typer.Typer) -> None:
    app.command("bench", help="Run a benchmark: " + ", ".join(BENCHES) + ".")(bench)


def bench(
    name: Annotated[str, typer.Argument(help="One of: " + ", ".join(BENCHES))],
    json_out: Annotated[bool, typer.Option("--json", help="Print the JSON object only.")] = False,
    out: Annotated[str, typer.Option(help="Also write the JSON object to this file.")] = "",
) -> None:
    """Measure side by side against real local servers and print the result."""
    if name not in BENCHES:
        raise BadInputError(f"unknown bench {name!r}: choose one of {', '.join(BENCHES)}")
    module = importlib.import_module(f"kvops.ops.bench.{name}")
    result: dict[str, Any] = module.run()
    text = json.dumps(result, indent=None if json_out else 2, sort_keys=False)
    if out:
        with open(out, "w") as handle:
            handle.write(text + "\n")
    typer.echo(text)
