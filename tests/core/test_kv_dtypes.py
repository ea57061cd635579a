"""The KV dtype table against vLLM 0.32's own lists, read in a subprocess that imports vLLM.

What each row claims (its name, its storage element size, whether vLLM calls it quantized,
which dtypes the CPU backends take, which carry per-tensor scales) is compared with what vLLM's
modules say; the sizing of each row is checked against vLLM's spec and backend code by
tests/ops/test_capacity_oracle_kv_dtypes.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from typing import Any

import pytest

from kvops.core.errors import BadInputError
from kvops.core.kv_dtypes import (
    KV_DTYPE_NAMES,
    KV_DTYPES,
    calibratable_names,
    check_runs_on,
    device_names,
    fp8_format,
    parse_skip_layers,
)

_VLLM_FACTS = r"""
import json
from typing import get_args
from vllm.config.cache import CacheDType
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
from vllm.v1.kv_cache_interface import KVQuantMode, get_kv_quant_mode, is_quantized_kv_cache
names = list(get_args(CacheDType))
print(json.dumps({
    "names": names,
    "element_bytes": {n: STR_DTYPE_TO_TORCH_DTYPE[n].itemsize for n in names if n != "auto"},
    "quantized": {n: is_quantized_kv_cache(n) for n in names},
    "per_tensor_fp8": [n for n in names if get_kv_quant_mode(n) == KVQuantMode.FP8_PER_TENSOR],
    "cpu": list(CPUAttentionBackend.supported_kv_cache_dtypes),
    "cpu_mla": list(CPUMLABackend.supported_kv_cache_dtypes),
}))
"""


@cache
def vllm_facts() -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _VLLM_FACTS], check=True, capture_output=True, text=True, timeout=300)
    facts: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return facts


def test_one_row_per_vllm_cache_dtype_in_vllms_order() -> None:
    assert list(KV_DTYPE_NAMES) == vllm_facts()["names"]


def test_storage_bytes_and_quantized_follow_vllm() -> None:
    facts = vllm_facts()
    for row in KV_DTYPES:
        if row.name != "auto":
            assert row.storage_bytes == facts["element_bytes"][row.name], row.name
        assert row.quantized == facts["quantized"][row.name], row.name


def test_cpu_rows_are_the_cpu_backends_lists() -> None:
    facts = vllm_facts()
    assert set(device_names("cpu")) == set(facts["cpu"])
    assert set(device_names("cpu", use_mla=True)) == set(facts["cpu_mla"])


def test_calibratable_rows_carry_per_tensor_fp8_scales() -> None:
    """kvops calibrate writes per-tensor scales: only dtypes vLLM scales per tensor qualify."""
    per_tensor = set(vllm_facts()["per_tensor_fp8"])
    assert calibratable_names()
    assert set(calibratable_names()) <= per_tensor
    assert {fp8_format(name) for name in calibratable_names()} == {"fp8_e4m3", "fp8_e5m2"}


def test_refusal_names_the_device_and_what_it_runs() -> None:
    with pytest.raises(BadInputError) as err:
        check_runs_on("turboquant_k8v4", "cpu")
    text = str(err.value)
    assert "\n" not in text
    assert "--device cpu" in text
    assert ", ".join(vllm_facts()["cpu"]) in text or all(n in text for n in vllm_facts()["cpu"])


def test_skip_layers_parse_as_vllm_takes_them() -> None:
    assert parse_skip_layers("0,1 sliding_window") == ("0", "1", "sliding_window")
    assert parse_skip_layers(None) == ()
    with pytest.raises(BadInputError, match="sliding_window"):
        parse_skip_layers("first")
