"""Fixtures shared by every test: the repo root, the shared fixtures folder, a tiny model."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvops.ops.launch import SERVER_NICE_ENV

# Every server the tests start (vLLM, LMCache, the proxy, Prometheus) runs at nice 5 and the
# load generators at 0, as if each had its own machine: on two cores a CPU vLLM's spinning
# OpenMP threads otherwise hold the client seconds behind its schedule and the scenarios answer
# inconclusive/client-bound (CI, stop 19). Each ready server's session (its scheduling
# autogroup) is niced too: with only the threads niced, the number counted for nothing against
# the test session (stop 20). 5, not 10: at 10 a server's OpenMP thread sharing a core with the
# test's own threads got a tenth of it, every step waited for it, and the e2e files took 81
# minutes instead of 63 in a clean-clone run (Locust's run-queue wait fell from 0.87 to 0.11 of
# its CPU time); 5 gives the client three quarters of a contended core. Set it to 0 to run them
# side by side unprioritised.
os.environ.setdefault(SERVER_NICE_ENV, "5")
REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DIR = (REPO_ROOT.parent / "shared").resolve()
MODEL_CONFIGS_DIR = SHARED_DIR / "fixtures" / "model-configs"


RUNS_AFTER = {"test_runbooks_e2e": "test_loadtest_faults_e2e", "test_plugin_e2e": "test_offload_faults_e2e"}
"""E2E modules moved to run right after the module that last used the server configurations
they share, so that the pool still holds them: the runbook states' default 2048-token server
(the load-test modules'), the plugin module's plugin-free server (the offload modules'). In file
order each of those was started twice (and the prefix-caching-off one) in every CI run."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Unit tests first, then the e2e tests (each group in file order, but RUNS_AFTER): a unit
    failure shows in minutes, and the first e2e modules' servers start while the unit tests run."""
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        first.setdefault(_module_name(item), index)

    def place(item: pytest.Item) -> tuple[bool, int, int]:
        if item.get_closest_marker("e2e") is None:
            return (False, 0, 0)  # the sort is stable: the unit tests keep their order
        anchor = RUNS_AFTER.get(_module_name(item), "")
        if anchor in first:
            return (True, first[anchor], 1)
        return (True, first[_module_name(item)], 0)

    items.sort(key=place)


def _module_name(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")


FILES_LISTED = 15


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """CI's log says where the suite's time budget (~35 minutes) goes: the unit and the e2e
    tests' seconds, and the slowest test files (their tests' setup, call and teardown; a module
    fixture counts in its first test's setup)."""
    per_file: Counter[str] = Counter()
    e2e = 0.0
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                per_file[report.nodeid.split("::")[0]] += report.duration
                e2e += report.duration if "e2e" in report.keywords else 0.0
    if not per_file:
        return
    total = sum(per_file.values())
    terminalreporter.write_sep("=", f"time per test file: unit {total - e2e:.0f} s, e2e {e2e:.0f} s")
    for path, seconds in per_file.most_common(FILES_LISTED):
        terminalreporter.write_line(f"{seconds:7.1f}s {path}")


@pytest.fixture(autouse=True)
def _environment_kept(request: pytest.FixtureRequest) -> Iterator[None]:
    """What a unit test leaves in os.environ is undone after it: the e2e servers, which start
    after the unit tests, inherit this process's environment. Found by running them in that
    order: vLLM's CPU platform, brought up in-process by a bench unit test, sets LD_PRELOAD and
    seven other variables; an armed refusal hook (tests/plugin/test_engine_refusal.py) left
    KVOPS_FRONTEND_PID, and a refusing server took itself for an engine process."""
    if request.node.get_closest_marker("e2e"):
        yield
        return
    before = dict(os.environ)
    yield
    for name in set(os.environ) - set(before) - {"PYTEST_CURRENT_TEST"}:
        del os.environ[name]
    for name, value in before.items():
        if os.environ.get(name) != value and name != "PYTEST_CURRENT_TEST":
            os.environ[name] = value


@pytest.fixture(scope="session", autouse=True)
def _e2e_servers_ahead(request: pytest.FixtureRequest,
                       tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """While the unit tests run (one core of two, mostly), the first e2e modules' servers start
    at low priority (tests/e2e/conftest.py ``start_ahead``); nothing where no e2e test or no
    unit test is selected."""
    items = request.session.items
    modules = list(dict.fromkeys(item.module for item in items if item.get_closest_marker("e2e")))
    if not modules or items[0].get_closest_marker("e2e"):
        yield
        return
    from e2e.conftest import session_pool, start_ahead

    start_ahead(modules, tmp_path_factory)
    yield
    session_pool(tmp_path_factory).stop_all()  # as the `vllm` fixture does, had no e2e test run


@pytest.fixture(scope="session")
def model_configs_dir() -> Path:
    assert MODEL_CONFIGS_DIR.is_dir(), f"missing {MODEL_CONFIGS_DIR}: ../shared must sit beside the repo"
    return MODEL_CONFIGS_DIR
