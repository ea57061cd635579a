"""Hostile inputs by construction (issue 42, item 5): every file reader types what it reads.

Each reader is handed (1) a valid file of its kind with one value, at any depth, replaced by a
value of another JSON type, (2) derived sizes that round to zero or pass int64, and (3) a valid
file of every other kind kvops reads or writes. Each must end as exit 2 with one line of ours
(or, for a value the reader never looks at, a normal answer): never a traceback, an internal
error, or an answer built on the wrong file. The valid files are made by kvops itself (plan,
kv-capacity, a calibration from a vLLM 0.32 start-up log) or copied from published configs.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from hostile_peers import Run, assert_refused, kvops
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_capacity_plan import GPU_LOG

from kvops.core import kinds
from kvops.core.errors import BadInputError
from kvops.core.fp8.scales import load_scales_file

MODEL_CONFIGS_DIR = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "model-configs"
LLAMA_8B = MODEL_CONFIGS_DIR / "meta-llama--Meta-Llama-3.1-8B.json"
REPO = Path(__file__).resolve().parents[2]
DEAD = "http://127.0.0.1:9"  # nothing listens on the discard port here
# KVOPS_HOSTILE_EXAMPLES=100: a longer search than CI's, by hand
FEW = settings(max_examples=int(os.environ.get("KVOPS_HOSTILE_EXAMPLES", "12")), deadline=None,
               suppress_health_check=list(HealthCheck))
PLAN_ARGS = ["--max-model-len", "4096", "--gpu", "H100"]

# --- one valid file of each kind ------------------------------------------------------------

_TRACE_ROWS = [{"timestamp": i * 100, "input_length": 600 + i, "output_length": 20, "hash_ids": [1, 2 + i]}
               for i in range(4)]
_RESULT = {"schema": "kvops.loadtest.result/1", "scenario": "ttft-regression",
           "ttft": {"summary": {"ttft_p50_s": 0.2, "samples": {"ttft_s": [0.2, 0.3], "itl_mean_s": [0.01, 0.02]},
                                "intervals": {"queue": [[0.5, 2], [0.7, 3]]}, "server_means_s": {"queue": 0.24}}},
           "verdicts": [{"problem": "healthy", "cause": "none", "evidence": {"kv_usage": 0.1},
                         "next": "nothing to do"}]}
_SCALES = {"format_version": 1, "dtype": "fp8_e4m3", "margin": 1.25,
           "model": {"architecture": "LlamaForCausalLM", "num_layers": 1, "num_kv_heads": 8, "head_dim": 128,
                     "config_sha256": "0" * 64},
           "layers": {"model.layers.0.self_attn.attn": {"k_scale": 0.01, "v_scale": 0.01}}}


def _json_out(*args: str) -> dict[str, Any]:
    run = kvops(*args)
    assert run.code == 0, run.err
    doc: dict[str, Any] = json.loads(run.out)
    return doc


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """kind name → a valid file of it."""
    tmp = tmp_path_factory.mktemp("kinds")
    log = tmp / "server.log"
    log.write_text(GPU_LOG)
    out = {"config": tmp / "config.json", "plan": tmp / "plan.json", "kv-capacity": tmp / "kvcap.json",
           "calibration": tmp / "cal.json", "result": tmp / "result.json", "trace": tmp / "trace.jsonl",
           "burstgpt": tmp / "burstgpt.csv", "scales": tmp / "scales.json", "settings": tmp / "kvops.yaml",
           "bench": tmp / "bench.json", "alerts": tmp / "alerts.yaml", "scenario": tmp / "prefix_miss.yaml",
           "log": log, "out": tmp / "k8s", "lengths": tmp / "lengths.csv"}
    out["lengths"].write_text("prompt_tokens,output_tokens\n600,20\n3000,200\n")
    out["config"].write_text(LLAMA_8B.read_text())
    out["plan"].write_text(json.dumps(_json_out("plan", "--model", str(LLAMA_8B), *PLAN_ARGS, "--json")))
    out["kv-capacity"].write_text(json.dumps(_json_out(
        "kv-capacity", "--model", str(LLAMA_8B), "--max-model-len", "4096", "--kv-cache-memory-bytes", "8G", "--json")))
    assert kvops("verify", "--log", str(log), "--calibration-out", str(out["calibration"])).code == 0
    out["result"].write_text(json.dumps(_RESULT, indent=2))
    out["trace"].write_text("".join(json.dumps(row) + "\n" for row in _TRACE_ROWS))
    out["burstgpt"].write_text("Timestamp,Model,Request tokens,Response tokens\n0.5,x,600,20\n1.5,x,700,30\n")
    out["scales"].write_text(json.dumps(_SCALES, indent=2))
    settings_yaml = kvops("plan", "--model", str(LLAMA_8B), *PLAN_ARGS, "--yaml")
    assert settings_yaml.code == 0, settings_yaml.err
    out["settings"].write_text(settings_yaml.out)
    out["alerts"].write_text((REPO / "runbooks" / "alerts.yaml").read_text())
    out["scenario"].write_text((REPO / "loadtest" / "scenarios" / "prefix_miss.yaml").read_text())
    out["bench"].write_text(json.dumps({"bench": "planner", "runs": [{"error_pct": 0.4}]}))
    return out


# reader → (command line, {f} where the file goes; the kinds it takes)
READERS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "plan --model": (["plan", "--model", "{f}", *PLAN_ARGS], ("config",)),
    "kv-capacity --model": (["kv-capacity", "--model", "{f}", "--max-model-len", "4096",
                             "--kv-cache-memory-bytes", "8G"], ("config",)),
    "verify --expect": (["verify", "--expect", "{f}", "--log", "{log}"], ("plan", "kv-capacity")),
    "plan --calibration": (["plan", "--model", str(LLAMA_8B), *PLAN_ARGS, "--calibration", "{f}"], ("calibration",)),
    "diagnose --result": (["diagnose", "--url", DEAD, "--result", "{f}"], ("result",)),
    "trace stats": (["trace", "stats", "{f}"], ("trace", "burstgpt")),
    "plan --trace": (["plan", "--model", str(LLAMA_8B), *PLAN_ARGS, "--trace", "{f}"], ("trace", "burstgpt")),
    "plan --lengths-file": (["plan", "--model", str(LLAMA_8B), *PLAN_ARGS, "--lengths-file", "{f}"], ("lengths",)),
    "loadtest --baseline": (["loadtest", "ttft-regression", "--url", DEAD, "--baseline", "{f}", "--out",
                             "/nonexistent-dir/lt", "--timeout", "0.5"], ("result",)),
    "offload status --config": (["offload", "status", "--config", "{f}", "--timeout", "0.5"], ("settings",)),
    "alerts k8s --alerts": (["alerts", "k8s", "--alerts", "{f}", "--out-dir", "{out}"], ("alerts",)),
    "loadtest --scenario-file": (["loadtest", "prefix-miss", "--url", DEAD, "--scenario-file", "{f}", "--out",
                                  "/nonexistent-dir/lt", "--timeout", "0.5"], ("scenario",)),
}
KIND_NAMES = {"config": kinds.MODEL_CONFIG, "plan": kinds.PLAN, "kv-capacity": kinds.KV_CAPACITY,
              "calibration": kinds.CALIBRATION, "result": kinds.LOADTEST_RESULT, "trace": kinds.TRACE,
              "burstgpt": kinds.TRACE, "scales": kinds.SCALES, "settings": kinds.SETTINGS, "bench": kinds.BENCH,
              "alerts": kinds.ALERTS, "scenario": kinds.SCENARIO}
# 3: the log differs from the plan; 1: the peer is dead (or, for LMCache's port, maybe alive);
# loadtest: the scenario is read, then the dead server or the unwritable --out ends it
ANSWERS = {"verify --expect": (0, 3), "diagnose --result": (1,), "offload status --config": (0, 1),
           "loadtest --scenario-file": (1, 2), "loadtest --baseline": (1, 2)}


def _run(reader: str, path: Path, files: dict[str, Path]) -> Run:
    template = READERS[reader][0]
    named = {"{f}": path, "{log}": files["log"], "{out}": files["out"]}
    return kvops(*[str(named.get(p, p)) for p in template])


def test_each_valid_file_is_read_by_its_reader(files: dict[str, Path]) -> None:
    """The other cases mean something only if the untouched files pass (verify: the plan was made
    for a server the log's differs from, exit 3; diagnose: the file is read, then the dead peer
    is blamed, exit 1)."""
    for reader, (_, takes) in READERS.items():
        for kind in takes:
            run = _run(reader, files[kind], files)
            assert run.code in ANSWERS.get(reader, (0,)), (reader, kind, run.err)


CROSS = [(reader, kind) for reader, (_, takes) in READERS.items() for kind in KIND_NAMES if kind not in takes]


@pytest.mark.parametrize(("reader", "kind"), CROSS)
def test_a_file_of_another_kind_is_named(files: dict[str, Path], reader: str, kind: str) -> None:
    """A model config passed as --expect once "equalled the plan"; now each reader says what it got,
    a YAML file (kvops.yaml, alerts.yaml, a scenario) handed to a JSON, trace or lengths reader too."""
    run = _run(reader, files[kind], files)
    assert_refused(run)
    assert f"this is {KIND_NAMES[kind]}" in run.err, run.err
    expected = READERS[reader][1][0]
    assert f"not {KIND_NAMES.get(expected, 'a lengths file')}" in run.err, run.err


def test_model_config_as_expect_is_not_the_plan(files: dict[str, Path]) -> None:
    """The issue's case, word for word."""
    run = kvops("verify", "--expect", str(files["config"]), "--log", str(files["log"]))
    assert_refused(run)
    assert "this is a model config (config.json), not a plan (kvops plan --json)" in run.err
    assert "equals the plan" not in run.out


# --- wrong JSON types at every level ----------------------------------------------------------

JSON_VALUES = st.sampled_from([None, True, 0, -1, 1.5, "x", [], [1], {}, {"a": 1}])


def _paths(doc: object, prefix: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """Every key path in a decoded document, containers and leaves alike."""
    found: list[tuple[str | int, ...]] = [prefix] if prefix else []
    if isinstance(doc, dict):
        for key, value in doc.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for index, value in enumerate(doc[:3]):
            found += _paths(value, (*prefix, index))
    return found


def _replace(doc: Any, path: tuple[str | int, ...], value: object) -> Any:
    if not path:
        return value
    copy = dict(doc) if isinstance(doc, dict) else list(doc)
    copy[path[0]] = _replace(doc[path[0]], path[1:], value)  # type: ignore[index]
    return copy


def _same_type(a: object, b: object) -> bool:
    kind = {bool: "bool", int: "number", float: "number", str: "str", list: "list", dict: "dict", type(None): "null"}
    return kind[type(a)] == kind[type(b)]


def _mutated(files: dict[str, Path], kind: str, data: st.DataObject, tmp: Path) -> tuple[Path, tuple[str | int, ...]]:
    doc = json.loads(files[kind].read_text())
    path = data.draw(st.sampled_from(_paths(doc)), label="path")
    old: Any = doc
    for part in path:
        old = old[part]
    value = data.draw(JSON_VALUES.filter(lambda v: not _same_type(v, old)), label="value")
    out = tmp / files[kind].name
    out.write_text(json.dumps(_replace(doc, path, value)))
    return out, path


def _refused_or_answered(run: Run, answers: tuple[int, ...]) -> None:
    """A value the reader never reads may leave a normal answer; anything else is one line, exit 2."""
    if run.code not in answers:
        assert_refused(run)


@FEW
@given(data=st.data(), reader=st.sampled_from(["plan --model", "kv-capacity --model"]))
def test_model_config_fields_of_another_type(tmp_path_factory: pytest.TempPathFactory, files: dict[str, Path],
                                             data: st.DataObject, reader: str) -> None:
    path, where = _mutated(files, "config", data, tmp_path_factory.mktemp("c"))
    _refused_or_answered(_run(reader, path, files), (0,))


@pytest.mark.parametrize(("field", "value"), [
    ("architectures", "LlamaForCausalLM"), ("rope_scaling", [8.0]), ("layer_types", "full_attention"),
    ("text_config", [1]), ("quantization_config", "fp8"), ("num_attention_heads", 32.0), ("head_dim", "128"),
    ("vision_config", 3), ("tie_word_embeddings", "false"),
    ("rope_scaling", {"rope_type": [], "factor": 8.0}),  # CI's hypothesis run: "unhashable type: 'list'"
    ("rope_parameters", {"full_attention": {"rope_type": {"a": 1}}})])
def test_a_typed_config_field_of_another_type_is_named(tmp_path: Path, field: str, value: object) -> None:
    """Each was accepted (a string for a list, a list for a mapping) or reached a formula."""
    cfg = json.loads(LLAMA_8B.read_text())
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    run = kvops("plan", "--model", str(tmp_path / "config.json"), *PLAN_ARGS)
    assert_refused(run)
    assert field in run.err


@FEW
@given(data=st.data(), kind=st.sampled_from(["plan", "kv-capacity"]))
def test_expect_fields_of_another_type(tmp_path_factory: pytest.TempPathFactory, files: dict[str, Path],
                                       data: st.DataObject, kind: str) -> None:
    path, _ = _mutated(files, kind, data, tmp_path_factory.mktemp("e"))
    _refused_or_answered(_run("verify --expect", path, files), ANSWERS["verify --expect"])


@FEW
@given(data=st.data())
def test_calibration_fields_of_another_type(tmp_path_factory: pytest.TempPathFactory, files: dict[str, Path],
                                            data: st.DataObject) -> None:
    """Every field of a calibration file is read: any other type is refused naming it."""
    path, where = _mutated(files, "calibration", data, tmp_path_factory.mktemp("cal"))
    run = _run("plan --calibration", path, files)
    if run.code != 0:  # None for an optional term, 1 for a float term, 0/1 for a bool are still values
        assert_refused(run)
        assert str(where[0]) in run.err


@FEW
@given(data=st.data())
def test_result_fields_of_another_type(tmp_path_factory: pytest.TempPathFactory, files: dict[str, Path],
                                       data: st.DataObject) -> None:
    path, _ = _mutated(files, "result", data, tmp_path_factory.mktemp("r"))
    _refused_or_answered(_run("diagnose --result", path, files), ANSWERS["diagnose --result"])


@FEW
@given(data=st.data())
def test_baseline_fields_of_another_type(tmp_path_factory: pytest.TempPathFactory, files: dict[str, Path],
                                         data: st.DataObject) -> None:
    """compare() indexed these after the whole run: a TypeError at the end, now one line at the start."""
    path, _ = _mutated(files, "result", data, tmp_path_factory.mktemp("b"))
    _refused_or_answered(_run("loadtest --baseline", path, files), ANSWERS["loadtest --baseline"])


@pytest.mark.parametrize(("where", "value"), [("samples", []), ("intervals", {"queue": [[1]]}),
                                              ("samples", {"ttft_s": ["0.2"]}), ("intervals", "x")])
def test_a_baseline_of_the_wrong_shape_is_refused_before_the_run(tmp_path: Path, where: str, value: object) -> None:
    doc = json.loads(json.dumps(_RESULT))
    doc["ttft"]["summary"][where] = value
    (tmp_path / "b.json").write_text(json.dumps(doc))
    run = kvops("loadtest", "ttft-regression", "--url", DEAD, "--baseline", str(tmp_path / "b.json"),
                "--out", str(tmp_path / "lt"), "--timeout", "0.5")
    assert_refused(run)
    assert f"ttft.summary.{where}" in run.err


@FEW
@given(data=st.data())
def test_trace_fields_of_another_type(tmp_path_factory: pytest.TempPathFactory, files: dict[str, Path],
                                      data: st.DataObject) -> None:
    row = data.draw(st.sampled_from(_TRACE_ROWS))
    path = data.draw(st.sampled_from(_paths(row)))
    old: Any = row
    for part in path:
        old = old[part]
    value = data.draw(JSON_VALUES.filter(lambda v: not _same_type(v, old)))
    out = tmp_path_factory.mktemp("t") / "trace.jsonl"
    out.write_text("".join(json.dumps(_replace(r, path, value) if r is row else r) + "\n" for r in _TRACE_ROWS))
    _refused_or_answered(_run("trace stats", out, files), (0,))


# --- derived values: zero, past int64, negative ------------------------------------------------

HUGE = st.sampled_from([2**63, 10**30, 10**400])


@FEW
@given(changes=st.sampled_from([{"head_dim": 0}, {"head_dim": -128}, {"hidden_size": 16},
                                {"hidden_size": 4095}, {"num_attention_heads": 0}, {"num_key_value_heads": 0},
                                {"vocab_size": 0}, {"max_position_embeddings": 0}])
       | st.builds(lambda f, v: {f: v}, st.sampled_from(["head_dim", "hidden_size", "max_position_embeddings",
                                                         "intermediate_size", "vocab_size"]), HUGE),
       reader=st.sampled_from(["plan --model", "kv-capacity --model"]))
def test_config_sizes_that_round_to_zero_or_overflow(tmp_path_factory: pytest.TempPathFactory,
                                                     files: dict[str, Path], changes: dict[str, int],
                                                     reader: str) -> None:
    """head_dim 0 was replaced by hidden_size // heads; 16 // 32 = 0 became a cache of 0 bytes a
    token; 10**30 positions planned 10**23 GiB of activation: each now names its field."""
    cfg = {**json.loads(LLAMA_8B.read_text()), **changes}
    path = tmp_path_factory.mktemp("d") / "config.json"
    path.write_text(json.dumps(cfg))
    run = _run(reader, path, files)
    assert_refused(run)
    assert next(iter(changes)) in run.err


@FEW
@given(field=st.sampled_from(["input_length", "output_length", "timestamp"]), value=HUGE)
def test_trace_token_counts_past_any_integer(tmp_path_factory: pytest.TempPathFactory, files: dict[str, Path],
                                             field: str, value: int) -> None:
    """10**30 tokens once ended in 'OverflowError: Python int too large to convert to C long'."""
    rows = [{**_TRACE_ROWS[0], field: value}, *_TRACE_ROWS[1:]]
    path = tmp_path_factory.mktemp("t") / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for reader in ("trace stats", "plan --trace"):
        run = _run(reader, path, files)
        if field == "timestamp" and value < 10**300:
            continue  # a late arrival is a time, not a size: any finite one is read
        assert_refused(run)


TERMS = ["non_kv_gib", "weights_gib", "activation_gib", "non_torch_gib", "cudagraph_gib", "available_kv_gib"]


@FEW
@given(term=st.sampled_from(TERMS), value=st.sampled_from([-1.0, -0.01, -1e6, math.nan, math.inf, -math.inf]))
def test_negative_or_non_finite_calibration_terms_are_refused(tmp_path_factory: pytest.TempPathFactory,
                                                              files: dict[str, Path], term: str,
                                                              value: float) -> None:
    """Named in the last hardening issue: a negative term was planned as negative GiB (more KV
    than the device holds)."""
    cal = {**json.loads(files["calibration"].read_text()), term: value}
    path = tmp_path_factory.mktemp("cal") / "cal.json"
    path.write_text(json.dumps(cal))  # NaN/Infinity as Python's json writes them
    run = _run("plan --calibration", path, files)
    assert_refused(run)
    assert term in run.err


# --- the fp8 scales file (read by the plugin's kv_scales setting and kvops fp8 check --scales) --


@pytest.mark.parametrize("kind", [k for k in KIND_NAMES if k != "scales"])
def test_scales_reader_names_a_file_of_another_kind(files: dict[str, Path], kind: str) -> None:
    with pytest.raises(BadInputError) as caught:
        load_scales_file(files[kind])
    message = str(caught.value)
    assert "\n" not in message
    assert f"this is {KIND_NAMES[kind]}, not {kinds.SCALES}" in message, message


@FEW
@given(data=st.data())
def test_scales_fields_of_another_type(tmp_path_factory: pytest.TempPathFactory, files: dict[str, Path],
                                       data: st.DataObject) -> None:
    """Loaded as written, or one BadInputError: no other exception reaches the plugin."""
    path, _ = _mutated(files, "scales", data, tmp_path_factory.mktemp("s"))
    message = ""
    try:
        load_scales_file(path)
    except BadInputError as exc:
        message = str(exc)
    assert "\n" not in message


# --- sizes on the command line past any integer ----------------------------------------------------


@FEW
@given(flag=st.sampled_from(["--max-model-len", "--kv-cache-memory-bytes", "--max-num-batched-tokens"]),
       value=st.sampled_from(["9" * 400 + "k", "9" * 400 + "GiB", "1" + "0" * 30, str(2**63), "1" + "0" * 400 + ".5t"]))
def test_command_line_sizes_past_int64(flag: str, value: str) -> None:
    """A decimal suffix on 400 digits once ended in 'OverflowError: cannot convert float infinity to
    integer'; 10**35 bytes once planned 7.6e29 tokens of KV."""
    args = {"--max-model-len": "4096", "--kv-cache-memory-bytes": "8G", flag: value}
    run = kvops("kv-capacity", "--model", str(LLAMA_8B), *[part for pair in args.items() for part in pair])
    assert_refused(run)
    assert flag in run.err
