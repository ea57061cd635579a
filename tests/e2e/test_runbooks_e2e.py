"""Every command block of every runbook page, run against the real stack in the state the page
describes (tests/runbooks/states.py), must exit as the page says and print what the page shows.

Blocks run in the order of the states (each state is entered once; its server comes from the
session pool and its load runs only while it is active), and, within a state, page by page.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import pytest
from fp8_cpu import CPU_RUNS_FP8, needs_fp8_cpu
from runbooks.markup import Check, missing_lines, pages
from runbooks.stack import Stack, plain_refusals
from runbooks.states import STATE_ORDER, state

from .conftest import Refusals, TinyModels, later_servers
from .starved import RERUNS, client_bound_output, note_rerun

pytestmark = pytest.mark.e2e

CHECKS: list[Check] = sorted(
    (c for p in pages() for c in p.checks),
    key=lambda c: (STATE_ORDER[c.state], c.page, c.line),
)
# States that serve fp8 KV exist only on a CPU where vLLM runs it.
PARAMS = [pytest.param(c, id=c.id, marks=needs_fp8_cpu if "fp8" in state(c.state).args else ())
          for c in CHECKS]


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, vllm, tiny_models,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    selected = [item.callspec.params["check"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")]
    visits = dict.fromkeys(c.state for c in selected if CPU_RUNS_FP8 or "fp8" not in state(c.state).args)
    stack = Stack(vllm, tiny_models, tmp_path_factory.mktemp("runbooks"), list(visits))
    yield stack
    stack.close()


def refusals(models: TinyModels, root: Path) -> Refusals:
    """The states' refusals that can start beside the unit tests (conftest ``module_refusals``,
    runbooks.stack ``plain_refusals``)."""
    return {}, plain_refusals(models)


OWN_AHEAD = True
"""The stack's later states' servers start ahead before the next modules' (_states_ahead)."""


@pytest.fixture(autouse=True)
def _states_ahead(request: pytest.FixtureRequest, stack: Stack, tiny_models) -> None:
    stack.ahead(*(w.on(tiny_models) for w in later_servers(request)))


def _quiet(stack: Stack, check: Check) -> AbstractContextManager[None]:
    """A ttft-regression load test records or compares latency: the starts ahead wait while it
    runs (VllmServers.quiet), as in the load-test module's baseline test. Without it, the
    confirmation after a mitigation (ttft-regression.md, state healthy) ran beside the next
    state's server start that the baseline just before had not had, and read ITL +52% (CI 0.36
    to 0.68): "decode" regressed, exit 3 (clean-clone run, this session's AVX2 machine).
    Held here, after ``stack.enter``, not by the ``quiet`` mark: the mark's fixture holds from
    before the state's servers are asked for (one of them may be a held start, waited for
    without end), and this module's own starts ahead (``_states_ahead``) come after it."""
    return stack.servers.quiet() if "loadtest ttft-regression" in check.command else nullcontext()


@pytest.mark.parametrize("check", PARAMS)
def test_runbook_command(stack: Stack, check: Check) -> None:
    stack.enter(check.state)
    with _quiet(stack, check):
        result = stack.run(check.command, stack.workdir(check.page))
        for _ in range(RERUNS):
            if not client_bound_output(result.output) or client_bound_output("\n".join(check.expected)):
                break
            note_rerun(result.output)  # the verdict says the client measured nothing (starved.py)
            result = stack.run(check.command, stack.workdir(check.page))
    where = f"{check.page}:{check.line} in state {check.state}:\n$ {check.command}\n{result.output}"
    assert result.exit_code == check.exit_code, f"exit {result.exit_code}, page says {check.exit_code}: {where}"
    missing = missing_lines(check.expected, result.output)
    assert not missing, f"the page promises lines that were not printed: {missing}\n{where}"
