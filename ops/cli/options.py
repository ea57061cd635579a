"""Options several commands share, defined once: the same spelling, help and panel everywhere.

Typer reads a parameter's option from its ``Annotated`` metadata, so one alias here is the whole
definition; a command declares ``json_out: JsonOut = False``. Panels group ``--help`` output
(Typer's ``rich_help_panel``); commands name their own options' panels with the constants below.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from kvops.core.errors import BadInputError
from kvops.core.sizes import parse_bytes, parse_tokens

MODEL_PANEL = "Model"
DEVICE_PANEL = "Device and parallelism"
WORKLOAD_PANEL = "Workload"
MEMORY_PANEL = "Memory terms (non-KV)"
OFFLOAD_PANEL = "Offload (LMCache)"
SERVER_PANEL = "Server"
OUTPUT_PANEL = "Output"

JsonOut = Annotated[bool, typer.Option(
    "--json", help="Print one JSON object only (machine-readable).", rich_help_panel=OUTPUT_PANEL)]

_URL_HELP = "vLLM server base URL, http or https, e.g. http://127.0.0.1:8000."
ServerUrl = Annotated[str, typer.Option("--url", help=_URL_HELP, rich_help_panel=SERVER_PANEL)]
OptionalServerUrl = Annotated[str | None, typer.Option("--url", help=_URL_HELP, rich_help_panel=SERVER_PANEL)]

Timeout = Annotated[float | None, typer.Option(
    "--timeout", help="Seconds the whole command may wait on its peers, however slowly they answer "
    "(default: the command's own).", rich_help_panel=SERVER_PANEL)]

ModelConfig = Annotated[str | None, typer.Option(
    "--model", help="The model: its directory, its config.json, or a Hugging Face id found in the local "
    "HF cache (offline).", rich_help_panel=MODEL_PANEL)]
ConfigAlias = Annotated[str | None, typer.Option(
    "--config", hidden=True, help="Old spelling of --model.", rich_help_panel=MODEL_PANEL)]


def model_path(model: str | None, alias: str | None) -> Path:
    """--model (or its old spelling --config) as a path the capacity model reads."""
    from kvops.ops.capacity.locate import locate_config

    if model is not None and alias is not None and model != alias:
        raise BadInputError("--model and --config name two models: give one --model")
    given = model if model is not None else alias
    if given is None:
        raise BadInputError("give --model: the model's directory, its config.json, or a Hugging Face id "
                            "in the local cache")
    return locate_config(given)


def _vllm_form(parse: Callable[[str | int, str], int]) -> Callable[[str], int]:
    """A Typer parser from a kvops.core.sizes reader: click names the option in its message."""

    def convert(value: str | int) -> int:
        try:
            return parse(value, "")
        except BadInputError as exc:
            raise typer.BadParameter(str(exc).strip()) from None

    return convert


tokens_option = _vllm_form(parse_tokens)
"""``--max-model-len 32k``: token counts as ``vllm serve`` reads them (kvops.core.sizes)."""
bytes_option = _vllm_form(parse_bytes)
"""``--kv-cache-memory-bytes 8G`` or ``3.52GiB`` as vLLM's log prints it (kvops.core.sizes)."""
