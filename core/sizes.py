"""Sizes and token counts as people write them, with ``vllm serve``'s meaning.

vLLM's own forms (vllm/utils/argparse_utils.py ``human_readable_int``, used for
--kv-cache-memory-bytes, --max-model-len, --max-num-batched-tokens): a lower-case suffix is
decimal and may carry decimals (``32k`` = 32,000, ``1.5m`` = 1,500,000), an upper-case one is
binary and must not (``8G`` = 8 × 2**30; ``1.5M`` is refused, as vLLM refuses it). kvops reads
exactly those the same way (a test compares with vLLM's parser), and for byte sizes also the unit
vLLM's own log lines print, so a size is pasted, not converted: ``Available KV cache memory:
3.52 GiB`` → ``3.52GiB`` (IEC: GiB = 2**30, decimals allowed, rounded down to a byte; GB = 10**9).
"""

from __future__ import annotations

import re

from kvops.core.errors import BadInputError
from kvops.core.units import GIB

_VLLM = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_BYTES = re.compile(r"(\d+(?:\.\d+)?)\s*([kKMGT]i?B)")
INT64_MAX = 2**63 - 1
"""vLLM keeps sizes and token counts in int64 tensors and C longs: a larger one is no size."""
_BYTE_UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": GIB, "TiB": 2**40,
               "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def vllm_int(text: str) -> int:
    """``vllm serve``'s reading of an integer flag (ValueError as vLLM raises it)."""
    value = text.strip()
    match = _VLLM.fullmatch(value)
    if match:
        number, suffix = match.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])  # OverflowError past 1e308: the callers' "too large"
        if "." in number:
            raise ValueError(f"decimals are not allowed with the binary suffix {suffix} "
                             f"(vllm serve refuses it too): did you mean {number}{suffix.lower()}?")
        return int(number) * _BINARY[suffix]
    return int(value)


def parse_tokens(text: str | int, flag: str) -> int:
    """A token count: ``32768``, ``32k`` (32,000) or ``32K`` (32,768), as vllm serve reads it."""
    if isinstance(text, int):
        return text
    try:
        value = vllm_int(text)
    except OverflowError:
        raise _too_large(text, flag) from None
    except ValueError as exc:
        raise BadInputError(f"{flag} {text!r}: {_why(exc)}; write e.g. 32768, 32k (32,000) "
                            "or 32K (32,768) as vllm serve reads them") from exc
    return _positive(value, text, flag)


def parse_bytes(text: str | int, flag: str) -> int:
    """A byte size: vllm serve's forms (``8G`` = 8 GiB, ``8g`` = 8 GB) or a unit as vLLM logs
    print it (``3.52GiB``, ``3.52 GiB``, ``512MiB``, ``8GB``)."""
    if isinstance(text, int):
        return text
    match = _BYTES.fullmatch(text.strip())
    if match:
        number, unit = match.groups()
        if unit in _BYTE_UNITS:
            scaled = float(number) * _BYTE_UNITS[unit]
            if not scaled <= INT64_MAX:  # inf past 1e308 too
                raise _too_large(text, flag)
            return _positive(int(scaled), text, flag)
    try:
        value = vllm_int(text)
    except OverflowError:
        raise _too_large(text, flag) from None
    except ValueError as exc:
        raise BadInputError(f"{flag} {text!r}: {_why(exc)}; write e.g. 8589934592, 8G or 8GiB "
                            "(2**30 each), 8g or 8GB (10**9 each), 3.52GiB as vLLM logs print it") from exc
    return _positive(value, text, flag)


def _why(exc: ValueError) -> str:
    message = str(exc)
    return message if message.startswith("decimals") else "not a number"


def _too_large(text: str | int, flag: str) -> BadInputError:
    shown = f"{text!r:.40}" + ("..." if len(repr(text)) > 40 else "")
    return BadInputError(f"{flag} {shown}: larger than int64 ({INT64_MAX:,}), so no size vLLM can hold")


def _positive(value: int, text: str | int, flag: str) -> int:
    if value <= 0:
        raise BadInputError(f"{flag} {text!r:.40}: must be positive")
    if value > INT64_MAX:
        raise _too_large(text, flag)
    return value
