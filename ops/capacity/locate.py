"""Where a model named on the command line is: a directory, its config.json, or a Hugging Face
id already in the local cache. Offline on purpose: planning must not download a model (an SRE's
laptop, an air-gapped bastion), so an id that is not cached is a one-line refusal naming the
cache and the command that fills it."""

from __future__ import annotations

import re
from pathlib import Path

from kvops.core.errors import BadInputError

_HF_ID = re.compile(r"[\w.-]+/[\w.-]+")


def locate_config(model: str) -> Path:
    """A path ``load_config`` reads (a directory or a config.json) for ``--model``."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    if not _HF_ID.fullmatch(model):
        raise BadInputError(f"--model {model}: no such file or directory (give a model directory, its "
                            "config.json, or a Hugging Face id such as meta-llama/Llama-3.1-8B)")
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.constants import HF_HUB_CACHE

    found = try_to_load_from_cache(model, "config.json")
    if not isinstance(found, str):
        raise BadInputError(f"--model {model}: not in the local Hugging Face cache ({HF_HUB_CACHE}); kvops "
                            f"reads it offline: `huggingface-cli download {model} config.json` fills it, "
                            "or pass the model's directory or config.json")
    return Path(found)
