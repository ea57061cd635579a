"""The end of a run in the process that owns it: stop scraping, finalize, set the exit code."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from locust.env import Environment

from kvops.core.errors import EXIT_ERROR, KvopsError
from kvops.loadtest.finalize import Run, finalize
from kvops.loadtest.hooks.store import store_of
from kvops.loadtest.scenarios.context import config_of, endpoint_of, model_of, processes_of

log = logging.getLogger("kvops.loadtest")


def finish(environment: Environment) -> None:
    scraper = environment.kvops_scraper  # type: ignore[attr-defined]
    ended = time.time()
    scraper.stop()
    store = store_of(environment)
    opts: Any = environment.parsed_options
    out = Path(opts.kvops_out or f"kvops-loadtest/{store.scenario}-{int(ended)}")
    try:
        run = Run(
            config=config_of(environment), host=str(environment.host), model=model_of(environment),
            started_at=environment.kvops_started_at,  # type: ignore[attr-defined]
            ended_at=ended, records=sorted(store.records, key=lambda r: r.sent_at),
            samples=scraper.samples, out_dir=out,
            baseline=Path(opts.kvops_baseline) if opts.kvops_baseline else None,
            expect=Path(opts.kvops_expect) if getattr(opts, "kvops_expect", "") else None,
            replay=getattr(environment, "kvops_replay", None),
            processes=processes_of(environment), headers=endpoint_of(environment).header_dict(),
            ramp=getattr(environment, "kvops_ramp", None),
            replicas=scraper.replicas, missed=scraper.missed,
            overdue_s=list(store.overdue_s), overdue_count=store.overdue_count,
        )
        result, code = finalize(run)
    except KvopsError as exc:
        sys.stderr.write(f"kvops: {exc}\n")
        environment.process_exit_code = exc.exit_code
        return
    except Exception as exc:  # noqa: BLE001 - report and fail the run, never a silent pass
        log.exception("kvops finalization failed")
        sys.stderr.write(f"kvops: internal error while finalizing: {exc}\n")
        environment.process_exit_code = EXIT_ERROR
        return
    summary = {"scenario": result["scenario"], "verdicts": result["verdicts"], **result["files"]}
    sys.stderr.write("kvops: " + json.dumps(summary) + "\n")
    environment.process_exit_code = code
