"""trace-replay locustfile: a production trace (--kvops-trace) replayed at its own arrival
times ÷ speedup, prompts built block by block from its block ids; the report puts the server's
prefix hit ratio beside the one the trace predicts for its cache."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import gevent
from locust import LoadTestShape, constant, events, task
from locust.env import Environment
from locust.runners import WorkerRunner

from kvops.core.trace.replay import Replay, ReplayRequest
from kvops.loadtest.analysis.replay import load_replay, server_max_model_len
from kvops.loadtest.config import TraceReplayConfig
from kvops.loadtest.scenarios import context, glue
from kvops.loadtest.shapes.stepped import SPAWN_RATE
from kvops.loadtest.shapes.trace import TraceSchedule
from kvops.loadtest.users.openai import OpenAIStreamUser

glue.wire("trace-replay")
__all__ = ["TraceReplayShape", "TraceReplayUser"]


@events.init_command_line_parser.add_listener  # type: ignore[untyped-decorator]
def _arguments(parser: Any) -> None:
    parser.add_argument("--kvops-trace", default="", help="Mooncake JSONL or BurstGPT CSV to replay")
    parser.add_argument("--kvops-speedup", type=float, default=0.0, help="arrival times ÷ this (0: the file's)")
    parser.add_argument("--kvops-length-scale", type=float, default=0.0,
                        help="lengths × this (0: the file's)")


def _config(environment: Environment) -> TraceReplayConfig:
    config = context.config_of(environment)
    assert isinstance(config, TraceReplayConfig)
    return config


def replay_of(environment: Environment) -> Replay:
    replay = getattr(environment, "kvops_replay", None)
    if replay is None:
        opts: Any = environment.parsed_options
        max_len = server_max_model_len(str(environment.host))
        replay = load_replay(_config(environment), Path(opts.kvops_trace) if opts.kvops_trace else None,
                             max_len)
        environment.kvops_replay = replay  # type: ignore[attr-defined]
    return replay


def schedule_of(environment: Environment) -> TraceSchedule:
    """This process's share of the trace: every N-th request, N the number of processes."""
    schedule = getattr(environment, "kvops_trace_schedule", None)
    if schedule is None:
        runner = environment.runner
        index = runner.worker_index if isinstance(runner, WorkerRunner) else 0
        processes = max(1, int(getattr(environment.parsed_options, "kvops_processes", 1) or 1))
        mine = [r for i, r in enumerate(replay_of(environment).requests) if i % processes == index]
        schedule = TraceSchedule(mine)
        environment.kvops_trace_schedule = schedule  # type: ignore[attr-defined]
    return schedule


class TraceReplayShape(LoadTestShape):
    """The pool until this process's trace is done, or the trace's length plus drain_s."""

    def tick(self) -> tuple[int, float] | None:
        assert self.runner is not None
        env = self.runner.environment
        config = _config(env)
        schedule = getattr(env, "kvops_trace_schedule", None)
        if schedule is not None and schedule.done:
            return None
        elapsed: float = self.get_run_time()  # type: ignore[no-untyped-call]
        if elapsed > replay_of(env).duration_s + config.drain_s:
            return None
        return config.users, max(SPAWN_RATE, float(config.users))


class TraceReplayUser(OpenAIStreamUser):
    wait_time = constant(0)

    @task
    def request(self) -> None:
        context.model_of(self.environment)  # resolved before a slot is claimed, never late
        schedule = schedule_of(self.environment)
        claimed = schedule.claim()
        if claimed is None:
            gevent.sleep(0.5)
            return
        item, at = claimed
        try:
            gevent.sleep(max(0.0, at - time.time()))
            self.stream(self._body(item), scheduled_at=at, group=str(item.index))
        finally:
            schedule.finished()

    def _body(self, item: ReplayRequest) -> dict[str, Any]:
        return {"model": context.model_of(self.environment), "prompt": replay_of(self.environment).prompt(item),
                "max_tokens": item.max_tokens, "ignore_eos": True, "temperature": 0.0}
