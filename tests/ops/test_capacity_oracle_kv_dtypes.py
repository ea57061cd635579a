"""Every KV cache dtype vLLM 0.32 accepts, with and without --kv-cache-dtype-skip-layers, against
vLLM's own spec code run on this CPU.

The oracle side decides each layer's dtype as vLLM's attention layer does (a copy of
model_executor/layers/attention/attention.py:299-315, the only part not called: building a real
Attention layer needs a GPU platform), adds TurboQuant's boundary layers with vLLM's
``TurboQuantConfig.get_boundary_skip_layers``, gives each layer the first backend of Hopper's
priority list whose class takes its dtype (the list of platforms/cuda.py:168-179; CPU: CPU_ATTN,
CPU_MLA), then lets vLLM do the rest: ``Platform.update_block_size_for_backend`` (block size and
the heterogeneous-dtype alignment that sets ``skip_page_size_padded``), ``Attention.get_kv_cache_spec``
/ ``MLAAttention.get_kv_cache_spec`` called on the layer's fields, the worker's
``customize_attention_spec`` (each backend's packing), ``get_kv_cache_configs`` and
``get_kv_cache_capacity``. A dtype no backend of the device takes is refused by vLLM; we must refuse
it too (exit 2), otherwise the numbers must be EQUAL.

FlashInfer (Hopper's second backend, the one that packs nvfp4) imports the ``flashinfer`` package at
module level, which has no CPU build: a stand-in module lets vLLM's own FlashInferBackend class load
(its customize_spec and kernel block sizes are plain Python); nothing of flashinfer is called.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_capacity_oracle import (
    FIXTURES,
    GIB,
    Oracle,
    capacity_or_none,
    oracle_layer_kinds,
    synthetic_configs,
)

from kvops.core.errors import BadInputError
from kvops.ops.capacity.allocator import SizingFlags
from kvops.ops.capacity.model import read_model

HOPPER = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION", "TURBOQUANT")  # platforms/cuda.py:168-179
HOPPER_MLA = ("FLASH_ATTN_MLA", "FLASHMLA", "FLASHINFER_MLA", "TRITON_MLA", "FLASHMLA_SPARSE")  # :147-153
# FLASH_ATTN_MLA's module imports flash-attn kernels absent on CPU; its list (flashattn_mla.py:43-47):
FLASH_ATTN_MLA_DTYPES = ("auto", "float16", "bfloat16")
REFUSED = "refused"


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stands in for the ``flashinfer`` package so vLLM's FlashInfer backend class can be imported."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == "flashinfer" or name.startswith("flashinfer."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _DummyMeta(type):
    def __getattr__(cls, name: str) -> Any:
        return _Dummy


class _Dummy(metaclass=_DummyMeta):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Dummy


def _with_stub_flashinfer(load: Any) -> Any:
    """Run ``load`` with the stand-in flashinfer importable, then take it away again (other tests
    look at sys.meta_path and at whether flashinfer imports); the loaded classes stay cached."""
    finder = _StubFinder()
    sys.meta_path.append(finder)  # after the real finders: a real flashinfer wins
    try:
        return load()
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n, m in sys.modules.items() if isinstance(m, _StubModule)]:
            del sys.modules[name]


class DtypeOracle:
    def __init__(self, base: Oracle) -> None:
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention
        from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
        from vllm.model_executor.models.utils import extract_layer_index
        from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
        from vllm.v1.attention.backend import AttentionType
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        from vllm.v1.worker.utils import customize_attention_spec

        self.base, self.Attention, self.MLA = base, Attention, MLAAttention
        self.tq, self.layer_index, self.to_torch = TurboQuantConfig, extract_layer_index, kv_cache_dtype_str_to_dtype
        self.decoder, self.customize = AttentionType.DECODER, customize_attention_spec
        self.enum = AttentionBackendEnum
        self.flashinfer = _with_stub_flashinfer(lambda: [AttentionBackendEnum[name].get_class()
                                                         for name in ("FLASHINFER", "FLASHINFER_MLA")])

    def backend(self, device: str, use_mla: bool, dtype: str) -> Any:
        """The first backend of the device's priority list whose class lists the dtype, or None."""
        names = (("CPU_MLA",) if use_mla else ("CPU_ATTN",)) if device == "cpu" else (
            HOPPER_MLA if use_mla else HOPPER)
        for name in names:
            if name == "FLASH_ATTN_MLA":
                if dtype in FLASH_ATTN_MLA_DTYPES:
                    return self.enum["TRITON_MLA"].get_class()  # same spec, same MultipleOf(16) blocks
                continue
            cls = self.enum[name].get_class()
            if dtype in cls.supported_kv_cache_dtypes:
                return cls
        return None

    def run(self, cfg: dict[str, Any], case: dict[str, Any]) -> tuple[int, int, float] | str | None:
        from vllm.platforms.interface import Platform

        vc = self.base.vllm_config(cfg, case)
        vc.model_config.is_hybrid = False
        vc.model_config.get_num_attention_heads = lambda pc: cfg["num_attention_heads"] // pc.tensor_parallel_size
        kv, use_mla, device = case["kv"], vc.use_mla, case["device"]
        skip = list(case.get("skip", ()))
        if kv.startswith("turboquant_") or kv == "ultraquant_4bit":  # engine/arg_utils.py:2293-2310
            skip = sorted(set(skip) | set(self.tq.get_boundary_skip_layers(vc.model_config)))
        vc.cache_config.kv_cache_dtype_skip_layers = skip
        layers = []
        for i, kind in enumerate(oracle_layer_kinds(cfg)):
            name = f"model.layers.{i}.self_attn.attn"
            window = cfg["sliding_window"] if kind == "sliding" else None
            dtype = kv
            if skip and ((window is not None and not use_mla and "sliding_window" in skip)
                         or str(self.layer_index(name)) in skip):
                dtype = "auto"
            backend = self.backend(device, use_mla, dtype)
            if backend is None:
                return REFUSED
            layers.append((name, dtype, window, backend))
        backends = list(dict.fromkeys(b for *_, b in layers))
        Platform._find_non_ssm_backends = classmethod(lambda cls, config: backends)  # type: ignore[assignment,method-assign]
        vc.cache_config.user_specified_block_size = device == "cpu" or use_mla  # cpu.py / MLA: as test_capacity_oracle
        Platform.update_block_size_for_backend(vc)
        heads = vc.model_config.get_num_kv_heads(vc.parallel_config)
        specs = {}
        for name, dtype, window, backend in layers:
            fields = SimpleNamespace(
                attn_type=self.decoder, kv_cache_dtype=dtype, sliding_window=window, attn_backend=backend,
                num_kv_heads=heads, head_size=vc.head, head_size_v=vc.head, indexer=None,
                non_causal_multi_token_decode=False,
                kv_cache_torch_dtype=self.to_torch(dtype, vc.model_config))
            layer_cls = self.MLA if use_mla else self.Attention
            specs[name] = self.customize(backend, layer_cls.get_kv_cache_spec(fields, vc))
        try:
            [config] = self.base.utils.get_kv_cache_configs(vc, [specs], [case["budget"]])
        except (ValueError, AssertionError):  # vLLM does not start (AssertionError: a padded page grown
            return None  # past its padding, kv_cache_utils.py unify_kv_cache_spec_page_size)
        tokens, conc = self.base.utils.get_kv_cache_capacity(vc, config)
        return config.num_blocks, tokens, conc


def ours(cfg: dict[str, Any], case: dict[str, Any]) -> tuple[int, int, float] | str | None:
    try:
        model = read_model(cfg, tp=case["tp"], kv_cache_dtype=case["kv"], skip_layers=tuple(case.get("skip", ())),
                           device=case["device"])
    except BadInputError:
        return REFUSED
    flags = SizingFlags(max_model_len=case["mml"], device=case["device"], max_num_batched_tokens=case["mnbt"])
    return capacity_or_none(model, case["budget"], flags)


@pytest.fixture(scope="module")
def dtype_oracle() -> DtypeOracle:
    return DtypeOracle(Oracle())


def cache_dtypes() -> tuple[str, ...]:
    """vLLM's own list, read from the Literal (vllm/config/cache.py CacheDType)."""
    from typing import get_args

    from vllm.config.cache import CacheDType

    return get_args(CacheDType)


def load(name: str) -> dict[str, Any]:
    if name in synthetic_configs():
        return synthetic_configs()[name]
    cfg: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    cfg.setdefault("torch_dtype", "bfloat16")
    return cfg


# Dense GQA (head_dim 128), sliding + full layers (gpt-oss: head_dim 64), MLA, every layer sliding.
CONFIGS = ("meta-llama--Meta-Llama-3.1-8B.json", "openai--gpt-oss-20b.json", "deepseek-ai--DeepSeek-V3.json",
           "mistral_all_sw")
SKIPS: dict[str, tuple[tuple[str, ...], ...]] = {
    "meta-llama--Meta-Llama-3.1-8B.json": ((), ("0", "31"), ("5",)),
    "openai--gpt-oss-20b.json": ((), ("sliding_window",), ("0", "3")),
    "deepseek-ai--DeepSeek-V3.json": ((),),
    "mistral_all_sw": ((), ("sliding_window",), ("0", "3")),  # all skipped: the dtype reaches no backend
}


def cases(name: str) -> list[dict[str, Any]]:
    out = []
    for kv in cache_dtypes():
        for skip in SKIPS[name]:
            for device in ("cuda", "cpu"):
                for budget, mml in ((int(2.5 * GIB), 4096), (20 * GIB + 12345, 32_000)):
                    out.append({"budget": budget, "mml": mml, "tp": 1 if "DeepSeek" in name else 2, "kv": kv,
                                "skip": skip, "device": device, "mnbt": 2048})
    return out


@pytest.mark.parametrize("name", CONFIGS, ids=lambda n: Path(n).stem)
def test_every_cache_dtype_matches_vllm(dtype_oracle: DtypeOracle, name: str) -> None:
    cfg = load(name)
    planned = 0
    for case in cases(name):
        expected, got = dtype_oracle.run(cfg, case), ours(cfg, case)
        assert got == expected, f"{Path(name).stem} {case}: ours {got} vLLM {expected}"
        planned += got not in (REFUSED, None)
    assert planned, "no case was planned"


def test_mla_skip_layers_are_refused_not_guessed() -> None:
    with pytest.raises(BadInputError, match="MLA model"):
        read_model(load("deepseek-ai--DeepSeek-V3.json"), kv_cache_dtype="fp8", skip_layers=("0",), device="cuda")
