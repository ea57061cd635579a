"""The KV cache dtypes vLLM 0.32 accepts: one row each, the only place kvops spells them out.

``--kv-cache-dtype`` takes the 19 names of ``CacheDType`` (vllm/config/cache.py). Each row says
how vLLM sizes one token of one layer in that dtype (the page arithmetic of
vllm/v1/kv_cache_interface.py ``AttentionSpec`` and the packing each attention backend's
``customize_spec`` applies), which devices' backends take it, and whether ``kvops calibrate`` can
measure per-tensor scales for it. The planner, the CLI's choices, the plugin's fp8 validation and
calibrate all read this table, so the next dtype vLLM adds is one row here.

Sizing of one token, one KV head (non-MLA): ``align(K + V, slot_align)`` with
``K = ceil(head_size × key_bits / 8) + ceil(head_size / scale_group) × scale_bytes + key_extra_bytes``
and V likewise; MLA layers store one latent row of ``head_size × bits / 8`` bytes, or the fixed
``row_bytes`` of the DeepSeek sparse layouts. ``bits`` None means the model's own dtype (auto).

No vLLM, no torch here: the CLI must stay instant (kvops.core imports neither).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final, Literal

from kvops.core.errors import BadInputError

Device = Literal["cuda", "cpu", "rocm", "hpu"]
Fp8Format = Literal["fp8_e4m3", "fp8_e5m2"]

VLLM_SOURCE: Final = "vllm/config/cache.py CacheDType (vLLM 0.32)"


@dataclass(frozen=True)
class KvDtype:
    """One ``--kv-cache-dtype`` as vLLM 0.32 sizes and runs it."""

    name: str
    key_bits: int | None  # bits per stored K element; None: the model dtype's (auto)
    value_bits: int | None = None  # None: same as key_bits
    key_extra_bytes: int = 0  # per token and KV head after K: fp32 scale, fp16 norm ...
    value_extra_bytes: int = 0
    scale_group: int | None = None  # one scale of scale_bytes per this many elements (K and V)
    scale_bytes: int = 0
    slot_align: int = 1  # K+V slot rounded up to a multiple of this (TurboQuant: even)
    row_bytes: int | None = None  # MLA: a fixed opaque row per token and layer
    storage_bytes: int | None = None  # element size of vLLM's torch dtype for it; None: model's
    alias_of: str | None = None  # the same storage under another name (fp8 = fp8_e4m3)
    devices: frozenset[Device] = field(default_factory=frozenset)  # backends that take it
    mla_devices: frozenset[Device] = field(default_factory=frozenset)  # MLA backends that take it
    sparse_mla: bool = False  # DeepSeek-V3.2 sparse MLA backends take it
    mla_only: bool = False
    cuda_backend: str | None = None  # the first of Hopper's backends that takes it (platforms/cuda.py)
    boundary_skip_layers: int = 0  # first/last N layers of a dense model vLLM keeps unquantized
    calibratable: bool = False  # per-tensor scales vLLM loads: kvops calibrate measures them
    fp8_format: Fp8Format | None = None
    note: str = ""  # where the device list is narrower than "cuda" says (GPU generation)

    @property
    def quantized(self) -> bool:
        """vLLM's is_quantized_kv_cache: anything but the model's or a 16-bit float."""
        return self.key_bits is not None and self.key_bits < 16

    def runs_on(self, device: str, use_mla: bool = False) -> bool:
        return device in (self.mla_devices if use_mla else self.devices)

    def head_bytes_per_token(self, head_size: int, model_dtype_bytes: int) -> int:
        """One token of one KV head, K and V together (non-MLA layers)."""
        k = self._side_bytes(head_size, self.key_bits, self.key_extra_bytes, model_dtype_bytes)
        v_bits = self.key_bits if self.value_bits is None else self.value_bits
        v = self._side_bytes(head_size, v_bits, self.value_extra_bytes, model_dtype_bytes)
        return self.slot_align * math.ceil((k + v) / self.slot_align)

    def mla_row_bytes(self, head_size: int, model_dtype_bytes: int) -> int:
        """One token's latent row in an MLA layer (one head, no separate V)."""
        if self.row_bytes is not None:
            return self.row_bytes
        return self._side_bytes(head_size, self.key_bits, 0, model_dtype_bytes)

    def unpacked_head_bytes_per_token(self, head_size: int, model_dtype_bytes: int) -> int:
        """K+V at vLLM's storage element size, without the backend's packing: what a backend
        that does not pack this dtype computes for it (platforms/interface.py
        ``_align_heterogeneous_kv_block_size`` asks the first layer's backend)."""
        size = model_dtype_bytes if self.storage_bytes is None else self.storage_bytes
        return 2 * head_size * size

    def _side_bytes(self, head_size: int, bits: int | None, extra: int, model_dtype_bytes: int) -> int:
        width = model_dtype_bytes * 8 if bits is None else bits
        scales = math.ceil(head_size / self.scale_group) * self.scale_bytes if self.scale_group else 0
        return math.ceil(head_size * width / 8) + scales + extra


_GPU: Final[frozenset[Device]] = frozenset({"cuda", "rocm"})
_FP8_CPU: Final[frozenset[Device]] = frozenset({"cuda", "cpu", "rocm"})
_CUDA_MLA: Final[frozenset[Device]] = frozenset({"cuda"})


def _turboquant(name: str, key_bits: int, value_bits: int) -> KvDtype:
    """vllm/model_executor/layers/quantization/turboquant/config.py: fp8 keys (8 bits) carry no
    norm; MSE keys add an fp16 norm; values add an fp16 scale and zero; the slot is made even."""
    return KvDtype(name, key_bits=key_bits, value_bits=value_bits, key_extra_bytes=0 if key_bits == 8 else 2,
                   value_extra_bytes=4, slot_align=2, storage_bytes=1, devices=frozenset({"cuda", "rocm"}),
                   cuda_backend="TURBOQUANT", boundary_skip_layers=2)


def _per_token_head(name: str, bits: int) -> KvDtype:
    """TRITON_ATTN packs one fp32 scale after each head's K and V (triton_attn.py customize_spec)."""
    return KvDtype(name, key_bits=bits, key_extra_bytes=4, value_extra_bytes=4, storage_bytes=1,
                   devices=_GPU, cuda_backend="TRITON_ATTN")


KV_DTYPES: Final[tuple[KvDtype, ...]] = (
    KvDtype("auto", key_bits=None, devices=frozenset({"cuda", "cpu", "rocm", "hpu"}),
            mla_devices=frozenset({"cuda", "cpu"}), sparse_mla=True, cuda_backend="FLASH_ATTN"),
    KvDtype("float16", key_bits=16, storage_bytes=2, devices=_GPU, mla_devices=_CUDA_MLA, sparse_mla=True,
            cuda_backend="FLASH_ATTN"),
    KvDtype("bfloat16", key_bits=16, storage_bytes=2, devices=_GPU, mla_devices=_CUDA_MLA, sparse_mla=True,
            cuda_backend="FLASH_ATTN"),
    KvDtype("fp8", key_bits=8, storage_bytes=1, alias_of="fp8_e4m3", devices=_FP8_CPU, mla_devices=_CUDA_MLA,
            sparse_mla=True, cuda_backend="FLASH_ATTN", calibratable=True, fp8_format="fp8_e4m3"),
    KvDtype("fp8_e4m3", key_bits=8, storage_bytes=1, devices=_FP8_CPU, mla_devices=_CUDA_MLA, sparse_mla=True,
            cuda_backend="FLASH_ATTN", calibratable=True, fp8_format="fp8_e4m3"),
    KvDtype("fp8_e5m2", key_bits=8, storage_bytes=1, devices=_FP8_CPU, cuda_backend="FLASHINFER",
            calibratable=True, fp8_format="fp8_e5m2"),
    KvDtype("fp8_inc", key_bits=8, storage_bytes=1, devices=frozenset({"hpu"}),
            note="Intel Gaudi only (vllm-gaudi)"),
    KvDtype("fp8_ds_mla", key_bits=8, row_bytes=656, storage_bytes=1, mla_devices=_CUDA_MLA, sparse_mla=True,
            mla_only=True, note="FLASHMLA_SPARSE's 656-byte row (mla_attention.py)"),
    KvDtype("nvfp4_ds_mla", key_bits=4, row_bytes=352, storage_bytes=1, mla_devices=_CUDA_MLA, sparse_mla=True,
            mla_only=True, note="FLASHMLA_SPARSE on Blackwell (SM100) only: 352-byte rows"),
    _turboquant("turboquant_k8v4", 8, 4),
    _turboquant("turboquant_4bit_nc", 4, 4),
    _turboquant("turboquant_k3v4_nc", 3, 4),
    _turboquant("turboquant_3bit_nc", 3, 3),
    KvDtype("ultraquant_4bit", key_bits=4, scale_group=32, scale_bytes=1, storage_bytes=1,
            devices=frozenset({"rocm"}), boundary_skip_layers=2, note="ROCm gfx950 only (ultraquant_attn.py)"),
    _per_token_head("int4_per_token_head", 4),
    _per_token_head("int8_per_token_head", 8),
    _per_token_head("fp8_per_token_head", 8),
    KvDtype("nvfp4", key_bits=4, scale_group=16, scale_bytes=1, storage_bytes=1, devices=frozenset({"cuda"}),
            cuda_backend="FLASHINFER"),
    KvDtype("nvfp4_4over6", key_bits=4, scale_group=16, scale_bytes=1, storage_bytes=1,
            devices=frozenset({"cuda"}), cuda_backend="FLASHINFER",
            note="FlashInfer's TRT-LLM kernels on Blackwell (SM100) only"),
)
"""One row per vLLM 0.32 ``CacheDType``, in vLLM's order."""

KV_DTYPE_NAMES: Final[tuple[str, ...]] = tuple(row.name for row in KV_DTYPES)
_BY_NAME: Final[dict[str, KvDtype]] = {row.name: row for row in KV_DTYPES}
SKIP_SLIDING_WINDOW: Final = "sliding_window"
"""The attention-type entry --kv-cache-dtype-skip-layers takes besides layer indices."""


def kv_dtype(name: str) -> KvDtype:
    """The row for a --kv-cache-dtype; an unknown name exits 2 listing the known ones."""
    row = _BY_NAME.get(name)
    if row is None:
        raise BadInputError(f"--kv-cache-dtype {name!r}: vLLM 0.32 takes {', '.join(KV_DTYPE_NAMES)}")
    return row


def storage_name(name: str) -> str:
    """The canonical name of a dtype's storage (fp8 → fp8_e4m3)."""
    row = kv_dtype(name)
    return row.alias_of or row.name


def is_quantized(name: str) -> bool:
    """Whether a dtype name (or a model dtype such as float32) is a quantized KV cache."""
    row = _BY_NAME.get(name)
    return row is not None and row.quantized


def fp8_format(name: str) -> Fp8Format | None:
    """The fp8 format a per-tensor-scaled dtype stores, None for every other dtype."""
    row = _BY_NAME.get(name)
    return row.fp8_format if row is not None else None


def calibratable_names() -> tuple[str, ...]:
    """The dtypes ``kvops calibrate`` measures scales for (vLLM loads per-tensor k/v scales)."""
    return tuple(row.name for row in KV_DTYPES if row.calibratable)


def device_names(device: str, use_mla: bool = False) -> tuple[str, ...]:
    """The dtypes a device's attention backends take (MLA backends take fewer)."""
    return tuple(row.name for row in KV_DTYPES if row.runs_on(device, use_mla))


def check_runs_on(name: str, device: str, use_mla: bool = False) -> KvDtype:
    """The row, or one line naming the device and the dtypes it runs (exit 2)."""
    row = kv_dtype(name)
    if row.runs_on(device, use_mla):
        return row
    what = "MLA models" if use_mla else "models"
    where = ", ".join(sorted(row.mla_devices if use_mla else row.devices)) or "no device for these models"
    raise BadInputError(
        f"--kv-cache-dtype {name} does not run on --device {device} for {what} (vLLM 0.32 runs it on: {where}"
        f"{'; ' + row.note if row.note else ''}); --device {device} takes {', '.join(device_names(device, use_mla))}")


def parse_skip_layers(text: str | None) -> tuple[str, ...]:
    """--kv-cache-dtype-skip-layers as vLLM takes it: layer indices and/or ``sliding_window``,
    here comma- or space-separated ("0,1,sliding_window")."""
    if text is None or not text.strip():
        return ()
    items = [item for item in text.replace(",", " ").split() if item]
    for item in items:
        if item != SKIP_SLIDING_WINDOW and not item.isdigit():
            raise BadInputError(f"--kv-cache-dtype-skip-layers {text!r}: {item!r} is neither a layer index nor "
                                f"{SKIP_SLIDING_WINDOW!r}; use e.g. 0,1,{SKIP_SLIDING_WINDOW}")
    return tuple(dict.fromkeys(items))
