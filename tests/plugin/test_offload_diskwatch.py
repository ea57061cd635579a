"""The disk-tier watch: a real directory that refuses writes, then takes them again."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge

from kvops.core.offload.preflight import disk_write_problem
from kvops.plugin.offload.diskwatch import DiskWatch


@pytest.fixture
def degraded() -> Gauge:
    return Gauge("kvops_offload_disk_degraded", "test", registry=CollectorRegistry())


def test_a_missing_directory_is_a_problem_named_by_the_os(tmp_path: Path):
    assert disk_write_problem(tmp_path) is None
    assert disk_write_problem(tmp_path / "gone") == "No such file or directory"
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing behind


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_watch_logs_and_publishes_each_transition_once(tmp_path: Path, degraded: Gauge):
    disk = tmp_path / "l2"
    disk.mkdir()
    watch = DiskWatch(disk, degraded)
    logger = logging.getLogger("vllm.plugins.kvops.offload")
    seen = _Records()  # on the logger itself: vLLM's "vllm" logger does not propagate to the root
    logger.addHandler(seen)

    assert watch.check() is None
    assert degraded._value.get() == 0
    disk.rmdir()  # writes now fail for real (ENOENT), as they would on a full or read-only disk
    assert watch.check() == "No such file or directory"
    assert watch.check() == "No such file or directory"
    assert degraded._value.get() == 1
    disk.mkdir()
    assert watch.check() is None
    assert degraded._value.get() == 0

    logger.removeHandler(seen)
    messages = [(r.levelname, r.getMessage()) for r in seen.records]
    assert len(messages) == 2
    assert messages[0][0] == "ERROR"
    assert "DISK DEGRADED" in messages[0][1]
    assert "No such file or directory" in messages[0][1]
    assert messages[1][0] == "WARNING"
    assert "takes writes again" in messages[1][1]
