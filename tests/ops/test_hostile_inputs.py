"""Hostile input, everywhere (issue 15, item 8): every command's file, number and URL inputs, fed
what a tired operator or a broken peer gives, end within a deadline as exit 2 (bad input) or 1 (a
peer failed) with one line; never a traceback, a hang, or an answer built on absurd input.

In-process through the console-script entry (tests/ops/hostile_peers.py), so no vLLM is started:
every case below is refused before a server would be. The peers are real loopback sockets.
Complements tests/ops/test_capacity_cli.py (fuzzed model-config fields and sizes).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from hostile_peers import BEHAVIOURS, assert_refused, kvops, peer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL_CONFIGS_DIR = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "model-configs"
LLAMA_8B = MODEL_CONFIGS_DIR / "meta-llama--Meta-Llama-3.1-8B.json"
FAST = settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
DEAD = "http://127.0.0.1:9"  # nothing listens on the discard port here

# --- files -----------------------------------------------------------------------------------

# Each file input of each command, {f} where the hostile file goes. Every other input is valid or
# harmless, and nothing here would start a server even if the file were accepted (calibrate and
# offload serve are left to the kinds that can never be valid, below).
FILE_INPUTS = {
    "kv-capacity --model": ["kv-capacity", "--model", "{f}", "--max-model-len", "4096",
                            "--kv-cache-memory-bytes", "8G"],
    "plan --model": ["plan", "--model", "{f}", "--max-model-len", "4096", "--gpu", "H100"],
    "plan --lengths-file": ["plan", "--model", str(LLAMA_8B), "--max-model-len", "4096", "--gpu", "H100",
                            "--lengths-file", "{f}"],
    "plan --calibration": ["plan", "--model", str(LLAMA_8B), "--max-model-len", "4096", "--gpu", "H100",
                           "--calibration", "{f}"],
    "plan --trace": ["plan", "--model", str(LLAMA_8B), "--max-model-len", "4096", "--gpu", "H100",
                     "--trace", "{f}"],
    "verify --expect": ["verify", "--expect", "{f}", "--url", DEAD],
    "verify --log": ["verify", "--calibration-out", "/nonexistent-dir/c.json", "--log", "{f}"],
    "diagnose --result": ["diagnose", "--url", DEAD, "--result", "{f}"],
    "trace stats": ["trace", "stats", "{f}"],
    "offload status --config": ["offload", "status", "--config", "{f}"],
    "alerts k8s --alerts": ["alerts", "k8s", "--alerts", "{f}", "--out-dir", "/nonexistent-dir/k8s"],
}
NEVER_VALID_ONLY = {  # a valid file here would start vLLM or LMCache: only kinds that cannot be valid
    "calibrate --prompts": ["calibrate", "--model", "/nonexistent", "--out", "/tmp/s.json", "--prompts", "{f}"],
    "offload serve --config": ["offload", "serve", "--config", "{f}"],
}


def _args(template: list[str], path: Path) -> list[str]:
    return [str(path) if part == "{f}" else part for part in template]


def _nested(depth: int, yaml_form: bool) -> str:
    return ("[" * depth + "]" * depth) if yaml_form else ('{"a":' * depth + "1" + "}" * depth)


@pytest.fixture
def hostile_files(tmp_path: Path) -> dict[str, Path]:
    """One of each file no command can use; the FIFO has no writer, so opening it would block."""
    files = {"directory": tmp_path / "adir", "fifo": tmp_path / "fifo", "binary": tmp_path / "bin.json",
             "deep": tmp_path / "deep.json", "deep.yaml": tmp_path / "deep.yaml", "huge-line": tmp_path / "huge.json"}
    files["directory"].mkdir()
    os.mkfifo(files["fifo"])
    files["binary"].write_bytes(b"\xde\xad\xbe\xef\x00\xff" * 100)
    files["deep"].write_text(_nested(50_000, False))
    files["deep.yaml"].write_text(_nested(600, True))
    files["huge-line"].write_text('{"x": "' + "a[{" * 400_000 + '"')  # 1.2 MB, one line, unterminated
    return files


YAML_INPUTS = ("offload status --config", "alerts k8s --alerts", "offload serve --config")


@pytest.mark.parametrize("kind", ["directory", "fifo", "binary", "deep", "huge-line"])
@pytest.mark.parametrize("where", [*FILE_INPUTS, *NEVER_VALID_ONLY])
def test_unusable_files_exit_2_in_one_line(hostile_files: dict[str, Path], where: str, kind: str) -> None:
    """Deep: JSON nested 50,000 levels, or YAML 600 for the YAML readers (past Python's recursion
    limit either way). Calibrate takes any text line as a prompt, so only never-valid kinds there."""
    template = {**FILE_INPUTS, **NEVER_VALID_ONLY}[where]
    if where == "calibrate --prompts" and kind in ("deep", "huge-line"):
        kind = "binary"
    if kind == "deep" and where in YAML_INPUTS:
        kind = "deep.yaml"
    assert_refused(kvops(*_args(template, hostile_files[kind])))


@FAST
@given(content=st.binary(max_size=300) | st.text(max_size=300).map(str.encode),
       where=st.sampled_from(sorted(FILE_INPUTS)))
def test_arbitrary_bytes_in_any_file_input(tmp_path_factory: pytest.TempPathFactory, content: bytes,
                                          where: str) -> None:
    """Any content: refused in one line, or (rarely valid) a clean answer; the peer at DEAD may
    be blamed (exit 1) only after the file itself was read as valid."""
    path = tmp_path_factory.mktemp("f") / ("in.yaml" if "config" in where or "alerts" in where else "in.json")
    path.write_bytes(content)
    run = kvops(*_args(FILE_INPUTS[where], path))
    if run.code != 0:
        assert_refused(run, (1, 2, 3) if where.startswith(("verify", "diagnose", "offload status")) else (2,))


@FAST
@given(stamp=st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999"]),
       field=st.sampled_from(["timestamp", "input_length", "output_length"]))
def test_non_finite_numbers_in_a_trace(tmp_path_factory: pytest.TempPathFactory, stamp: str, field: str) -> None:
    row = {"timestamp": 0, "input_length": 100, "output_length": 10, "hash_ids": [1]}
    line = json.dumps(row).replace(f'"{field}": {row[field]}', f'"{field}": {stamp}')
    path = tmp_path_factory.mktemp("t") / "trace.jsonl"
    path.write_text(line + "\n")
    run = kvops("trace", "stats", str(path))
    assert_refused(run)
    assert field in run.err


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "1e400"])
def test_non_finite_numbers_in_a_burstgpt_trace(tmp_path: Path, value: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text(f"Timestamp,Request tokens,Response tokens\n0,10,5\n{value},{value},5\n")
    assert_refused(kvops("trace", "stats", str(path)))


def test_out_dir_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    assert_refused(kvops("alerts", "k8s", "--out-dir", str(tmp_path / "f")))


# --- numbers ---------------------------------------------------------------------------------

ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [math.nan, math.inf, -math.inf, -0.0, 0.0, -1.0, 1e308, 5e-324])
# plan's float options and the range each may take (the rest of the line is a valid plan)
PLAN_FLOATS = {
    "--headroom": (0.0, 0.9), "--gpu-memory-utilization": (0.0, 1.0), "--activation-gib": (0.0, 1e6),
    "--non-torch-gib": (0.0, 1e6), "--cudagraph-gib": (0.0, 1e6), "--host-memory-gib": (0.0, 1e6),
    "--gpu-memory-gib": (0.0, 1e6), "--target-hit-fraction": (0.0, 1.0),
}


@settings(max_examples=25, deadline=None)
@given(option=st.sampled_from(sorted(PLAN_FLOATS)), value=ANY_FLOAT)
def test_plan_float_options(option: str, value: float) -> None:
    """Outside its physical range (NaN included) an option exits 2 naming itself; inside, the plan
    is made or refused in one line."""
    low, high = PLAN_FLOATS[option]
    gpu = [] if option == "--gpu-memory-gib" else ["--gpu", "H100"]
    run = kvops("plan", "--model", str(LLAMA_8B), "--max-model-len", "4096", *gpu, option, repr(value))
    if not low <= value <= high:
        assert_refused(run)
        assert option in run.err
    elif run.code != 0:
        assert_refused(run)


BAD_SECONDS = st.sampled_from(["nan", "inf", "-inf", "-1", "0", "-0.5", "abc", "1e999"])


@FAST
@given(seconds=BAD_SECONDS, where=st.sampled_from([
    ["offload", "check", "--url", DEAD], ["offload", "status", "--url", DEAD],
    ["diagnose", "--url", DEAD, "--window", "0"], ["diagnose", "--prometheus", DEAD],
    ["verify", "--url", DEAD, "--calibration-out", "/nonexistent-dir/c.json"],
    ["loadtest", "prefix-miss", "--url", DEAD, "--out", "/nonexistent-dir/lt"]]))
def test_bad_timeouts_exit_2(seconds: str, where: list[str]) -> None:
    run = kvops(*where, "--timeout", seconds)
    assert_refused(run)
    assert "--timeout" in run.err


@FAST
@given(window=st.sampled_from(["nan", "inf", "-1", "1e9"]), fleet=st.booleans())
def test_bad_diagnose_window_exits_2(window: str, fleet: bool) -> None:
    target = ["--prometheus", DEAD] if fleet else ["--url", DEAD]
    if fleet and window == "1e9":
        window = "1e12"
    assert_refused(kvops("diagnose", *target, "--window", window))


TINY_INTS = ["--layers", "--hidden", "--heads", "--kv-heads", "--head-dim", "--intermediate", "--vocab",
             "--max-position-embeddings"]


@FAST
@given(option=st.sampled_from(TINY_INTS), value=st.integers(max_value=0) | st.integers(min_value=10**12))
def test_model_tiny_refuses_before_building(tmp_path_factory: pytest.TempPathFactory, option: str,
                                            value: int) -> None:
    out = tmp_path_factory.mktemp("m")
    run = kvops("model", "tiny", str(out / "m"), option, str(value))
    assert_refused(run)
    assert not (out / "m").exists()


@FAST
@given(value=st.sampled_from(["nan", "inf", "-1", "0", "-inf"]),
       option=st.sampled_from(["--l1-gib", "--disk-gib", "--port", "--http-port"]))
def test_offload_serve_refuses_before_starting(value: str, option: str) -> None:
    if option.endswith("port") and value in ("nan", "inf", "-inf"):
        value = "-5"
    assert_refused(kvops("offload", "serve", option, value))


@FAST
@given(blocks=st.sampled_from(["-1", "nan", "1e3", "", ",", "1,,x", "99999999999999999999999"]))
def test_trace_cache_blocks(tmp_path_factory: pytest.TempPathFactory, blocks: str) -> None:
    path = tmp_path_factory.mktemp("t") / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 1024, "output_length": 8,
                                        "hash_ids": [1, 2 + i % 3]}) + "\n" for i in range(20)))
    run = kvops("trace", "stats", str(path), "--cache-blocks", blocks)
    if run.code != 0:
        assert_refused(run)


# --- model configs: what vLLM itself refuses, and absurd sizes --------------------------------


def _config(tmp: Path, **changes: object) -> Path:
    cfg = json.loads(LLAMA_8B.read_text())
    cfg.update(changes)
    path = tmp / "config.json"
    path.write_text(json.dumps(cfg))
    return path


@FAST
@given(layers=st.integers(min_value=5_000, max_value=10**12))
def test_absurd_layer_counts_exit_2_quickly(tmp_path_factory: pytest.TempPathFactory, layers: int) -> None:
    path = _config(tmp_path_factory.mktemp("c"), num_hidden_layers=layers)
    run = kvops("kv-capacity", "--model", str(path), "--max-model-len", "4096", "--kv-cache-memory-bytes", "8G")
    assert_refused(run)
    assert "num_hidden_layers" in run.err


@FAST
@given(field=st.sampled_from(["vocab_size", "intermediate_size", "hidden_size"]),
       value=st.integers(max_value=-1) | st.floats(allow_nan=True) | st.text(max_size=3))
def test_negative_or_odd_sizes_never_reach_a_plan(tmp_path_factory: pytest.TempPathFactory, field: str,
                                                  value: object) -> None:
    path = _config(tmp_path_factory.mktemp("c"), **{field: value})
    run = kvops("plan", "--model", str(path), "--max-model-len", "4096", "--gpu", "H100")
    assert_refused(run)
    assert field in run.err


@pytest.mark.parametrize("command", ["kv-capacity", "plan"])
def test_max_model_len_above_the_models_context_is_refused_like_vllm(command: str, tmp_path: Path) -> None:
    """vLLM 0.32 (config/model.py _get_and_verify_max_len) refuses a max_model_len above
    max_position_embeddings, scaled by a RoPE factor except for llama3/yarn/longrope types."""
    plain = _config(tmp_path, max_position_embeddings=4096, rope_scaling=None)
    extra = ["--kv-cache-memory-bytes", "8G"] if command == "kv-capacity" else ["--gpu", "H100"]
    run = kvops(command, "--model", str(plain), "--max-model-len", "4097", *extra)
    assert_refused(run)
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN" in run.err
    assert kvops(command, "--model", str(plain), "--max-model-len", "4096", *extra).code == 0
    # Llama 3.1: 131072 positions, rope_type llama3 (factor 8 not applied by vLLM)
    assert_refused(kvops(command, "--model", str(LLAMA_8B), "--max-model-len", "131073", *extra))
    linear = _config(tmp_path, max_position_embeddings=4096, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert kvops(command, "--model", str(linear), "--max-model-len", "8192", *extra).code == 0


# --- URLs and peers --------------------------------------------------------------------------

URL_COMMANDS = {  # {u}: the URL under test
    "diagnose --url": ["diagnose", "--url", "{u}", "--window", "0.1", "--timeout", "0.6"],
    "diagnose --prometheus": ["diagnose", "--prometheus", "{u}", "--timeout", "0.5"],
    "verify --url": ["verify", "--url", "{u}", "--calibration-out", "/nonexistent-dir/c.json", "--timeout", "0.5"],
    "verify --prometheus": ["verify", "--prometheus", "{u}", "--expect", "{expect}", "--timeout", "0.5"],
    "offload check --url": ["offload", "check", "--url", "{u}", "--timeout", "0.5"],
    "offload status --url": ["offload", "status", "--url", "{u}", "--timeout", "0.5"],
    "loadtest --url": ["loadtest", "prefix-miss", "--url", "{u}", "--timeout", "0.5", "--out", "/nonexistent-dir/lt"],
}


@pytest.fixture(scope="module")
def expect_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = kvops("kv-capacity", "--model", str(LLAMA_8B), "--max-model-len", "4096",
                "--kv-cache-memory-bytes", "8G", "--json")
    assert run.code == 0, run.err
    path = tmp_path_factory.mktemp("e") / "expect.json"
    path.write_text(run.out)
    return path


def _url_args(where: str, url: str, expect: Path) -> list[str]:
    return [url if p == "{u}" else str(expect) if p == "{expect}" else p for p in URL_COMMANDS[where]]


NOT_HTTP = ("garbage", "nothing", "silent", "one-byte-at-a-time")


@pytest.mark.parametrize("behaviour", sorted(BEHAVIOURS))
@pytest.mark.parametrize("where", sorted(URL_COMMANDS))
def test_misbehaving_peers_fail_in_one_line_within_the_timeout(where: str, behaviour: str,
                                                               expect_file: Path) -> None:
    """A peer that sends garbage, nothing, or one byte at a time fails (exit 1); an HTTP answer that
    is not what a vLLM/LMCache/Prometheus server says may also be a wrong --url (exit 2): one line
    either way, within --timeout 0.5 (the helper calls anything past 10 s a hang)."""
    with peer(behaviour) as url:
        run = kvops(*_url_args(where, url, expect_file))
    assert_refused(run, (1,) if behaviour in NOT_HTTP else (1, 2))


@FAST
@given(url=st.sampled_from(["notaurl", "ftp://x", "http://", "http://[::1", "http://h:99999",
                            "http://h:port", "http://a b", "http://h\n:1", "file:///etc/passwd"])
       | st.text(min_size=1, max_size=20).filter(lambda u: not u.startswith(("http://", "https://", "-"))),
       where=st.sampled_from(sorted(URL_COMMANDS)))
def test_malformed_urls_exit_2(url: str, where: str, expect_file: Path) -> None:
    run = kvops(*_url_args(where, url, expect_file))
    assert_refused(run)


@pytest.mark.parametrize(("prefix", "char"), [
    ("", "A"), ("GPU KV cache size: ", "1"), ("Initializing a V1 LLM engine (v", "x"), ("Auto set (", "1"),
    ("Free memory on device (", "."), ("Initializing a V1 LLM engine (v1) with config: model='", "'")])
def test_huge_log_lines_end_quickly(tmp_path: Path, expect_file: Path, prefix: str, char: str) -> None:
    """A 20,000-character line of one character after each log pattern's prefix: the regexes
    (a run of capitals once took 37 s) end well inside the helper's hang limit."""
    log = tmp_path / "server.log"
    log.write_text("INFO start\n" + prefix + char * 20_000 + "\n")
    assert_refused(kvops("verify", "--expect", str(expect_file), "--log", str(log)))
    assert_refused(kvops("verify", "--calibration-out", str(log.parent / "c.json"), "--log", str(log)))


@FAST
@given(case=st.sampled_from([("ttft-regression", "--rate"), ("prefix-miss", "--duration"),
                             ("kv-exhaustion", "--duration"), ("ttft-regression", "--duration"),
                             ("kv-exhaustion", "--users"), ("prefix-miss", "--users")]),
       value=st.sampled_from(["nan", "inf", "-inf", "-1", "0"]))
def test_loadtest_numbers_refused_before_anything_starts(tmp_path_factory: pytest.TempPathFactory,
                                                          case: tuple[str, str], value: str) -> None:
    """Command-line overrides are validated like the scenario file's fields (they once bypassed
    them: --rate nan went on to the server)."""
    scenario, option = case
    if option == "--users" and value in ("nan", "inf", "-inf"):
        value = "-3"
    out = tmp_path_factory.mktemp("lt")
    assert_refused(kvops("loadtest", scenario, "--url", DEAD, option, value, "--out", str(out / "o")))


@pytest.mark.parametrize("flags", [
    ["--block-size", "0"],  # vLLM CacheConfig: block_size gt=0 (here 0 once meant the default)
    ["-tp", "64"],  # 8 KV heads divide into 64 ranks, but vLLM needs TP to divide the 32 query heads
    ["--draft-layers", "100000000"],  # once sized for minutes
])
def test_flags_vllm_refuses_are_refused(flags: list[str]) -> None:
    run = kvops("kv-capacity", "--model", str(LLAMA_8B), "--max-model-len", "4096", "--kv-cache-memory-bytes", "8G",
                *flags)
    assert_refused(run)
    assert flags[0] in run.err or "tensor-parallel-size" in run.err
